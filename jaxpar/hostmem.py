"""Host memory for XLA:CPU on one device: keep freed memory for the next step instead of
faulting it in again. Opt-in: JAXPAR_HOST_MALLOC=keep.

XLA:CPU allocates a program's temporaries as one block per execution (183 MB for the vs_pytorch
step) and frees it at the end. glibc serves a block that large from a fresh `mmap` when the
allocating thread is not the main one (its arena cannot hold it), so every step page-faults the
whole block again and the kernel zeroes it: measured 44,800 minor faults and 0.12 s of system
time per step, a quarter of the step's wall time on the 2-core machine. With every thread on
glibc's main arena, no `mmap` for large blocks and no trimming of the heap's top, the block
freed by one step is the block the next step gets: no faults, same results (534 -> 407 ms a step).

It is not the default because one arena serialises every thread's malloc: with 8 simulated CPU
devices in one process (the main job's 2x4x1) the step went from 173 to 254 ms, the system time
from 10 to 53 ms a step. With JAXPAR_HOST_MALLOC=keep, `import jaxpar` applies it when JAX can
only run on the CPU (no accelerator plugin installed, or JAX_PLATFORMS=cpu) and the C library is
glibc; it must happen before JAX starts its threads, which is why it happens at import. The
heap then does not shrink: the process keeps its peak host memory until it exits.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys

ENV = "JAXPAR_HOST_MALLOC"  # "keep": keep freed memory (one arena, no mmap, no trim)
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int

applied = False  # whether keep_freed_memory() took effect in this process


def cpu_only() -> bool:
  """True when JAX will run on the host: JAX_PLATFORMS says cpu, or no GPU/TPU plugin exists."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms == "cpu"
  if importlib.metadata.entry_points(group="jax_plugins"):  # jax-cuda*-plugin, ROCm, ...
    return False
  return importlib.util.find_spec("libtpu") is None


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to one arena, no mmap, no trimming; True where it took effect."""
  global applied
  if sys.platform != "linux":
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.gnu_get_libc_version  # glibc only: musl has no mallopt with these meanings
  except (OSError, AttributeError):
    return False
  applied = all(libc.mallopt(p, v) == 1 for p, v in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
  return applied


def configure() -> bool:
  """What `import jaxpar` runs: keep_freed_memory() where JAXPAR_HOST_MALLOC=keep asks for it and
  JAX can only run on the CPU."""
  if os.environ.get(ENV, "").strip().lower() != "keep" or not cpu_only():
    return False
  return keep_freed_memory()
