"""jaxpar's training step against a hand-written JAX + optax step of the same GPT, on one device.

`python benchmarks/overhead.py [--steps N] [--warmup N] [--repeats R] [--set key=value ...]
[--out FILE] [--hlo DIR]`. Both steps start from the same parameters and see the same batches;
the first-step losses must agree, so the tokens/s ratio (jaxpar / plain) compares like with like.
The ratio is a measurement: the script exits 0 whatever it is and prints the verdict. Tokens per
CPU-second of this process are recorded too: on a shared machine other processes disturb them less.
Writes benchmarks/results/overhead.json by default (git-ignored; the committed figures are in
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
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

from jaxpar import config as jconfig

THRESHOLD = 0.95
LOSS_RTOL = 1e-5
BASE = ["train.batch_size=16", "precision.compute_dtype=float32"]
# Untracked, so a run never rewrites the committed figures in benchmarks/reference/.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.json")


# -- the plain step: written against the parameter tree only, not against jaxpar's code -----------

def _layer_norm(x, scale, bias, eps=1e-5):
  """LayerNorm over the last axis."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def plain_forward(params, tokens, n_heads, n_kv_heads):
  """tokens (B, T) int -> logits (B, T, V): embeddings, scanned pre-LN blocks, final LN, head."""
  B, T = tokens.shape
  D = params["wte"].shape[1]
  H, G = n_heads, n_kv_heads or n_heads
  K = D // H
  x = (params["wte"][tokens] + params["wpe"][:T]).reshape(B * T, D)

  def block(x, p):
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q = (h @ p["wq"] + p["bq"]).reshape(B, T, H, K)
    k = (h @ p["wk"]).reshape(B, T, G, K)
    v = (h @ p["wv"] + p["bv"]).reshape(B, T, G, K)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B * T, H * K)
    x = x + a @ p["wo"] + p["bo"]
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None
  x, _ = jax.lax.scan(block, x, params["layers"])
  logits = _layer_norm(x, params["lnf_scale"], params["lnf_bias"]) @ params["head"]
  return logits.reshape(B, T, -1)


def plain_loss(params, tokens, n_heads, n_kv_heads):
  """Mean next-token cross-entropy of tokens (B, T+1)."""
  logits = plain_forward(params, tokens[:, :-1], n_heads, n_kv_heads)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def plain_optimizer(tc) -> optax.GradientTransformation:
  """Clip, then AdamW with warmup + cosine decay; decay on weight matrices only."""
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  lr = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1),
                                          tc.lr * tc.min_lr_ratio)

  def mask(params):  # stacked layer leaves carry one extra leading axis
    top = {k: v.ndim >= 2 for k, v in params.items() if k != "layers"}
    return {**top, "layers": {k: v.ndim >= 3 for k, v in params["layers"].items()}}
  adamw = optax.adamw(lr, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=mask)
  if tc.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm), adamw)
  return adamw


def plain_step_fn(cfg):
  """(state, tokens) -> (state, loss), jitted with the state donated."""
  mc = cfg.model
  tx = plain_optimizer(cfg.train)

  def step(state, tokens):
    params, opt = state
    loss, grads = jax.value_and_grad(plain_loss)(params, tokens, mc.n_heads, mc.n_kv_heads)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss
  return tx, jax.jit(step, donate_argnums=0)


# -- harness --------------------------------------------------------------------------------------

class Side:
  """One implementation: a compiled step, its state, and a cursor into the shared batches."""

  def __init__(self, name, run, state, batches, loss_of):
    self.name, self.run, self.state, self.batches, self.loss_of = name, run, state, batches, loss_of
    self.i = 0
    self.tokens_per_s: list[float] = []
    self.tokens_per_cpu_s: list[float] = []  # less sensitive than wall time to other processes

  def steps(self, n):
    """Runs n steps and blocks on the last one's outputs; returns the last loss (not fetched)."""
    out = None
    for _ in range(n):
      self.state, out = self.run(self.state, self.batches[self.i % len(self.batches)])
      self.i += 1
    jax.block_until_ready((self.state, out))
    return None if out is None else self.loss_of(out)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="tokens/s of jaxpar's step over a plain JAX + optax step "
                                           "of the same GPT, on one device")
  ap.add_argument("--steps", type=int, default=30, help="timed steps per window")
  ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each window")
  ap.add_argument("--repeats", type=int, default=3, help="windows per side, alternating sides")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides passed to jaxpar.config.load")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  ap.add_argument("--hlo", default=None, metavar="DIR",
                  help="also write both steps' optimized HLO to DIR/{jaxpar,plain}.hlo.txt")
  return ap


