"""Hugging Face model folders in and out: GPT2LMHeadModel and LlamaForCausalLM.

In: `config.json` gives the model keys (`model_overrides`); `*.safetensors` (one file or a sharded
index) give the parameters, read one jaxpar tensor at a time and put straight onto its sharding
(`load_params`), so no host holds more of the model than that tensor. Out (`export`): the same
layout, written tensor by tensor, with a `config.json` that `transformers` loads with
`from_pretrained` and no missing or unexpected keys.

Layout differences handled here: GPT-2's Conv1D weights are (in, out) like jaxpar's, Llama's
Linear weights are (out, in) and are transposed; GPT-2's joined q/k/v is split (its key bias is
dropped: it shifts every score of a query equally, which softmax ignores, and is written back as
zeros); layers are stacked on jaxpar's leading axis. Both use rotary / position conventions that
jaxpar's decoders share, so nothing is permuted.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import numpy as np

from jaxpar.config import ConfigError

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # what jax.nn.gelu (tanh form) computes


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{path} does not exist: a Hugging Face model folder holds config.json "
                      f"and *.safetensors") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON ({e})") from None


def architecture(folder: str) -> tuple[str, dict]:
  """(architecture, config.json) of a model folder; ConfigError when it is not one jaxpar reads."""
  path = os.path.join(folder, "config.json")
  hf = _read_json(path)
  arch = (hf.get("architectures") or [None])[0]
  if arch not in (GPT2, LLAMA):
    raise ConfigError(f"{path}: architecture {arch!r} is not supported (jaxpar reads {GPT2} "
                      f"and {LLAMA})")
  return arch, hf


def model_overrides(folder: str) -> dict[str, Any]:
  """The `model.*` config keys that build the folder's model in jaxpar."""
  arch, hf = architecture(folder)
  path = os.path.join(folder, "config.json")

  def refuse(key, value, want):
    raise ConfigError(f"{path}: {key}={value!r} is not supported (jaxpar needs {want})")
  if arch == GPT2:
    if hf.get("activation_function", "gelu_new") not in _GPT2_ACTS:
      refuse("activation_function", hf.get("activation_function"), " or ".join(_GPT2_ACTS))
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
      refuse("layer_norm_epsilon", hf.get("layer_norm_epsilon"), 1e-5)
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
      if hf.get(key):
        refuse(key, hf[key], False)
    D = hf["n_embd"]
    return {"kind": "gpt", "n_layers": hf["n_layer"], "d_model": D, "n_heads": hf["n_head"],
            "n_kv_heads": 0, "d_ff": hf.get("n_inner") or 4 * D, "vocab_size": hf["vocab_size"],
            "max_positions": hf["n_positions"], "tie_embeddings": hf.get("tie_word_embeddings", True)}
  D, H = hf["hidden_size"], hf["num_attention_heads"]
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    refuse("rope type", rope.get("rope_type", rope.get("type")), "default")
  if hf.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", hf.get("hidden_act"), "silu")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      refuse(key, hf[key], False)
  if hf.get("head_dim", D // H) != D // H:
    refuse("head_dim", hf.get("head_dim"), f"hidden_size / num_attention_heads = {D // H}")
  return {"kind": "llama", "n_layers": hf["num_hidden_layers"], "d_model": D, "n_heads": H,
          "n_kv_heads": hf.get("num_key_value_heads") or H, "d_ff": hf["intermediate_size"],
          "vocab_size": hf["vocab_size"], "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
          "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
          "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}


# jaxpar parameter -> (Hugging Face tensor name with {i} for the layer, transform). A transform
# takes the HF tensor and returns jaxpar's; `split(a, b)` slices GPT-2's joined q/k/v columns.
def _gpt2_names(mc) -> dict[str, tuple[str, Callable]]:
  D = mc.d_model
  same = lambda x: x
  cols = lambda a, b: (lambda x: x[..., a * D:b * D])
  h = "transformer.h.{i}."
  names = {
      "wte": ("transformer.wte.weight", same), "wpe": ("transformer.wpe.weight", same),
      "lnf_scale": ("transformer.ln_f.weight", same), "lnf_bias": ("transformer.ln_f.bias", same),
      "layers/ln1_scale": (h + "ln_1.weight", same), "layers/ln1_bias": (h + "ln_1.bias", same),
      "layers/wq": (h + "attn.c_attn.weight", cols(0, 1)),
      "layers/wk": (h + "attn.c_attn.weight", cols(1, 2)),
      "layers/wv": (h + "attn.c_attn.weight", cols(2, 3)),
      "layers/bq": (h + "attn.c_attn.bias", cols(0, 1)),
      "layers/bv": (h + "attn.c_attn.bias", cols(2, 3)),
      "layers/wo": (h + "attn.c_proj.weight", same), "layers/bo": (h + "attn.c_proj.bias", same),
      "layers/ln2_scale": (h + "ln_2.weight", same), "layers/ln2_bias": (h + "ln_2.bias", same),
      "layers/w1": (h + "mlp.c_fc.weight", same), "layers/b1": (h + "mlp.c_fc.bias", same),
      "layers/w2": (h + "mlp.c_proj.weight", same), "layers/b2": (h + "mlp.c_proj.bias", same),
  }
  if not mc.tie_embeddings:
    names["head"] = ("lm_head.weight", np.transpose)
  return names


def _llama_names(mc) -> dict[str, tuple[str, Callable]]:
  same, t = (lambda x: x), np.transpose  # torch Linear weights are (out, in)
  h = "model.layers.{i}."
  names = {
      "wte": ("model.embed_tokens.weight", same), "norm": ("model.norm.weight", same),
      "layers/attn_norm": (h + "input_layernorm.weight", same),
      "layers/wq": (h + "self_attn.q_proj.weight", t), "layers/wk": (h + "self_attn.k_proj.weight", t),
      "layers/wv": (h + "self_attn.v_proj.weight", t), "layers/wo": (h + "self_attn.o_proj.weight", t),
      "layers/mlp_norm": (h + "post_attention_layernorm.weight", same),
      "layers/w_gate": (h + "mlp.gate_proj.weight", t), "layers/w_up": (h + "mlp.up_proj.weight", t),
      "layers/w_down": (h + "mlp.down_proj.weight", t),
  }
  if not mc.tie_embeddings:
    names["head"] = ("lm_head.weight", t)
  return names


def names(mc) -> dict[str, tuple[str, Callable]]:
  """jaxpar parameter path -> (HF tensor name, '{i}' for the layer; HF -> jaxpar transform)."""
  return _gpt2_names(mc) if mc.kind == "gpt" else _llama_names(mc)


class Folder:
  """The tensors of a model folder's safetensors files, opened lazily and read one at a time."""

  def __init__(self, folder: str):
    self.folder = folder
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(index):
      self.files = {name: os.path.join(folder, f) for name, f in _read_json(index)["weight_map"].items()}
    elif os.path.exists(single):
      from safetensors import safe_open
      with safe_open(single, framework="numpy") as f:
        self.files = {name: single for name in f.keys()}
    else:
      raise ConfigError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")

  def read(self, name: str) -> np.ndarray:
    """One tensor; GPT-2 names are found with or without their `transformer.` prefix."""
    from safetensors import safe_open
    key = name if name in self.files else name.removeprefix("transformer.")
    if key not in self.files:
      raise ConfigError(f"{self.folder} has no tensor {name}")
    with safe_open(self.files[key], framework="numpy") as f:
      return f.get_tensor(key)


def read_param(folder: Folder, path: str, mc, want: tuple[int, ...]) -> np.ndarray:
  """jaxpar parameter `path` (shape `want`) from the folder: layers stacked, transforms applied."""
  hf_name, transform = names(mc)[path]
  if "{i}" in hf_name:
    x = np.stack([transform(folder.read(hf_name.format(i=i))) for i in range(mc.n_layers)])
  else:
    x = transform(folder.read(hf_name))
  if tuple(x.shape) != tuple(want):
    where = hf_name.format(i=0) if "{i}" in hf_name else hf_name
    raise ConfigError(f"{folder.folder}: tensor {where} gives {path} the shape {tuple(x.shape)}, "
                      f"but config.json makes {tuple(want)}")
  return x


def load_params(folder: str, mc, abstract: Any, shardings: Any) -> Any:
  """The folder's parameters as jaxpar's tree, each put onto its sharding as soon as it is read."""
  import jax
  from jaxpar.rules import path_str
  src = Folder(folder)
  missing = sorted(set(names(mc)) - {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)})
  if missing:
    raise ConfigError(f"jaxpar's model has no parameter {missing[0]} for {folder}")

  def one(path, a, sharding):
    x = read_param(src, path_str(path), mc, a.shape).astype(a.dtype)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: x[index])
  return jax.tree_util.tree_map_with_path(one, abstract, shardings)


