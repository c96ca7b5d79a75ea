"""jaxpar.hostmem: with JAXPAR_HOST_MALLOC=keep on a CPU-only JAX, `import jaxpar` makes XLA's
per-execution temporaries reuse freed memory instead of page-faulting a fresh block every step."""
import json
import subprocess
import sys

from conftest import child_env

from jaxpar import hostmem

# One process: import jaxpar (or not), then run a program whose 144 MB temporary (a dot output
# reduced away) is allocated and freed by every execution, from a thread other than the main one
# as XLA's own threads do; report minor page faults per run.
PROBE = """
import json, resource, sys
if sys.argv[1] == "jaxpar":
  import jaxpar
  from jaxpar import hostmem
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
  r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(5):
    f(x).block_until_ready()
  out["faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5
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


def test_import_keeps_the_step_temporaries_out_of_the_page_fault_path():
  without = probe("plain")
  default = probe("jaxpar")  # opt-in: by default jaxpar leaves malloc alone
  kept = probe("jaxpar", JAXPAR_HOST_MALLOC="keep")
  block_pages = 6144 * 6144 * 4 // 4096
  # Without it every execution faults the 144 MB block in again (4 KB pages, or fewer where the
  # kernel backs it with huge pages); with it, the block freed by one run serves the next.
  assert not without["applied"] and not default["applied"] and kept["applied"]
  assert without["faults"] > block_pages / 2 and default["faults"] > block_pages / 2, (
      without, default)
  assert kept["faults"] < block_pages / 50, kept


def test_only_an_opted_in_cpu_only_jax_is_changed(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert hostmem.cpu_only()
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert not hostmem.cpu_only()
  monkeypatch.setenv(hostmem.ENV, "keep")
  assert not hostmem.configure()  # a GPU may be used: left alone
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv(hostmem.ENV)
  assert not hostmem.configure()  # not asked for
