"""The SIMT emulator that runs our CUDA kernel sources on the CPU (see simt.h and emu.py)."""
