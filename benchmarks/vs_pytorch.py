"""jaxpar's one-device training step against Hugging Face GPT-2 + torch.optim.AdamW (eager).

`python benchmarks/vs_pytorch.py [--steps N] [--warmup N] [--repeats R] [--threads N]
[--phases] [--set key=value ...] [--out FILE]`. Needs the `benchmark` extra (torch, transformers).

Both sides train the same fp32 GPT-2 (4 layers, d_model 256, 4 heads, d_ff 1024, T 128, batch 16,
vocab 256 by default): jaxpar.Trainer on a 1x1x1 mesh with jaxpar's GPT, and `GPT2LMHeadModel`
(untied head, like jaxpar's; dropout 0) with global-norm clipping and `torch.optim.AdamW` over the
same learning-rate schedule and weight-decay mask. The torch model starts from jaxpar's initial
parameters and both see the same batches, so the first-step losses must agree before any timing
counts. Windows alternate between the sides (who goes first alternates too) so a burst of load
from other processes hits both; the ratio is of medians over the repeats, with the spread of the
per-repeat ratios. `--phases` also times forward and forward+backward alone on each side.
The ratio is a measurement: the script exits 0 whatever it is. Writes
benchmarks/results/vs_pytorch.json by default (git-ignored; committed figures are in
benchmarks/reference/).
"""
from __future__ import annotations

import argparse
import json
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
import numpy as np

from jaxpar import config as jconfig
from jaxpar import hostmem
from jaxpar import mesh as jmesh
from jaxpar import model as jmodel
from jaxpar import optim
from jaxpar.data import synthetic_windows
from jaxpar.step import Trainer

TARGET = 1.2  # jaxpar / torch tokens/s this benchmark is tuned towards
LOSS_RTOL = 1e-4  # fp32, two implementations of the same sums
BASE = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
        "model.seq_len=128", "model.vocab_size=256", "train.batch_size=16",
        "precision.compute_dtype=float32"]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vs_pytorch.json")


# -- the torch side ---------------------------------------------------------------------------------

def hf_model(mc, params):
  """GPT2LMHeadModel of jaxpar's shape holding a copy of jaxpar's parameters `params` (numpy)."""
  import torch
  from transformers import GPT2Config, GPT2LMHeadModel
  if mc.n_kv_heads not in (0, mc.n_heads):
    raise ValueError("GPT-2 has no grouped-query attention; model.n_kv_heads must be 0")
  hc = GPT2Config(n_layer=mc.n_layers, n_embd=mc.d_model, n_head=mc.n_heads, n_inner=mc.d_ff,
                  n_positions=mc.seq_len, vocab_size=mc.vocab_size, attn_pdrop=0.0,
                  resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0)
  model = GPT2LMHeadModel(hc)
  t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # a writable copy
  lay = params["layers"]
  # GPT-2's Conv1D stores (in, out) like jaxpar; c_attn is [q | k | v] with a key bias jaxpar
  # leaves out (zero here, and its gradient is zero).
  sd = {"transformer.wte.weight": t(params["wte"]), "transformer.wpe.weight": t(params["wpe"]),
        "transformer.ln_f.weight": t(params["lnf_scale"]),
        "transformer.ln_f.bias": t(params["lnf_bias"]), "lm_head.weight": t(params["head"].T)}
  for i in range(mc.n_layers):
    h = f"transformer.h.{i}."
    sd |= {h + "ln_1.weight": t(lay["ln1_scale"][i]), h + "ln_1.bias": t(lay["ln1_bias"][i]),
           h + "attn.c_attn.weight": t(np.concatenate([lay["wq"][i], lay["wk"][i], lay["wv"][i]], 1)),
           h + "attn.c_attn.bias": t(np.concatenate([lay["bq"][i], np.zeros_like(lay["bq"][i]),
                                                     lay["bv"][i]])),
           h + "attn.c_proj.weight": t(lay["wo"][i]), h + "attn.c_proj.bias": t(lay["bo"][i]),
           h + "ln_2.weight": t(lay["ln2_scale"][i]), h + "ln_2.bias": t(lay["ln2_bias"][i]),
           h + "mlp.c_fc.weight": t(lay["w1"][i]), h + "mlp.c_fc.bias": t(lay["b1"][i]),
           h + "mlp.c_proj.weight": t(lay["w2"][i]), h + "mlp.c_proj.bias": t(lay["b2"][i])}
  missing = set(dict(model.named_parameters())) - set(sd)
  if missing:
    raise AssertionError(f"parameters not copied from jaxpar: {sorted(missing)}")
  model.load_state_dict(sd, strict=False)  # strict=False: attention-mask buffers are not params
  return model.train()