def _parse(argv):
  ap = parser()
  args = ap.parse_args(argv)
  if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
    ap.error("--steps and --repeats must be positive, --warmup not negative")
  return args


def main(argv=None) -> int:
  args = _parse(argv)
  try:
    cfg = jconfig.load(None, BASE + args.overrides)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if cfg.model.kind != "gpt":
    print("error: the plain step is a GPT; model.kind must be gpt", file=sys.stderr)
    return 2
  device = jax.devices()[0]
  mc, tc = cfg.model, cfg.train
  tokens_per_step = tc.batch_size * mc.seq_len

  # jaxpar: the same path as jaxpar.train.loop.run, on a 1x1x1 mesh
  one = _jaxpar_bench.one_device(cfg, args.warmup + args.steps, device)
  mesh, compiled, jstate, rows, jbatches = one.mesh, one.compiled, one.state, one.rows, one.batches

  # plain: a copy of jaxpar's initial parameters, since jaxpar's state is donated by its step
  tx, plain_step = plain_step_fn(cfg)
  params = jax.device_put(jax.tree_util.tree_map(jnp.copy, jstate["params"]), device)
  pstate = (params, jax.jit(tx.init)(params))
  pbatches = [jax.device_put(r, device) for r in rows]

  if args.hlo:
    os.makedirs(args.hlo, exist_ok=True)
    plain_text = plain_step.lower(pstate, pbatches[0]).compile().as_text()
    for name, text in (("jaxpar", compiled.as_text()), ("plain", plain_text)):
      with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as f:
        f.write(text)

  def jaxpar_run(state, batch):
    with jax.set_mesh(mesh):
      return compiled(state, batch)
  sides = [Side("jaxpar", jaxpar_run, jstate, jbatches, lambda m: m["loss"]),
           Side("plain", plain_step, pstate, pbatches, lambda loss: loss)]

  # Same parameters, same batch: the first losses must agree before any timing counts.
  first = [float(s.steps(1)) for s in sides]
  rel = abs(first[0] - first[1]) / abs(first[1])
  if rel > LOSS_RTOL:
    raise AssertionError(f"first-step losses differ: jaxpar {first[0]!r}, plain {first[1]!r} "
                         f"(relative {rel:.2e} > {LOSS_RTOL:g}); the steps are not the same computation")

  load_before = os.getloadavg()[0]
  for r in range(args.repeats):
    for s in (sides if r % 2 == 0 else sides[::-1]):  # alternate who goes first
      s.steps(args.warmup)
      t0, c0 = time.perf_counter(), time.process_time()
      s.steps(args.steps)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      s.tokens_per_s.append(tokens_per_step * args.steps / wall)
      s.tokens_per_cpu_s.append(tokens_per_step * args.steps / cpu)
  # Each side has taken the same batches in the same order, so the losses still track each other.
  last = [float(s.steps(1)) for s in sides]

  best = {s.name: max(s.tokens_per_s) for s in sides}
  median = {s.name: statistics.median(s.tokens_per_s) for s in sides}
  ratio = best["jaxpar"] / best["plain"]
  cpu_best = {s.name: max(s.tokens_per_cpu_s) for s in sides}
  result = {
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "devices_visible": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "cpu": _jaxpar_bench.host_cpu(),
      "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
      "config": jconfig.to_dict(cfg),
      "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
      "tokens_per_step": tokens_per_step,
      "statistic": "best",
      "tokens_per_s": {s.name: {"repeats": s.tokens_per_s, "best": best[s.name],
                                "median": median[s.name]} for s in sides},
      "ratio": ratio,
      "ratio_median": median["jaxpar"] / median["plain"],
      "tokens_per_cpu_s": {s.name: {"repeats": s.tokens_per_cpu_s, "best": cpu_best[s.name]}
                           for s in sides},
      "ratio_cpu": cpu_best["jaxpar"] / cpu_best["plain"],
      "threshold": THRESHOLD,
      "pass": ratio >= THRESHOLD,
      "loss_check": {"first": {"jaxpar": first[0], "plain": first[1], "relative": rel},
                     "last": {"jaxpar": last[0], "plain": last[1],
                              "relative": abs(last[0] - last[1]) / abs(last[1])}},
  }
  _jaxpar_bench.write_json(result, args.out)
  verdict = "PASS" if result["pass"] else "FAIL"
  print(f"overhead: jaxpar {best['jaxpar']:,.0f} tok/s, plain {best['plain']:,.0f} tok/s, "
        f"ratio {ratio:.3f} (median {result['ratio_median']:.3f}, per CPU-second "
        f"{result['ratio_cpu']:.3f}) {verdict} (>= {THRESHOLD}) on {jax.default_backend()} "
        f"{device.device_kind}, {args.repeats}x{args.steps} steps -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
