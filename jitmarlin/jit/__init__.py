"""The JIT machinery: toolchain discovery, build specs, the per-device cache, building under a
file lock, and loading/launching cubins. It knows nothing about any particular kernel."""