class TorchStep:
  """One eager training step of the HF model: forward, cross-entropy, backward, clip, AdamW."""

  def __init__(self, model, tc, lr_at):
    import torch
    self.torch, self.model, self.clip, self.lr_at = torch, model, tc.clip_norm, lr_at
    # jaxpar's mask: decay on matrices only (no norms, biases); embeddings are matrices too
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=tc.lr, betas=(tc.b1, tc.b2), eps=1e-8)
    self.count = 0

  def loss(self, tokens):
    """tokens (B, T+1) int64 tensor -> mean next-token loss (graph kept for backward)."""
    logits = self.model(input_ids=tokens[:, :-1]).logits  # (B, T, V)
    return self.torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  tokens[:, 1:].reshape(-1))

  def __call__(self, tokens):
    self.opt.zero_grad(set_to_none=True)
    loss = self.loss(tokens)
    loss.backward()
    if self.clip > 0:
      self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    for group in self.opt.param_groups:  # optax applies schedule(count) to update `count`
      group["lr"] = self.lr_at[self.count]
    self.opt.step()
    self.count += 1
    return loss.detach()


# -- harness ------------------------------------------------------------------------------------------

class Side:
  """One framework: `run(batch) -> loss` (state kept inside), its batches, its timings."""

  def __init__(self, name, run, batches, sync):
    self.name, self.run, self.batches, self.sync = name, run, batches, sync
    self.i = 0
    self.tokens_per_s: list[float] = []
    self.tokens_per_cpu_s: list[float] = []  # less sensitive than wall time to other processes

  def steps(self, n):
    """Runs n steps; returns the last loss as a float (waits for it)."""
    out = None
    for _ in range(n):
      out = self.run(self.batches[self.i % len(self.batches)])
      self.i += 1
    return self.sync(out)


def timed(fn, n):
  """Median wall seconds of `fn()` over n calls after one untimed call."""
  fn()
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def phases(trainer, jstate, jbatch, torch_step, tbatch, n):
  """Median seconds of forward, forward+backward and the whole step, per side."""
  import torch
  dtype = trainer.compute_dtype
  params = jax.tree_util.tree_map(jnp.copy, jstate["params"])
  loss = lambda p, b: trainer.model.loss(p, b, dtype)[0]
  fwd = jax.jit(loss)
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  out = {"jaxpar": {"forward": timed(lambda: fwd(params, jbatch).block_until_ready(), n),
                    "forward_backward": timed(
                        lambda: jax.block_until_ready(fwd_bwd(params, jbatch)), n)}}

  def torch_fwd_bwd():
    torch_step.model.zero_grad(set_to_none=True)
    torch_step.loss(tbatch).backward()
  with torch.no_grad():
    t_fwd = timed(lambda: torch_step.loss(tbatch), n)
  out["torch"] = {"forward": t_fwd, "forward_backward": timed(torch_fwd_bwd, n)}
  return out


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="tokens/s of jaxpar's one-device step over HF GPT-2 + "
                                           "torch AdamW on the same shape (fp32, CPU)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps per window")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each window")
  ap.add_argument("--repeats", type=int, default=5, help="windows per side, interleaved")
  ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  ap.add_argument("--phases", action="store_true",
                  help="also time forward and forward+backward alone on each side")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides passed to jaxpar.config.load")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return ap


