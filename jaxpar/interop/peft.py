"""A LoRA run's adapters as a PEFT folder (`export --peft DIR`): adapter_config.json and
adapter_model.safetensors that `peft.PeftModel.from_pretrained(base, DIR)` loads onto the model
folder the run started from (`model.init_from`); and the merged weights `export --hf` writes.

PEFT keeps a LoRA's A as `lora_A.weight` (r, in) and its B as `lora_B.weight` (out, r), keyed
`base_model.model.<the module's name>.lora_A.weight`, whatever the layer's own layout: so jaxpar's
A (in, r) and B (r, out) are written transposed, for GPT-2's Conv1D (`fan_in_fan_out`) as for
Llama's Linear. GPT-2 joins q, k and v in one c_attn: its adapter is the adapted ones' side by
side, A (in, n r) and B block-diagonal (n r, 3 out), which is exactly the sum of their updates;
PEFT gives it rank n r and alpha n alpha (rank_pattern, alpha_pattern), so the scale stays
alpha / r. A mixture's experts are fused parameters in transformers, not modules PEFT adapts as
LoRA layers: their adapters export merged (`--hf`), not here.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from jaxpar import config as jconfig
from jaxpar.config import ConfigError
from jaxpar.interop.export import STEP_REMEDY, checkpoint_step, write_safetensors, writes
from jaxpar.models import lora
from jaxpar.models.hf_weights import layers_of
from jaxpar.train import checkpoint

# jaxpar's adapted weight -> the module PEFT adapts, by its name's end (PEFT's target_modules)
GPT2_MODULES = {"wq": "attn.c_attn", "wk": "attn.c_attn", "wv": "attn.c_attn",
                "wo": "attn.c_proj", "w1": "mlp.c_fc", "w2": "mlp.c_proj"}
LLAMA_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                 "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                 "w_down": "mlp.down_proj", "s_gate": "mlp.shared_expert.gate_proj",
                 "s_up": "mlp.shared_expert.up_proj", "s_down": "mlp.shared_expert.down_proj"}
GPT2_LAYER, LLAMA_LAYER = "transformer.h.{i}.", "model.layers.{i}."
PREFIX = "base_model.model."  # what PEFT's saved keys start with


def lora_config(directory: str, step: int, what: str) -> jconfig.Config:
  """The stored config of a LoRA checkpoint; one sentence for one trained without LoRA."""
  extra = checkpoint.read_extra(directory, step)
  if checkpoint.users_model(extra):
    raise ConfigError(f"the checkpoint of step {step} in {directory} holds a model of your own, "
                      f"which has no {what}")
  cfg = jconfig.from_dict(extra.get("config", {}))
  if not cfg.train.lora_rank:
    raise ConfigError(f"the checkpoint of step {step} in {directory} was trained without LoRA "
                      f"(train.lora_rank=0), so it has no adapters to export as {what}; export "
                      f"its weights with --hf or --out")
  return cfg


def merged_reader(directory: str, step: int, cfg: jconfig.Config):
  """read(path) -> the stored parameter `path`, each adapted weight merged (W + alpha/r * A @ B,
  in float32, back in W's dtype); the stored one as it is without LoRA."""
  stored = checkpoint.stored_params(directory, step)
  s = lora.scale(cfg.train) if cfg.train.lora_rank else 0.0

  def read(path: str) -> np.ndarray:
    w = checkpoint.read_param(directory, step, path)
    if path + lora.A not in stored:
      return w
    a = checkpoint.read_param(directory, step, path + lora.A).astype(np.float32)
    b = checkpoint.read_param(directory, step, path + lora.B).astype(np.float32)
    return (w.astype(np.float32) + np.float32(s) * np.matmul(a, b)).astype(w.dtype)
  return read


def _tensors(mc, names: tuple[str, ...], r: int) -> tuple[dict, dict, list[str]]:
  """({PEFT key: (shape, [jaxpar adapters], make(*arrays))}, rank_pattern additions, target
  modules) for the adapted `names`."""
  gpt = mc.kind == "gpt"
  modules, layer = (GPT2_MODULES, GPT2_LAYER) if gpt else (LLAMA_MODULES, LLAMA_LAYER)
  out, ranks, targets = {}, {}, []
  for module in dict.fromkeys(modules[n] for n in names):  # in order, once each
    parts = [n for n in names if modules[n] == module]
    targets.append(module)
    for row, i in enumerate(layers_of(mc, "layers/" + parts[0])):
      key = PREFIX + layer.format(i=i) + module
      As = ["layers/" + n + lora.A for n in parts]
      Bs = ["layers/" + n + lora.B for n in parts]
      if module == "attn.c_attn":  # q, k, v side by side: A (D, n r), B (n r, 3D) block-diagonal
        D, cols = mc.d_model, {"wq": 0, "wk": 1, "wv": 2}
        out[key + ".lora_A.weight"] = (As, lambda *a, row=row: np.concatenate(
            [x[row] for x in a], -1).T)

        def joined_b(*b, row=row, parts=parts, D=D, cols=cols):
          full = np.zeros((len(b) * r, 3 * D), b[0].dtype)
          for j, (x, n) in enumerate(zip(b, parts)):
            full[j * r:(j + 1) * r, cols[n] * D:(cols[n] + 1) * D] = x[row]
          return full.T
        out[key + ".lora_B.weight"] = (Bs, joined_b)
        if len(parts) > 1:
          ranks["c_attn"] = len(parts) * r
      else:
        out[key + ".lora_A.weight"] = (As, lambda a, row=row: a[row].T)
        out[key + ".lora_B.weight"] = (Bs, lambda b, row=row: b[row].T)
  return out, ranks, targets


def export(workdir: str, out_dir: str, step: int | None = None) -> dict:
  """Writes `out_dir`/adapter_model.safetensors and adapter_config.json from a LoRA checkpoint;
  returns the config. Nothing is left of `out_dir` when it fails (if this made it)."""
  directory, step = checkpoint_step(workdir, step)
  made = not os.path.exists(out_dir)
  try:
    with checkpoint.readable(directory, step, STEP_REMEDY):
      return _export(directory, step, out_dir, lora_config(directory, step, "a PEFT adapter"))
  except BaseException:
    if made and os.path.isdir(out_dir):
      shutil.rmtree(out_dir)
    raise


def _export(directory: str, step: int, out_dir: str, cfg: jconfig.Config) -> dict:
  mc, tc = cfg.model, cfg.train
  stored = checkpoint.stored_params(directory, step)
  names = tuple(p[len("layers/"):-len(lora.A)] for p in stored if p.endswith(lora.A))
  modules = GPT2_MODULES if mc.kind == "gpt" else LLAMA_MODULES
  left = [n for n in names if n not in modules]
  if left:
    raise ConfigError(f"the adapters of {', '.join(left)} (a mixture's experts) have no PEFT "
                      f"layout (transformers fuses the experts, PEFT adapts modules); export the "
                      f"merged model with --hf instead")
  if mc.kind == "gpt" and mc.n_experts:
    raise ConfigError("a gpt-kind mixture of experts has no Hugging Face layout")
  tensors, ranks, targets = _tensors(mc, names, tc.lora_rank)
  cache: dict[str, np.ndarray] = {}

  def param(path):
    if path not in cache:
      if len(cache) >= 6:
        cache.pop(next(iter(cache)))
      cache[path] = checkpoint.read_param(directory, step, path)
    return cache[path]

  def make(key):
    paths, fn = tensors[key]
    return np.ascontiguousarray(fn(*[param(p) for p in paths]))

  def shape_of(key):
    paths, fn = tensors[key]
    x = fn(*[np.zeros(stored[p].shape, stored[p].dtype) for p in paths])
    return tuple(x.shape), x.dtype
  shapes = {k: shape_of(k) for k in sorted(tensors)}
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(shapes, make, os.path.join(out_dir, "adapter_model.safetensors"),
                    {"format": "pt"})
  adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": tc.lora_rank,
             "lora_alpha": tc.lora_alpha, "target_modules": targets, "lora_dropout": 0.0,
             "bias": "none", "fan_in_fan_out": mc.kind == "gpt", "inference_mode": True,
             "rank_pattern": ranks,
             "alpha_pattern": {k: v // tc.lora_rank * tc.lora_alpha for k, v in ranks.items()},
             "base_model_name_or_path": mc.init_from or None,
             "init_lora_weights": True, "modules_to_save": None}
  path = os.path.join(out_dir, "adapter_config.json")
  with writes(path), open(path, "w") as f:
    json.dump(adapter, f, indent=2)
    f.write("\n")
  return adapter