def hf_config(mc, cfg) -> dict:
  """config.json for jaxpar's model config `mc` in the Hugging Face layout it came from."""
  common = {"vocab_size": mc.vocab_size, "tie_word_embeddings": mc.tie_embeddings,
            "dtype": cfg.precision.param_dtype}
  from jaxpar.generate import Codec  # documents end with the run's separator byte or its
  eos = Codec(cfg).eos  # tokenizer's end-of-text id (transformers' GPT-2 default 50256 is neither)
  common.update(bos_token_id=eos, eos_token_id=eos)
  if mc.kind == "gpt":
    return {"architectures": [GPT2], "model_type": "gpt2", "n_layer": mc.n_layers,
            "n_embd": mc.d_model, "n_head": mc.n_heads, "n_inner": mc.d_ff,
            "n_positions": mc.max_positions or mc.seq_len, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            **common}
  return {"architectures": [LLAMA], "model_type": "llama", "num_hidden_layers": mc.n_layers,
          "hidden_size": mc.d_model, "num_attention_heads": mc.n_heads,
          "num_key_value_heads": mc.n_kv_heads or mc.n_heads, "intermediate_size": mc.d_ff,
          "head_dim": mc.d_model // mc.n_heads, "max_position_embeddings": mc.seq_len,
          "rms_norm_eps": mc.norm_eps, "hidden_act": "silu", "attention_bias": False,
          "mlp_bias": False, "rope_theta": mc.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta}, **common}