def main(argv=None) -> int:
  ap = parser()
  args = ap.parse_args(argv)
  if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
    ap.error("--steps, --repeats and --threads must be positive, --warmup not negative")
  try:
    import torch
    import transformers
  except ImportError as e:
    print(f"error: {e.name} is missing; install the benchmark extra: pip install -e '.[benchmark]'",
          file=sys.stderr)
    return 2
  try:
    cfg = jconfig.load(None, BASE + args.overrides)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if cfg.model.kind != "gpt" or cfg.precision.compute_dtype != "float32":
    print("error: the comparison is of the fp32 GPT: model.kind=gpt, "
          "precision.compute_dtype=float32", file=sys.stderr)
    return 2
  torch.set_num_threads(args.threads)
  device = jax.devices()[0]
  mc, tc = cfg.model, cfg.train
  tokens_per_step = tc.batch_size * mc.seq_len

  mesh = jmesh.make((1, 1, 1), [device])
  trainer = Trainer(cfg, mesh, jmodel.gpt(cfg))
  batch_abstract = {"tokens": jax.ShapeDtypeStruct((tc.batch_size, mc.seq_len + 1), jnp.int32)}
  compiled = trainer.lower(batch_abstract).compile()
  jstate = trainer.init(tc.seed)
  params_np = jax.tree_util.tree_map(np.asarray, jstate["params"])

  n_steps = 2 + args.repeats * (args.warmup + args.steps)
  lr_at = [float(v) for v in jax.vmap(optim.schedule(tc))(jnp.arange(n_steps))]
  torch_step = TorchStep(hf_model(mc, params_np), tc, lr_at)

  windows = synthetic_windows(mc.seq_len, tc.seed).astype(np.int64)
  n_batches = min(len(windows) // tc.batch_size, args.warmup + args.steps)
  rows = [windows[i * tc.batch_size:(i + 1) * tc.batch_size] for i in range(n_batches)]
  jsharding = trainer.batch_sharding(batch_abstract)
  jbatches = [jax.device_put({"tokens": r.astype(np.int32)}, jsharding) for r in rows]
  tbatches = [torch.from_numpy(r) for r in rows]

  phase_s = None
  if args.phases:  # before training, while both sides still hold the same parameters
    phase_s = phases(trainer, jstate, jbatches[0], torch_step, tbatches[0], 2 * args.steps)

  state = {"jaxpar": jstate}

  def jaxpar_run(batch):
    with jax.set_mesh(mesh):
      state["jaxpar"], metrics = compiled(state["jaxpar"], batch)
    return metrics["loss"]
  sides = [Side("jaxpar", jaxpar_run, jbatches, float),
           Side("torch", torch_step, tbatches, float)]

  # Same parameters, same batch: the first losses must agree before any timing counts.
  first = [s.steps(1) for s in sides]
  rel = abs(first[0] - first[1]) / abs(first[1])
  if rel > LOSS_RTOL:
    raise AssertionError(f"first-step losses differ: jaxpar {first[0]!r}, torch {first[1]!r} "
                         f"(relative {rel:.2e} > {LOSS_RTOL:g}); not the same computation")

  load_before = os.getloadavg()
  for r in range(args.repeats):
    for s in (sides if r % 2 == 0 else sides[::-1]):
      s.steps(args.warmup)
      t0, c0 = time.perf_counter(), time.process_time()
      s.steps(args.steps)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      s.tokens_per_s.append(tokens_per_step * args.steps / wall)
      s.tokens_per_cpu_s.append(tokens_per_step * args.steps / cpu)
  load_after = os.getloadavg()
  last = [s.steps(1) for s in sides]  # same batches in the same order: still close

  med = {s.name: statistics.median(s.tokens_per_s) for s in sides}
  med_cpu = {s.name: statistics.median(s.tokens_per_cpu_s) for s in sides}
  per_repeat = [a / b for a, b in zip(sides[0].tokens_per_s, sides[1].tokens_per_s)]
  ratio = med["jaxpar"] / med["torch"]
  result = {
      "jax_version": jax.__version__, "torch_version": torch.__version__,
      "transformers_version": transformers.__version__,
      "torch_attention": torch_step.model.config._attn_implementation,
      "torch_threads": torch.get_num_threads(),
      "backend": jax.default_backend(), "device_kind": device.device_kind,
      "cpu_count": os.cpu_count(),
      "load_average": {"before": load_before, "after": load_after},
      # glibc's allocator settings change XLA:CPU's per-step cost; recorded with the figures
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
      "host_malloc_kept": hostmem.applied,  # jaxpar.hostmem (both sides share the process)
      "config": jconfig.to_dict(cfg),
      "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
      "tokens_per_step": tokens_per_step,
      "tokens_per_s": {s.name: {"repeats": s.tokens_per_s, "median": med[s.name]} for s in sides},
      "tokens_per_cpu_s": {s.name: {"repeats": s.tokens_per_cpu_s, "median": med_cpu[s.name]}
                           for s in sides},
      "ratio": ratio,
      "ratio_per_repeat": per_repeat,
      "ratio_spread": [min(per_repeat), max(per_repeat)],
      "ratio_cpu": med_cpu["jaxpar"] / med_cpu["torch"],
      "target": TARGET,
      "phases_s": phase_s,
      "loss_check": {"first": {"jaxpar": first[0], "torch": first[1], "relative": rel},
                     "last": {"jaxpar": last[0], "torch": last[1],
                              "relative": abs(last[0] - last[1]) / abs(last[1])}},
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  if phase_s:
    for name, p in phase_s.items():
      print(f"{name:>6}: forward {p['forward'] * 1e3:.0f} ms, forward+backward "
            f"{p['forward_backward'] * 1e3:.0f} ms")
  print(f"vs_pytorch: jaxpar {med['jaxpar']:,.0f} tok/s, torch {med['torch']:,.0f} tok/s "
        f"(medians of {args.repeats}x{args.steps} steps), ratio {ratio:.3f} "
        f"(per repeat {min(per_repeat):.3f}-{max(per_repeat):.3f}, per CPU-second "
        f"{result['ratio_cpu']:.3f}; target {TARGET}) load {load_before[0]:.2f}->{load_after[0]:.2f}"
        f" -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
