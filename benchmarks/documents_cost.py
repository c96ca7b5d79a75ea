"""What keeping packed documents apart costs: the same step with and without segment ids.

`python benchmarks/documents_cost.py [--mesh 2x4x1] [--seq-len T] [--rounds N] [--out FILE]`.
The main job's model (the default config, byte-level GPT) on its mesh compiles its step twice:
on {'tokens'} (data.packing=stream) and on {'tokens', 'segment_ids'} (documents, the default).
From the compiled programs: per-device argument, temporary and peak bytes, XLA's FLOPs and the
collectives' bytes. Then both run on the same token windows, alternated `rounds` times, the
segment ids those of documents with the lengths of Python's standard library files (log-normal,
median 4 kB, cut by the windows as the loader cuts them): the step-time ratio (best runs).
Writes JSON (default benchmarks/results/documents_cost.json, git-ignored; the committed figures
are in benchmarks/reference/documents_cost.json).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import config as jconfig  # noqa: E402
from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.data import synthetic_windows  # noqa: E402
from jaxpar.parallel import mesh as jmesh  # noqa: E402
from jaxpar.train import hooks, loop  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "documents_cost.json")


def segment_ids(rows: int, width: int, seed: int = 0) -> np.ndarray:
  """[rows, width] int32 ids of a stream of documents (log-normal lengths, median 4,096 tokens)
  cut into windows: 1 from each window's first token, one more at each document's start."""
  rng = np.random.default_rng(seed)
  lengths = np.maximum(1, rng.lognormal(np.log(4096), 1.0, rows * width // 64 + 16).astype(int))
  starts = np.cumsum(lengths)
  offsets = np.arange(rows * width).reshape(rows, width)
  doc = np.searchsorted(starts, offsets, "right")
  return (doc - doc[:, :1] + 1).astype(np.int32)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mesh", default="2x4x1")
  p.add_argument("--seq-len", type=int, default=0, help="model.seq_len (0: the default's)")
  p.add_argument("--steps", type=int, default=4, help="steps per timed run")
  p.add_argument("--rounds", type=int, default=6, help="timed runs of each form, alternated")
  p.add_argument("--out", default=DEFAULT_OUT)
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  shape = jmesh.parse(args.mesh)
  n = int(np.prod(shape))
  cfg = jconfig.load(None, [f"model.seq_len={args.seq_len}"] if args.seq_len else [])
  T, B = cfg.model.seq_len, cfg.train.batch_size
  trainer = Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), loop.build_model(cfg))
  leaf = ((B, T + 1), np.dtype(np.int32))
  specs = {"stream": {"tokens": leaf}, "documents": {"tokens": leaf, "segment_ids": leaf}}
  results = {"host_cpu": _jaxpar_bench.host_cpu(), "jax": jax.__version__, "mesh": args.mesh,
             "seq_len": T, "batch_size": B, "load_average_at_start": os.getloadavg()[0]}
  compiled = {}
  for name, spec in specs.items():
    abstract = loop._batch_abstract(spec, 1)
    t0 = time.perf_counter()
    compiled[name] = trainer.lower(abstract).compile()
    text = compiled[name].as_text()
    results[name] = {"compile_s": time.perf_counter() - t0, **hlo.memory(compiled[name]),
                     "flops": hlo.flops(compiled[name]),
                     "collective_bytes": hlo.collective_bytes(text)}
    print(f"{name}: temp {results[name]['temp_bytes'] / 1e6:.2f} MB, argument "
          f"{results[name]['argument_bytes'] / 1e6:.2f} MB, flops {results[name]['flops']:.3g}")
  tokens = synthetic_windows(T, 0, args.steps * B).astype(np.int32)
  seg = segment_ids(args.steps * B, T + 1)
  results["documents_per_window_mean"] = float(seg.max(-1).mean())
  shardings = trainer.batch_sharding(loop._batch_abstract(specs["documents"], 1))
  host = {"stream": [{"tokens": tokens[i * B:(i + 1) * B]} for i in range(args.steps)],
          "documents": [{"tokens": tokens[i * B:(i + 1) * B], "segment_ids": seg[i * B:(i + 1) * B]}
                        for i in range(args.steps)]}
  batches = {name: [hooks.global_batch(h, {k: shardings[k] for k in h}) for h in hs]
             for name, hs in host.items()}
  state = trainer.init(cfg.train.seed)
  times = {name: [] for name in specs}
  with jax.set_mesh(trainer.mesh):
    for name in specs:  # warm-up
      state, m = compiled[name](state, batches[name][0])
    jax.block_until_ready(m)
    for _ in range(args.rounds):
      for name in specs:
        t0 = time.perf_counter()
        for batch in batches[name]:
          state, m = compiled[name](state, batch)
        jax.block_until_ready(m)
        times[name].append(time.perf_counter() - t0)
  for name in specs:
    results[name]["runs_s"] = times[name]
    results[name]["step_time_s"] = min(times[name]) / args.steps
  d, s = results["documents"], results["stream"]
  results["ratios"] = {"step_time": d["step_time_s"] / s["step_time_s"],
                       "temp_bytes": d["temp_bytes"] / s["temp_bytes"],
                       "argument_bytes": d["argument_bytes"] / s["argument_bytes"],
                       "flops": (d["flops"] / s["flops"]) if s["flops"] else None}
  results["load_average_at_end"] = os.getloadavg()[0]
  print("documents / stream: " + ", ".join(f"{k} {v:.3f}" for k, v in results["ratios"].items()
                                           if v is not None))
  _jaxpar_bench.write_json(results, args.out)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
