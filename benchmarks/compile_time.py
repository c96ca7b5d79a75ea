"""Compile time of the training step against depth, per schedule, written to JSON.

python benchmarks/compile_time.py [--depths 2 8 32] [--repeats 2] [--out FILE] [--set key=value ...]
Writes benchmarks/results/compile_time.json by default (git-ignored; the committed figures are in
benchmarks/reference/).

Each row times `Trainer.lower(batch).compile()` (tracing, lowering and XLA compilation; nothing
runs) in this process's CPU seconds and in wall seconds, and keeps the least of `--repeats`
compiles, since other work on the machine only ever adds time; CPU seconds are what other
processes on a shared machine disturb least. It also counts the compiled program's HLO instructions, which noise cannot move: flat in
depth means the layer scan stays a loop. No pipeline runs on 4x1x1; the schedules run on 2x1x2 with
4 microbatches, circular with 2 virtual stages, whose shallowest stack is 2 x 2 = 4 layers (so it starts
at 4). A pipeline stage with one layer lets XLA drop that stage's scan
altogether, so its program is a little smaller than a deeper one's; from two layers a stage on it
is the same program at any depth. `--microbatches 4 16` adds rows for the pipeline at M = 16.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxpar import config
from jaxpar.analysis import hlo
from jaxpar.parallel import mesh as jmesh  # noqa: E402
from jaxpar.planning import plan  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

# Untracked, so a run never rewrites the committed figures in benchmarks/reference/.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "compile_time.json")
SMALL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.seq_len=32",
         "train.batch_size=32"]
# schedule -> (mesh, overrides, shallowest stack it can run)
SCHEDULES = {
    "none": ("4x1x1", [], 1),
    "gpipe": ("2x1x2", ["parallel.schedule=gpipe"], 2),
    "1f1b": ("2x1x2", ["parallel.schedule=1f1b"], 2),
    "circular": ("2x1x2", ["parallel.schedule=circular", "parallel.virtual_stages=2"], 4),
}


def compile_once(cfg: config.Config, mesh_shape: str) -> tuple[float, float, int]:
  """(CPU seconds and wall seconds to lower and compile the step, HLO instructions of the
  compiled program)."""
  shape = jmesh.parse(mesh_shape)
  mesh = jmesh.make(shape, jax.devices()[:shape[0] * shape[1] * shape[2]])
  trainer = Trainer(cfg, mesh, plan._model(cfg))
  batch = plan._batch_abstract(cfg)
  c0, t0 = time.process_time(), time.perf_counter()
  compiled = trainer.lower(batch).compile()
  cpu, wall = time.process_time() - c0, time.perf_counter() - t0
  return cpu, wall, hlo.instruction_count(compiled.as_text())


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--depths", type=int, nargs="+", default=[2, 8, 32])
  p.add_argument("--microbatches", type=int, nargs="+", default=[4])
  p.add_argument("--repeats", type=int, default=2, help="compiles per row; the fastest is kept")
  p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
  p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  jax.config.update("jax_enable_compilation_cache", False)  # every compile is a real one
  rows = []
  for name in args.schedules:
    mesh_shape, overrides, shallowest = SCHEDULES[name]
    for M in (args.microbatches if name != "none" else [1]):
      for layers in sorted({max(depth, shallowest) for depth in args.depths}):
        extra = [f"model.n_layers={layers}"] + ([f"parallel.microbatches={M}"] if name != "none" else [])
        cfg = config.load(None, SMALL + overrides + args.set + extra)
        runs = [compile_once(cfg, mesh_shape) for _ in range(args.repeats)]
        row = {"schedule": name, "mesh": mesh_shape, "n_layers": layers,
               "microbatches": M if name != "none" else None,
               "compile_cpu_s": min(r[0] for r in runs), "compile_wall_s": min(r[1] for r in runs),
               "compile_cpu_s_all": [r[0] for r in runs], "compile_wall_s_all": [r[1] for r in runs],
               "hlo_instructions": runs[-1][2]}
        rows.append(row)
        print(f"{name:>8} M={row['microbatches'] or '-':>2} layers={layers:>3}  compile "
              f"{row['compile_cpu_s']:6.2f} CPU s, {row['compile_wall_s']:6.2f} wall s  "
              f"HLO instructions {row['hlo_instructions']}", flush=True)
  out = {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
         "overrides": SMALL + args.set, "repeats": args.repeats, "rows": rows}
  _jaxpar_bench.write_json(out, args.out, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
