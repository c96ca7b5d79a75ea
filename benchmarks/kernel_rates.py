"""Where vs_pytorch.py's gap lives: the same matmuls and one decoder block, XLA:CPU against torch.

`python benchmarks/kernel_rates.py [--repeats N] [--threads N] [--set key=value ...] [--out FILE]`.
Needs the `benchmark` extra (torch, transformers).

On the vs_pytorch shape (fp32; tokens = batch x seq_len rows):
- **matmul forms**: each (tokens, a) x (a, b) product of a block in the three forms a training
  step runs it: `NN` x @ w (the forward), `NT` dy @ w^T (a data gradient), `TN` x^T @ dy (a weight
  gradient, contracted over the tokens). JAX as XLA:CPU compiles it (with whatever XLA_FLAGS are
  set), torch as its CPU BLAS runs it; GFLOP/s of the median call, and what one block's six
  weight products (q, k, v, out, the MLP's two) take at those rates in each form.
- **one block**: jaxpar's GPT block (`jaxpar.models.gpt.block`) and HF's GPT2Block, holding the
  same weights, forward alone and forward + backward (gradients of the block's weights and input
  against one fixed output cotangent), median milliseconds; the outputs must agree first.

Both sides run in this process, one after the other (nothing overlaps a timing). The figures are
measurements: the script exits 0 whatever they are. Writes benchmarks/results/kernel_rates.json by
default (git-ignored).
"""
from __future__ import annotations

import argparse
import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import config as jconfig
from jaxpar.models import gpt
from jaxpar.models import registry as jmodel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jaxpar_bench  # noqa: E402  (beside this file)
import _torch_gpt2  # noqa: E402
import vs_pytorch  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kernel_rates.json")
OUT_RTOL = 1e-4  # fp32 block outputs of two implementations of the same sums


def jax_timed(fn, n):
  return _torch_gpt2.timed(lambda: jax.block_until_ready(fn()), n)


def matmul_forms(tokens: int, sizes: list[tuple[int, int]], n: int) -> list[dict]:
  """GFLOP/s of NN, NT and TN on each side for each (a, b)."""
  import torch
  rng = np.random.default_rng(0)
  forms = {"NN": (lambda x, w, dy: x @ w), "NT": (lambda x, w, dy: dy @ w.T),
           "TN": (lambda x, w, dy: x.T @ dy)}
  rows = []
  for a, b in sizes:
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((tokens, a), (a, b), (tokens, b)))
    jx = [jnp.asarray(t) for t in (x, w, dy)]
    tx = [torch.from_numpy(t) for t in (x, w, dy)]
    gflop = 2 * tokens * a * b / 1e9
    row = {"shape": f"({tokens}, {a}) x ({a}, {b})"}
    for name, f in forms.items():
      jf = jax.jit(f)
      row[name] = {"jax": gflop / jax_timed(lambda: jf(*jx), n),
                   "torch": gflop / _torch_gpt2.timed(lambda: f(*tx), n)}
    rows.append(row)
  return rows


def block_products_s(rows: list[dict], d: int, f: int, tokens: int) -> dict:
  """Seconds one block's six weight products take on each side at the measured rates, per form:
  q, k, v and the out-projection (d, d), the MLP's (d, f) and (f, d)."""
  count = {f"({tokens}, {d}) x ({d}, {d})": 4, f"({tokens}, {d}) x ({d}, {f})": 1,
           f"({tokens}, {f}) x ({f}, {d})": 1}
  out = {}
  for side in ("jax", "torch"):
    out[side] = {form: sum(count[r["shape"]] * 2 * tokens * int(np.prod(_dims(r["shape"])))
                           / (r[form][side] * 1e9) for r in rows)
                 for form in ("NN", "NT", "TN")}
  return out


def _dims(shape: str) -> tuple[int, int]:
  """'(t, a) x (a, b)' -> (a, b)."""
  a, b = shape.split(" x ")[1].strip("()").split(", ")
  return int(a), int(b)