def _hf_tensors(mc) -> dict[str, tuple[list[str], Callable]]:
  """HF tensor name -> (the jaxpar parameters it is made of, how): the inverse of `names`."""
  out: dict[str, tuple[list[str], Callable]] = {}
  per_layer = lambda i, f: (lambda *xs: f(*(x[i] for x in xs)))
  for path, (hf_name, transform) in names(mc).items():
    if mc.kind == "gpt" and "c_attn" in hf_name:
      continue  # joined below
    inverse = np.transpose if transform is np.transpose else (lambda x: x)
    if "{i}" in hf_name:
      for i in range(mc.n_layers):
        out[hf_name.format(i=i)] = ([path], per_layer(i, inverse))
    else:
      out[hf_name] = ([path], inverse)
  if mc.kind == "gpt":
    for i in range(mc.n_layers):
      h = f"transformer.h.{i}.attn.c_attn."
      out[h + "weight"] = (["layers/wq", "layers/wk", "layers/wv"],
                           per_layer(i, lambda q, k, v: np.concatenate([q, k, v], -1)))
      out[h + "bias"] = (["layers/bq", "layers/bv"],
                         per_layer(i, lambda q, v: np.concatenate([q, np.zeros_like(q), v], -1)))
  return out


def export(workdir: str, out_dir: str, step: int | None = None) -> dict:
  """Writes `out_dir`/model.safetensors and config.json from a jaxpar checkpoint; returns the
  config. Tensors are written one at a time; at most the three q/k/v parameters are held."""
  from jaxpar import checkpoint
  from jaxpar import config as jconfig
  from jaxpar.export import STEP_REMEDY, checkpoint_step
  directory, step = checkpoint_step(workdir, step)
  made = not os.path.exists(out_dir)
  try:
    with checkpoint.readable(directory, step, STEP_REMEDY):
      return _export(directory, step, out_dir, jconfig.from_dict(
          checkpoint.read_extra(directory, step).get("config", {})))
  except BaseException:
    if made and os.path.isdir(out_dir):  # nothing half-written: the folder goes with its files
      shutil.rmtree(out_dir)
    raise


def _export(directory: str, step: int, out_dir: str, cfg) -> dict:
  """`export` once the step is chosen and its config read."""
  from jaxpar import checkpoint
  from jaxpar.export import write_safetensors, writes
  mc = cfg.model
  if mc.kind not in ("gpt", "llama"):
    raise ConfigError(f"model.kind={mc.kind!r} has no Hugging Face layout; gpt and llama do")
  stored = checkpoint.stored_params(directory, step)
  tensors = _hf_tensors(mc)
  cache: dict[str, np.ndarray] = {}

  def param(path):  # the last few parameters read, so q/k/v and per-layer slices read each once
    if path not in cache:
      if len(cache) >= 3:
        cache.pop(next(iter(cache)))
      cache[path] = checkpoint.read_param(directory, step, path)
    return cache[path]

  def shape_of(hf_name):  # from the stored shapes, on zero-stride stand-ins that take no memory
    paths, make = tensors[hf_name]
    x = make(*[np.broadcast_to(np.zeros((), stored[p].dtype), stored[p].shape) for p in paths])
    return tuple(x.shape), x.dtype
  shapes = {n: shape_of(n) for n in sorted(tensors)}
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(shapes, lambda n: tensors[n][1](*[param(p) for p in tensors[n][0]]),
                    os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
  hf = hf_config(mc, cfg)
  path = os.path.join(out_dir, "config.json")
  with writes(path), open(path, "w") as f:
    json.dump(hf, f, indent=2)
    f.write("\n")
  return hf
