"""jaxpar.parallel.hostmem: on a CPU-only JAX driving one device (train.py's setup), or anywhere with
JAXPAR_HOST_MALLOC=keep, XLA's per-execution temporaries reuse freed memory instead of
page-faulting a fresh block every step."""
import argparse
import json
import subprocess
import sys

import pytest
from conftest import child_env

from jaxpar.commands import cli
from jaxpar.config import ConfigError
from jaxpar.parallel import hostmem

# One process: import jaxpar (or not), then run a program whose 144 MB temporary (a dot output
# reduced away) is allocated and freed by every execution, from a thread other than the main one
# as XLA's own threads do; report the minor page faults of the median run. The median, because
# with the setting the heap can still grow once in the first runs (small allocations split the
# freed block; BUILD.md), faulting part of a block in that one time (once in eight suite runs).
PROBE = """
import json, resource, sys
if sys.argv[1] in ("jaxpar", "one-device"):
  import jaxpar
  from jaxpar.parallel import hostmem
  if sys.argv[1] == "one-device":  # what train.py's setup does for one local device
    hostmem.configure(1)
  applied = hostmem.applied
else:
  applied = False
import threading
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (x @ x.T).sum(0))  # (6144, 6144) float32 temporary
x = jnp.ones((6144, 16), jnp.float32)
out = {}
def run():
  for _ in range(3):
    f(x).block_until_ready()
  per_run = []
  for _ in range(7):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    per_run.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
  out["faults"] = sorted(per_run)[3]  # the median run
t = threading.Thread(target=run)
t.start()
t.join()
print(json.dumps({"applied": applied, "faults": out["faults"]}))
"""


def probe(mode: str, **env) -> dict:
  r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                     timeout=120, env={**child_env(), **env})
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_device_runs_keep_the_step_temporaries_out_of_the_page_fault_path():
  without = probe("plain")
  imported = probe("jaxpar")  # importing jaxpar alone leaves malloc as it is
  one_device = probe("one-device")
  kept = probe("jaxpar", JAXPAR_HOST_MALLOC="keep")
  block_pages = 6144 * 6144 * 4 // 4096
  # Without it every execution faults the 144 MB block in again (4 KB pages, or fewer where the
  # kernel backs it with huge pages); with it, the block freed by one run serves the next.
  assert not without["applied"] and not imported["applied"], (without, imported)
  assert one_device["applied"] and kept["applied"], (one_device, kept)
  assert without["faults"] > block_pages / 2 and imported["faults"] > block_pages / 2, (
      without, imported)
  assert one_device["faults"] < block_pages / 50 and kept["faults"] < block_pages / 50, (
      one_device, kept)


def test_the_rule_one_cpu_device_unless_told(monkeypatch):
  calls = []
  monkeypatch.setattr(hostmem, "keep_freed_memory", lambda: calls.append(1) or True)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv(hostmem.ENV, raising=False)
  assert hostmem.cpu_only()
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert not hostmem.configure(1)  # 8 simulated devices share this process's malloc
  assert not hostmem.configure()  # import: only when asked
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  assert hostmem.configure(1) and not hostmem.configure(2) and not hostmem.configure()
  monkeypatch.setenv(hostmem.ENV, "off")
  assert not hostmem.configure(1)
  monkeypatch.setenv(hostmem.ENV, "keep")
  assert hostmem.configure() and hostmem.configure(4)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert not hostmem.cpu_only()
  assert not hostmem.configure() and not hostmem.configure(1)  # a GPU may be used: left alone
  assert len(calls) == 3
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv(hostmem.ENV, "yes")
  assert not hostmem.configure()  # at import a bad value changes nothing; train.py refuses it:
  with pytest.raises(ConfigError, match="JAXPAR_HOST_MALLOC='yes' is not one of auto, keep, off"):
    cli.setup(argparse.Namespace(mesh="1x1x1", config=None, set=[]))