def one_block(cfg, n: int) -> dict:
  """Median seconds of one block's forward and forward + backward on each side."""
  import torch
  mc, tc = cfg.model, cfg.train
  params = jax.tree_util.tree_map(np.asarray, jmodel.gpt(cfg).init(jax.random.key(tc.seed)))
  layer0 = {k: jnp.asarray(v[0]) for k, v in params["layers"].items()}
  rng = np.random.default_rng(1)
  x, dy = (rng.standard_normal((tc.batch_size, mc.seq_len, mc.d_model)).astype(np.float32)
           for _ in range(2))
  jx, jdy = jnp.asarray(x), jnp.asarray(dy)
  fwd = jax.jit(lambda p, x: gpt.block(p, x, mc))
  fwd_bwd = jax.jit(jax.grad(lambda p, x: jnp.vdot(gpt.block(p, x, mc), jdy), argnums=(0, 1)))

  mc_dict = jconfig.to_dict(cfg)["model"]
  blk = _torch_gpt2.hf_model(mc_dict, params).transformer.h[0]
  tx = torch.from_numpy(x).requires_grad_(True)
  tdy = torch.from_numpy(dy)
  run = lambda: (lambda o: o[0] if isinstance(o, tuple) else o)(blk(tx))
  with torch.no_grad():
    agree = float(np.abs(run().numpy() - np.asarray(fwd(layer0, jx))).max()
                  / np.abs(np.asarray(fwd(layer0, jx))).max())
  if agree > OUT_RTOL:
    raise AssertionError(f"the two blocks disagree: max relative difference {agree:.2e}")

  def torch_fwd():
    with torch.no_grad():
      run()

  def torch_fwd_bwd():
    blk.zero_grad(set_to_none=True)
    tx.grad = None
    run().backward(tdy)
  return {"output_max_rel_diff": agree,
          "jax": {"forward": jax_timed(lambda: fwd(layer0, jx), n),
                  "forward_backward": jax_timed(lambda: fwd_bwd(layer0, jx), n)},
          "torch": {"forward": _torch_gpt2.timed(torch_fwd, n),
                    "forward_backward": _torch_gpt2.timed(torch_fwd_bwd, n)}}


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="the vs_pytorch shape's matmuls and one block: "
                                           "XLA:CPU against torch (fp32, CPU)")
  ap.add_argument("--repeats", type=int, default=30, help="timed calls per figure (median)")
  ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides passed to jaxpar.config.load")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return ap


def main(argv=None) -> int:
  ap = parser()
  args = ap.parse_args(argv)
  if args.repeats < 1 or args.threads < 1:
    ap.error("--repeats and --threads must be positive")
  try:
    cfg = vs_pytorch.comparison_config(args.overrides)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import torch
  torch.set_num_threads(args.threads)
  mc = cfg.model
  tokens = cfg.train.batch_size * mc.seq_len
  sizes = sorted({(mc.d_model, mc.d_model), (mc.d_model, mc.d_ff), (mc.d_ff, mc.d_model)})
  result = {"jax_version": jax.__version__, "torch_version": torch.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "torch_threads": args.threads,
            "cpu": _jaxpar_bench.host_cpu(), "repeats": args.repeats,
            "matmul_gflops": matmul_forms(tokens, sizes, args.repeats),
            "block_s": one_block(cfg, args.repeats)}
  result["block_products_s"] = block_products_s(result["matmul_gflops"], mc.d_model, mc.d_ff, tokens)
  _jaxpar_bench.write_json(result, args.out)
  for row in result["matmul_gflops"]:
    print(f"{row['shape']:24s} GFLOP/s jax/torch: " + ", ".join(
        f"{k} {row[k]['jax']:.0f}/{row[k]['torch']:.0f}" for k in ("NN", "NT", "TN")))
  p = result["block_products_s"]
  print("one block's six weight products at these rates, ms jax/torch: " + ", ".join(
      f"{k} {1e3 * p['jax'][k]:.1f}/{1e3 * p['torch'][k]:.1f}" for k in ("NN", "NT", "TN")))
  b = result["block_s"]
  ms = lambda side, phase: 1e3 * b[side][phase]
  print(f"one block, ms jax/torch: forward {ms('jax', 'forward'):.1f}/{ms('torch', 'forward'):.1f}, "
        f"backward {ms('jax', 'forward_backward') - ms('jax', 'forward'):.1f}/"
        f"{ms('torch', 'forward_backward') - ms('torch', 'forward'):.1f}, forward+backward "
        f"{ms('jax', 'forward_backward'):.1f}/{ms('torch', 'forward_backward'):.1f} -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
