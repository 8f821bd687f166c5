"""Exceptions raised by jitmarlin.

Every error names the offending value and the rule it broke, so that the message alone tells
the user what to change.
"""


class JitMarlinError(RuntimeError):
    """Base class of every jitmarlin error."""


class UnsupportedDeviceError(JitMarlinError):
    """No CUDA device, or its compute capability is below 8.0."""


class ToolchainError(JitMarlinError):
    """nvcc or ninja missing, or nvcc's CUDA major version differs from torch's."""


class BuildError(JitMarlinError):
    """A kernel module failed to compile. The message carries the command and the log tail."""


class CacheMissError(JitMarlinError):
    """JITMARLIN_DISABLE_JIT=1 and the needed module is not in the cache."""


class CachePermissionError(JitMarlinError):
    """The cache directory is owned by another user or writable by others."""


class LaunchError(JitMarlinError):
    """The CUDA driver refused to load or launch a kernel."""
