"""A ~1B-parameter GPT trained in bfloat16 on one GPU: MFU, step time and peak memory.

`python benchmarks/gpu_mfu.py [--small] [--steps N] [--batch B] [--layers L] [--remat POLICY]
[--out FILE]`. jaxpar.Trainer on a 1x1x1 mesh trains jaxpar's GPT (d_model 2048, 16 layers,
16 heads, d_ff 8192, T 2048, vocab 50304: 0.81B parameters outside the embeddings, 1.01B in all)
with float32 parameters and AdamW state, bfloat16 compute, on synthetic tokens, for `--steps`
timed steps after compilation and two warm-up steps. Attention is cuDNN's fused kernel where
jaxpar finds it usable (models/gpt.py: attention_implementation), else XLA's; the JSON says which.

MFU = tokens/s x model FLOPs per token (DESIGN.md: 6 N_nonembedding + 12 L d T) / the device's
peak (jaxpar.train.metrics: datasheet dense bf16 peak for known GPUs, measured otherwise). Peak memory
is the allocator's `peak_bytes_in_use` (device.memory_stats(); none on CPU) beside the compiled
program's own figure (arguments + outputs + temporaries - donated).

`--small` runs a tiny shape for a few steps, on CPU too: a smoke test of this script, not a
measurement. Needs no input data and imports none of tensorflow-datasets, grain, array_record or
tensorboardX (it checks). Writes benchmarks/results/gpu_mfu.json by default.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

T_START = time.perf_counter()

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import config as jconfig
from jaxpar.analysis import hlo
from jaxpar.models import gpt
from jaxpar.models import registry as jmodel
from jaxpar.models.stack import REMAT
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import metrics
from jaxpar.train.step import Trainer

# Modules the GPU machine does not have: the training step must not need them.
ABSENT_ON_GPU_HOST = ("tensorflow_datasets", "grain", "array_record", "tensorboardX")
LARGE = {"model.n_layers": 16, "model.d_model": 2048, "model.n_heads": 16, "model.d_ff": 8192,
         "model.seq_len": 2048, "model.vocab_size": 50304, "train.batch_size": 8}
SMALL = {"model.n_layers": 2, "model.d_model": 128, "model.n_heads": 4, "model.d_ff": 512,
         "model.seq_len": 128, "model.vocab_size": 512, "train.batch_size": 4}
WARMUP = 2
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_mfu.json")


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="MFU, step time and peak memory of a ~1B GPT in "
                                           "bfloat16 on one device")
  ap.add_argument("--small", action="store_true", help="tiny shape, 3 steps (smoke test, CPU ok)")
  ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 3 with --small)")
  ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
  ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 16)")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                  help="compute dtype (parameters and optimizer state stay float32)")
  ap.add_argument("--remat", default="none", choices=REMAT, help="parallel.remat")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return ap


def main(argv=None) -> int:
  ap = parser()
  args = ap.parse_args(argv)
  shape = dict(SMALL if args.small else LARGE)
  steps = args.steps if args.steps is not None else (3 if args.small else 20)
  if args.batch is not None:
    shape["train.batch_size"] = args.batch
  if args.layers is not None:
    shape["model.n_layers"] = args.layers
  if steps < 1 or shape["train.batch_size"] < 1 or shape["model.n_layers"] < 1:
    ap.error("--steps, --batch and --layers must be positive")
  overrides = [f"{k}={v}" for k, v in shape.items()] + [
      f"precision.compute_dtype={args.dtype}", "precision.param_dtype=float32",
      f"parallel.remat={args.remat}", f"train.steps={WARMUP + steps}", "train.warmup_steps=1"]
  try:
    cfg = jconfig.load(None, overrides)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  mc, B = cfg.model, cfg.train.batch_size
  T, H = mc.seq_len, mc.n_heads
  G, K = mc.n_kv_heads or H, mc.d_model // H
  device = jax.devices()[0]

  mesh = jmesh.make((1, 1, 1), [device])
  model = jmodel.gpt(cfg)
  trainer = Trainer(cfg, mesh, model)
  n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(model.abstract))
  attn_impl, attn_why = gpt.attention_implementation((B, T, H, K), (B, T, G, K), args.dtype)
  print(f"{jax.default_backend()} {device.device_kind}: GPT {mc.n_layers} layers, d_model "
        f"{mc.d_model}, {H} heads, d_ff {mc.d_ff}, T {T}, vocab {mc.vocab_size}: "
        f"{n_params / 1e6:,.1f}M parameters ({gpt.n_params_nonembedding(mc) / 1e6:,.1f}M outside "
        f"the embeddings); batch {B} x {T} tokens, {args.dtype} compute; attention {attn_impl} "
        f"({attn_why})", flush=True)

  batch_abstract = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  t0 = time.perf_counter()
  compiled = trainer.lower(batch_abstract).compile()
  compile_s = time.perf_counter() - t0
  memory = hlo.memory(compiled)
  t0 = time.perf_counter()
  state = trainer.init(cfg.train.seed)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  print(f"compiled in {compile_s:.1f} s, initialised in {init_s:.1f} s; compiled peak "
        f"{memory['peak_bytes'] / 2**30:.2f} GiB", flush=True)

  # Synthetic tokens: the measurement is of the step, so no input pipeline runs.
  rng = np.random.default_rng(cfg.train.seed)
  sharding = trainer.batch_sharding(batch_abstract)
  batches = [jax.device_put({"tokens": rng.integers(0, mc.vocab_size, (B, T + 1), dtype=np.int32)},
                            sharding) for _ in range(2)]

  def run(i):
    nonlocal state
    with jax.set_mesh(mesh):
      state, out = compiled(state, batches[i % len(batches)])
    return out

  for i in range(WARMUP):
    first_loss = float(run(i)["loss"])
  step_s, losses = [], []
  for i in range(steps):
    t0 = time.perf_counter()
    out = run(i)
    losses.append(float(out["loss"]))  # waits for the step: one step per timing
    step_s.append(time.perf_counter() - t0)
  if not all(math.isfinite(x) for x in losses):
    raise AssertionError(f"non-finite loss during the timed steps: {losses}")

  peak, peak_source = metrics.peak_flops_per_device()
  flops_per_token = model.flops_per_example / T
  median_s = statistics.median(step_s)
  tokens_per_s = B * T / median_s
  mfu = metrics.mfu(tokens_per_s, flops_per_token, peak, 1)
  allocator_peak = metrics.device_peak_memory_bytes()
  pulled = sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT_ON_GPU_HOST))
  total_s = time.perf_counter() - T_START
  result = {
      "jax_version": jax.__version__, "backend": jax.default_backend(),
      "device_kind": device.device_kind, "small": args.small,
      "config": jconfig.to_dict(cfg),
      "params": n_params, "params_nonembedding": gpt.n_params_nonembedding(mc),
      "attention": {"implementation": attn_impl, "why": attn_why},
      "tokens_per_step": B * T, "warmup_steps": WARMUP, "steps": steps,
      "step_s": {"repeats": step_s, "median": median_s, "min": min(step_s), "max": max(step_s)},
      "tokens_per_s": tokens_per_s,
      "flops_per_token": flops_per_token,
      "peak_flops_per_device": peak, "peak_source": peak_source,
      "mfu": mfu,
      "memory": {"allocator_peak_bytes": allocator_peak, "compiled": memory},
      "compile_s": compile_s, "init_s": init_s, "total_s": total_s,
      "loss": {"first": first_loss, "last": losses[-1]},
      "modules_absent_on_gpu_host_imported": pulled,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  mem = "n/a" if allocator_peak is None else f"{allocator_peak / 2**30:.2f} GiB"
  print(f"gpu_mfu: step {median_s * 1e3:.1f} ms (median of {steps}; {min(step_s) * 1e3:.1f}-"
        f"{max(step_s) * 1e3:.1f}), {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} of "
        f"{peak / 1e12:.1f} TFLOP/s ({peak_source}); peak memory {mem} (allocator), "
        f"{memory['peak_bytes'] / 2**30:.2f} GiB (compiled); loss {first_loss:.3f} -> "
        f"{losses[-1]:.3f}; {total_s:.0f} s in all -> {args.out}")
  if pulled:
    print(f"warning: imported {', '.join(pulled)}, which the GPU machine lacks", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
