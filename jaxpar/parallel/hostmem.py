"""Host memory for XLA:CPU on one device: keep freed memory for the next step instead of
faulting it in again.

XLA:CPU allocates a program's temporaries as one block per execution (183 MB for the vs_pytorch
step) and frees it at the end. glibc serves a block that large from a fresh `mmap` when the
allocating thread is not the main one (its arena cannot hold it), so every step page-faults the
whole block again and the kernel zeroes it: measured 44,800 minor faults and 0.12 s of system
time per step, a quarter of the step's wall time on the 2-core machine. With every thread on
glibc's main arena, no `mmap` for large blocks and no trimming of the heap's top, the block
freed by one step is the block the next step gets: no faults, same results (534 -> 407 ms a step).

One arena serialises every thread's malloc, which costs more than it saves when several
simulated devices run in one process: with the main job's 8 (2x4x1) the step went from 173 to
254 ms, the system time from 10 to 53 ms a step. Hence the rule, JAXPAR_HOST_MALLOC:
  unset or "auto"  train.py applies it when this process drives one CPU device (`configure(1)`
                   from cli.setup, before JAX starts): a one-device run, or each process of a
                   multi-process CPU run with one device each;
  "keep"           `import jaxpar` applies it whatever the device count;
  "off"            never.
Only where JAX can only run on the CPU (no accelerator plugin installed, or JAX_PLATFORMS=cpu)
and the C library is glibc. It must happen before JAX starts its backend's threads (set later it
has no effect), i.e. before the first computation. The heap then does not shrink: the process
keeps its peak host memory until it exits.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
import sys

from jaxpar.config import ConfigError

ENV = "JAXPAR_HOST_MALLOC"  # "auto" (unset), "keep" or "off"; see above
MODES = ("auto", "keep", "off")
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


def mode() -> str:
  """JAXPAR_HOST_MALLOC: "auto" when unset; a value not in MODES is returned as it is."""
  return os.environ.get(ENV, "").strip().lower() or "auto"


def cpu_devices_requested() -> int:
  """The CPU device count XLA_FLAGS asks for (--xla_force_host_platform_device_count), else 1."""
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else 1


def configure(local_devices: int | None = None) -> bool:
  """Applies keep_freed_memory() where JAXPAR_HOST_MALLOC's rule says so (see above); True if it
  did. `import jaxpar` calls it without `local_devices` ("keep" only); train.py with the number
  of devices this process drives, before JAX starts."""
  want = mode()
  if want not in MODES:
    if local_devices is None:  # at import: train.py's setup reports it
      return False
    raise ConfigError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(MODES)}")
  if want == "off" or not cpu_only():
    return False
  if want == "auto" and not (local_devices == 1 and cpu_devices_requested() == 1):
    return False
  return applied or keep_freed_memory()
