"""Context parallelism (the mesh's fourth axis, ring attention): memory, communication and CPU
speed of the training step at long sequences, read off the compiled program.

`python benchmarks/context_parallel.py [--contexts 1 2 4 8] [--memory-seq 4096]
[--budget-mib 64] [--speed-seqs 1024 2048 4096 8192] [--batch 2] [--steps N] [--set k=v ...]
[--out FILE]`

- **memory**: the step's compiled temporaries and peak (arguments + temporaries - aliased) per
  device on a `1x1x1xC` mesh at `--memory-seq`, nothing run, and each C's ratio to C=1.
- **longest sequence**: for each C, the longest T (doubling from 1024) whose compiled peak per
  device fits `--budget-mib`; the next T's peak is given too.
- **communication**: the bytes each device sends in collective-permutes per step, from the HLO,
  against the K/V ring's theory: per layer and step (6C - 4) x B x (T/C) x G x K x 4 bytes
  (forward: k and v, C-1 hops; backward: k and v again, C-1 hops, and their gradients, C hops).
  With `--set parallel.context_attention=allgather`, the all-gather and reduce-scatter bytes
  against 6 (C - 1) x B x (T/C) x G x K x 4 (k and v gathered forward and backward, their
  gradients reduce-scattered).
- **speed**: tokens per wall second and per CPU second of this process for each T and C, the
  devices simulated on this machine's cores (`--xla_force_host_platform_device_count`): on a
  CPU the C "devices" share the same cores, so the ratios say what the ring costs in work, not
  what C GPUs would gain.

The default model (4 layers, d_model 128, 4 heads of 32) unless `--set` says otherwise. The
figures are measurements: the script exits 0 whatever they are. Writes
benchmarks/results/context_parallel.json by default (git-ignored; the committed figures are in
benchmarks/reference/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import config as jconfig
from jaxpar.analysis import hlo
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "context_parallel.json")
MiB = 2 ** 20


def config_at(T: int, batch: int, overrides: list[str]):
  return jconfig.load(None, [f"model.seq_len={T}", f"train.batch_size={batch}",
                             "data.source=synthetic"] + overrides)


def trainer(cfg, C: int) -> Trainer:
  shape = (1, 1, 1, C)
  jmesh.check(shape, cfg, C)
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:C]), jmodel.decoder(cfg))


def compiled(cfg, C: int):
  T, B = cfg.model.seq_len, cfg.train.batch_size
  t = trainer(cfg, C)
  return t, t.lower({"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}).compile()


def measure(cfg, C: int) -> dict:
  """Compiled memory per device and collective bytes sent per device, nothing run."""
  _, exe = compiled(cfg, C)
  mem = hlo.memory(exe)
  sent = hlo.sent_bytes(exe.as_text(), C)
  mc = cfg.model
  G, K = mc.n_kv_heads or mc.n_heads, mc.d_model // mc.n_heads
  X = cfg.train.batch_size * (mc.seq_len // C) * G * K * 4
  gather = jmesh.context_attention(cfg.parallel.context_attention, False) == "allgather"
  # the ring: (6C - 4) X per layer; the all-gather form: k and v gathered in the forward and
  # again in the backward, their gradients reduce-scattered, each sending (C - 1) X
  theory = mc.n_layers * (6 * (C - 1) if gather else 6 * C - 4) * X if C > 1 else 0
  return {"context_attention": "allgather" if gather else "ring",
          "temp_bytes": mem["temp_bytes"], "peak_bytes": mem["peak_bytes"],
          "argument_bytes": mem["argument_bytes"],
          "collective_permute_bytes": sent.get("collective-permute", 0),
          "all_gather_bytes": sent.get("all-gather", 0),
          "reduce_scatter_bytes": sent.get("reduce-scatter", 0),
          "ring_theory_bytes" if not gather else "allgather_theory_bytes": theory}


def memory(Cs: list[int], T: int, batch: int, overrides: list[str]) -> dict:
  out = {str(C): measure(config_at(T, batch, overrides), C) for C in Cs}
  base = out[str(Cs[0])]["temp_bytes"]
  for C in Cs:
    row = out[str(C)]
    row["temp_ratio_to_first"] = row["temp_bytes"] / base
    theory = row.get("ring_theory_bytes", row.get("allgather_theory_bytes"))
    print(f"T {T} C {C}: temporaries {row['temp_bytes'] / MiB:.1f} MiB (x{row['temp_ratio_to_first']:.3f}),"
          f" peak {row['peak_bytes'] / MiB:.1f} MiB, collective-permute "
          f"{row['collective_permute_bytes'] / MiB:.2f} MiB, all-gather "
          f"{row['all_gather_bytes'] / MiB:.2f} MiB, reduce-scatter "
          f"{row['reduce_scatter_bytes'] / MiB:.2f} MiB ({row['context_attention']} theory "
          f"{theory / MiB:.2f})", flush=True)
  return out


def longest(Cs: list[int], budget: int, batch: int, overrides: list[str], max_T: int) -> dict:
  out = {}
  for C in Cs:
    T, fits = 1024, None
    while T <= max_T:
      peak = measure(config_at(T, batch, overrides), C)["peak_bytes"]
      if peak > budget:
        out[str(C)] = {"max_seq_len": fits, "next_seq_len": T, "next_peak_bytes": peak}
        break
      fits, T = T, 2 * T
    else:
      out[str(C)] = {"max_seq_len": fits, "next_seq_len": None, "note": f"searched up to {max_T}"}
    print(f"C {C}: longest T within {budget / MiB:.0f} MiB: {out[str(C)]['max_seq_len']}",
          flush=True)
  return out


def speed(Cs: list[int], seqs: list[int], batch: int, overrides: list[str], steps: int) -> list:
  rows = []
  for T in seqs:
    cfg = config_at(T, batch, overrides)
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (batch, T + 1)), jnp.int32)
    row = {"seq_len": T}
    for C in Cs:
      t, exe = compiled(cfg, C)
      state = t.init(0)
      batch_in = jax.device_put({"tokens": tokens}, t.batch_sharding({"tokens": tokens}))
      walls, cpus, first = [], [], None
      for i in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = exe(state, batch_in)
        loss = float(m["loss"])
        if i:  # the first call is the warm-up
          walls.append(time.perf_counter() - t0)
          cpus.append(time.process_time() - c0)
        first = loss if first is None else first
      wall, cpu = statistics.median(walls), statistics.median(cpus)
      row[str(C)] = {"first_loss": first, "wall_s": wall, "cpu_s": cpu,
                     "tokens_per_s": batch * T / wall, "tokens_per_cpu_s": batch * T / cpu}
      print(f"T {T} C {C}: {batch * T / wall:8.0f} tokens/s ({batch * T / cpu:8.0f} per CPU s), "
            f"first loss {first:.5f}", flush=True)
    rows.append(row)
  return rows


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--memory-seq", type=int, default=4096)
  p.add_argument("--budget-mib", type=float, default=64.0, help="per-device budget (compiled peak)")
  p.add_argument("--max-seq", type=int, default=65536, help="longest T the budget search tries")
  p.add_argument("--speed-seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--steps", type=int, default=2, help="timed steps per T and C (after a warm-up)")
  p.add_argument("--out", default=DEFAULT_OUT)
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  out = {"jax": jax.__version__, "backend": jax.default_backend(),
         "cpu": _jaxpar_bench.host_cpu(), "load_average_at_start": os.getloadavg(),
         "overrides": args.set, "batch": args.batch,
         "memory": {"seq_len": args.memory_seq,
                    "by_context": memory(args.contexts, args.memory_seq, args.batch, args.set)},
         "longest": {"budget_bytes": int(args.budget_mib * MiB),
                     "by_context": longest(args.contexts, int(args.budget_mib * MiB), args.batch,
                                           args.set, args.max_seq)}}
  out["speed"] = speed(args.contexts, args.speed_seqs, args.batch, args.set, args.steps)
  out["load_average_at_end"] = os.getloadavg()
  _jaxpar_bench.write_json(out, args.out, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
