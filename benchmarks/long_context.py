"""Long sequences: the default model's compiled temporaries and CPU speed, attention in the matmul
form (`gpt._attention_matmuls`, T x T scores) against blockwise (`jaxpar/models/blockwise.py`).

`python benchmarks/long_context.py [--seqs 512 ... 8192] [--speed-seqs 1024 2048 4096]
[--batch 2] [--steps N] [--warmup N] [--set key=value ...] [--out FILE]`

- **memory**: `temp_bytes` of the compiled training step (1x1x1, batch `--batch`), nothing run,
  for each T and both forms, and each form's ratio per doubling of T. The matmul form is forced by
  raising `gpt.BLOCKWISE_MIN_SEQ` past every T; blockwise by lowering it to 0.
- **speed**: one device's training step at `--speed-seqs`, both forms on the same state and
  batches (the first losses must agree): tokens per wall second and per CPU second of this
  process, median of `--steps` steps. CPU seconds are what other processes on a shared machine
  disturb least. The ratio is what this CPU measures, not a claim about another machine.

The figures are measurements: the script exits 0 whatever they are. Writes
benchmarks/results/long_context.json by default (git-ignored; the committed figures are in
benchmarks/reference/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from jaxpar import config as jconfig
from jaxpar.analysis import hlo
from jaxpar.models import blockwise, gpt
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

# Untracked, so a run never rewrites the committed figures in benchmarks/reference/.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "long_context.json")
FORMS = {"matmul": sys.maxsize, "blockwise": 0}  # gpt.BLOCKWISE_MIN_SEQ that forces each form
LOSS_RTOL = 1e-5


def config_at(seq_len: int, batch: int, overrides: list[str]):
  return jconfig.load(None, [f"model.seq_len={seq_len}", f"train.batch_size={batch}",
                             "data.source=synthetic"] + overrides)


def temp_bytes(cfg) -> int:
  """Compiled temporaries of cfg's training step on one device (compiled, not run)."""
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg))
  T, B = cfg.model.seq_len, cfg.train.batch_size
  return hlo.memory(t.lower({"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}).compile())[
      "temp_bytes"]


def memory(seqs: list[int], batch: int, overrides: list[str]) -> dict:
  out = {}
  for form, threshold in FORMS.items():
    gpt.BLOCKWISE_MIN_SEQ = threshold
    temps = {T: temp_bytes(config_at(T, batch, overrides)) for T in seqs}
    ratios = {f"{a}->{b}": temps[b] / temps[a] for a, b in zip(seqs, seqs[1:]) if b == 2 * a}
    out[form] = {"temp_bytes": {str(T): v for T, v in temps.items()}, "ratio_per_doubling": ratios}
    print(f"{form:>9} temp MiB " + "  ".join(f"T {T}: {v / 2**20:.0f}" for T, v in temps.items())
          + "  ratios " + " ".join(f"{r:.2f}" for r in ratios.values()), flush=True)
  return out


def step_times(one, warmup: int, steps: int) -> dict:
  """First loss and the median wall and CPU seconds of `steps` steps after `warmup`."""
  state, walls, cpus, first = one.state, [], [], None
  with jax.set_mesh(one.mesh):
    for i in range(warmup + steps):
      t0, c0 = time.perf_counter(), time.process_time()
      state, m = one.compiled(state, one.batches[i % len(one.batches)])
      loss = float(m["loss"])  # waits for the step
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      first = loss if first is None else first
      if i >= warmup:
        walls.append(wall)
        cpus.append(cpu)
  return {"first_loss": first, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
          "wall_s_all": walls, "cpu_s_all": cpus}


def speed(seqs: list[int], batch: int, overrides: list[str], warmup: int, steps: int) -> list[dict]:
  rows = []
  for T in seqs:
    cfg = config_at(T, batch, overrides)
    row = {"seq_len": T, "tokens_per_step": batch * T}
    for form, threshold in FORMS.items():
      gpt.BLOCKWISE_MIN_SEQ = threshold
      r = step_times(_jaxpar_bench.one_device(cfg, warmup + steps), warmup, steps)
      r["tokens_per_s"] = batch * T / r["wall_s"]
      r["tokens_per_cpu_s"] = batch * T / r["cpu_s"]
      row[form] = r
    a, b = row["matmul"]["first_loss"], row["blockwise"]["first_loss"]
    if abs(a - b) > LOSS_RTOL * abs(a):
      raise AssertionError(f"T {T}: first losses differ, matmul {a} vs blockwise {b}")
    row["speedup_wall"] = row["blockwise"]["tokens_per_s"] / row["matmul"]["tokens_per_s"]
    row["speedup_cpu"] = row["blockwise"]["tokens_per_cpu_s"] / row["matmul"]["tokens_per_cpu_s"]
    print(f"T {T:>5}  tokens/s matmul {row['matmul']['tokens_per_s']:8.0f}  blockwise "
          f"{row['blockwise']['tokens_per_s']:8.0f}  (x{row['speedup_wall']:.2f} wall, "
          f"x{row['speedup_cpu']:.2f} CPU)", flush=True)
    rows.append(row)
  return rows


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192],
                 help="sequence lengths of the memory table")
  p.add_argument("--speed-seqs", type=int, nargs="+", default=[1024, 2048, 4096])
  p.add_argument("--batch", type=int, default=2, help="sequences per step")
  p.add_argument("--steps", type=int, default=3, help="timed steps per form and length")
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  saved = gpt.BLOCKWISE_MIN_SEQ
  try:
    mem = memory(args.seqs, args.batch, args.set)
    rows = speed(args.speed_seqs, args.batch, args.set, args.warmup, args.steps)
  finally:
    gpt.BLOCKWISE_MIN_SEQ = saved
  out = {"jax": jax.__version__, "backend": jax.default_backend(), "cpu": _jaxpar_bench.host_cpu(),
         "load_average": os.getloadavg(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "overrides": args.set, "batch": args.batch, "block": blockwise.BLOCK,
         "blockwise_min_seq": saved, "memory": mem, "speed": rows}
  _jaxpar_bench.write_json(out, args.out, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
