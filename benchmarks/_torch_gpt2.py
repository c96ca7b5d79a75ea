"""The torch side of vs_pytorch.py: HF GPT2LMHeadModel + torch.optim.AdamW, eager, on the CPU.

Imports neither jax nor jaxpar, so it can run in a process of its own as torch users run it
(jaxpar sets glibc's malloc in its own process for one-device CPU runs; see
jaxpar/parallel/hostmem.py).
`python benchmarks/_torch_gpt2.py SETUP.pkl` serves vs_pytorch.py over stdin/stdout: one JSON
command per line in, one JSON reply per line out.
"""
from __future__ import annotations

import json
import pickle
import statistics
import sys
import time

import numpy as np


def hf_model(mc, params):
  """GPT2LMHeadModel of jaxpar's shape (`mc`: n_layers, d_model, ...) holding a copy of jaxpar's
  parameters `params` (numpy)."""
  import torch
  from transformers import GPT2Config, GPT2LMHeadModel
  if mc["n_kv_heads"] not in (0, mc["n_heads"]):
    raise ValueError("GPT-2 has no grouped-query attention; model.n_kv_heads must be 0")
  hc = GPT2Config(n_layer=mc["n_layers"], n_embd=mc["d_model"], n_head=mc["n_heads"],
                  n_inner=mc["d_ff"], n_positions=mc["seq_len"], vocab_size=mc["vocab_size"],
                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0)
  model = GPT2LMHeadModel(hc)
  t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # a writable copy
  lay = params["layers"]
  # GPT-2's Conv1D stores (in, out) like jaxpar; c_attn is [q | k | v] with a key bias jaxpar
  # leaves out (zero here, and its gradient is zero).
  sd = {"transformer.wte.weight": t(params["wte"]), "transformer.wpe.weight": t(params["wpe"]),
        "transformer.ln_f.weight": t(params["lnf_scale"]),
        "transformer.ln_f.bias": t(params["lnf_bias"]), "lm_head.weight": t(params["head"].T)}
  for i in range(mc["n_layers"]):
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
  """One eager training step of the HF model: forward, cross-entropy, backward, clip, AdamW.
  `tc`: lr, b1, b2, weight_decay, clip_norm; `lr_at[i]`: the learning rate of step i."""

  def __init__(self, model, tc, lr_at):
    import torch
    self.torch, self.model, self.clip, self.lr_at = torch, model, tc["clip_norm"], lr_at
    # jaxpar's mask: decay on matrices only (no norms, biases); embeddings are matrices too
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=tc["lr"], betas=(tc["b1"], tc["b2"]), eps=1e-8)
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


def timed(fn, n):
  """Median wall seconds of `fn()` over n calls after one untimed call."""
  fn()
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def phases(step: TorchStep, tokens, n) -> dict:
  """Median seconds of forward and forward+backward alone."""
  import torch

  def fwd_bwd():
    step.model.zero_grad(set_to_none=True)
    step.loss(tokens).backward()
  with torch.no_grad():
    forward = timed(lambda: step.loss(tokens), n)
  return {"forward": forward, "forward_backward": timed(fwd_bwd, n)}


class Runner:
  """The torch side: its step, its batches (cycled), and `steps(n)` timed in this process."""
  name = "torch"

  def __init__(self, setup: dict):
    import torch
    torch.set_num_threads(setup["threads"])
    self.step = TorchStep(hf_model(setup["model"], setup["params"]), setup["train"],
                          setup["lr_at"])
    self.batches = [torch.from_numpy(r) for r in setup["rows"]]
    self.i = 0

  def steps(self, n: int) -> dict:
    """{'loss', 'wall', 'cpu'}: n steps, the last loss, this process's seconds for them."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = None
    for _ in range(n):
      out = self.step(self.batches[self.i % len(self.batches)])
      self.i += 1
    loss = float(out)
    return {"loss": loss, "wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}

  def phases(self, n: int) -> dict:
    return phases(self.step, self.batches[0], n)

  def close(self) -> None:
    pass

  def info(self) -> dict:
    import torch
    import transformers
    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "torch_attention": self.step.model.config._attn_implementation,
            "torch_threads": torch.get_num_threads()}


def serve(setup_path: str) -> int:
  """Answers vs_pytorch.py's commands: {"steps": n}, {"phases": n}, {"info": 1}, {"quit": 1}."""
  with open(setup_path, "rb") as f:
    runner = Runner(pickle.load(f))
  for line in sys.stdin:
    cmd = json.loads(line)
    if "quit" in cmd:
      break
    if "steps" in cmd:
      reply = runner.steps(cmd["steps"])
    elif "phases" in cmd:
      reply = runner.phases(cmd["phases"])
    else:
      reply = runner.info()
    print(json.dumps(reply), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(serve(sys.argv[1]))
