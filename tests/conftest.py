"""8 simulated CPU devices and fast compilation, set before JAX is imported anywhere in the test
session, and one persistent compilation cache for the whole session.

The cache is shared by this process, the pytest-xdist workers (they inherit the environment the
controller sets here) and every subprocess a test starts (train.py, launch_local, ...): a program
that another test compiled already (the one-device reference runs, the default model's step on
a mesh the docs use) is loaded instead of compiled again. Its key covers the program, the XLA
flags and the devices, so a hit is the same executable; tests/test_compile_time.py turns it off.
"""
import atexit
import os
import shutil
import tempfile

# LLVM at -O0: the suite's programs are small and compiled once or twice each, so compiling them
# (not running them) is most of its time, and -O0 halves that. XLA's own HLO passes (fusion,
# sharding, buffer assignment: what the memory and collective tests read) run as at -O2.
# Codegen in one piece: XLA:CPU otherwise splits each program's LLVM module to compile the parts
# on a thread pool, which on the suite's two cores (two workers) only adds the splitting's cost;
# one piece compiles the tests' programs 8-12% faster, to the same HLO, memory figures and bits.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"


def child_env(*drop: str) -> dict:
  """The environment for a subprocess that picks its own device count (train.py, export.py, ...):
  this one's, without its device count and without the variables named in `drop`."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env["XLA_FLAGS"] = FAST_XLA
  return env


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {FAST_XLA}" +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (or a run without xdist)
  _cache = tempfile.mkdtemp(prefix="jaxpar-test-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# A subprocess whose test drops the variables above to compile for real gets no cache at all,
# not the user's own (~/.cache/jaxpar/xla, the scripts' default), which another session filled.
os.environ.setdefault("JAXPAR_COMPILE_CACHE", "off")
