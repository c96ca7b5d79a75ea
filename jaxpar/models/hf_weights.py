"""Hugging Face decoder weights in jaxpar's parameter layout: the name tables between jaxpar's
decoders and GPT2LMHeadModel / the Llama family (Llama, Mistral, Qwen2, Qwen3 and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE), and reading a folder's safetensors straight onto a sharded
state (`load_params`), one jaxpar tensor at a time. The folder's config.json, tokenizer and the
way back out are interop/hf.py's.

A name holds {i} for the layer and, for an expert's weight, {e} for the expert: jaxpar stacks
layers on axis 0 and experts on axis 1, (L, E, ...); with a mixture in every k-th layer
(decoder_sparse_step) the mixtures' and the dense MLPs' weights stack only their own layers
(`layers_of`).

Nothing is left out or changed silently: a tensor of the folder that the model does not read
(`check`: a config.json of fewer layers than the checkpoint, biases the config does not have) or
one that is not floating point refuses the folder in one sentence naming the file and tensor, as
do an index naming a missing shard and a safetensors file that cannot be read.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import jax
import numpy as np

from jaxpar.config import ConfigError
from jaxpar.models import llama, moe
from jaxpar.parallel.rules import path_str


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{path} does not exist: a Hugging Face model folder holds config.json "
                      f"and *.safetensors") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON ({e})") from None


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


# Where each family keeps its mixture: (block, router, expert names for gate, up, down).
MIXTRAL_MOE = ("block_sparse_moe.", "gate", ("w1", "w3", "w2"))  # w1 gate, w3 up, w2 down
QWEN_MOE = ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj"))
# A folder saved by transformers >= 5 with save_original_format=False, any of the three families:
# one (E, 2F, D) gate_up_proj (gate rows first) and one (E, D, F) down_proj per layer.
FUSED_MOE = ("mlp.", "gate", None)


def _moe_names(mc, h: str, layout) -> dict[str, tuple[str, Callable]]:
  """The mixture's tensors of one layer prefix `h`: router (E, D) -> (D, E), experts (F, D) or
  (D, F) -> (D, F) or (F, D) (`layout`: MIXTRAL_MOE or QWEN_MOE)."""
  t = np.transpose
  block, router, experts = layout
  names = {"layers/router": (h + block + router + ".weight", t)}
  if experts is None:  # FUSED_MOE: every expert in one tensor, no "{e}" to stack over
    fused, each = h + block + "experts.", lambda x: x.transpose(0, 2, 1)
    names.update({"layers/e_gate": (fused + "gate_up_proj", lambda x: each(x[:, :x.shape[1] // 2])),
                  "layers/e_up": (fused + "gate_up_proj", lambda x: each(x[:, x.shape[1] // 2:])),
                  "layers/e_down": (fused + "down_proj", each)})
  else:
    gate, up, down = experts
    e = h + block + "experts.{e}."
    names.update({"layers/e_gate": (e + gate + ".weight", t), "layers/e_up": (e + up + ".weight", t),
                  "layers/e_down": (e + down + ".weight", t)})
  if mc.shared_experts:  # Qwen2-MoE's: one dense SwiGLU MLP and its sigmoid gate, Linear(D, 1)
    s = h + "mlp.shared_expert."
    names.update({"layers/s_gate": (s + "gate_proj.weight", t),
                  "layers/s_up": (s + "up_proj.weight", t),
                  "layers/s_down": (s + "down_proj.weight", t)})
    if mc.shared_expert_gate:
      names["layers/shared_gate"] = (h + "mlp.shared_expert_gate.weight", lambda x: x[0])
  return names


def _llama_names(mc, moe_layout=QWEN_MOE) -> dict[str, tuple[str, Callable]]:
  same, t = (lambda x: x), np.transpose  # torch Linear weights are (out, in)
  h = "model.layers.{i}."
  names = {
      "wte": ("model.embed_tokens.weight", same), "norm": ("model.norm.weight", same),
      "layers/attn_norm": (h + "input_layernorm.weight", same),
      "layers/wq": (h + "self_attn.q_proj.weight", t), "layers/wk": (h + "self_attn.k_proj.weight", t),
      "layers/wv": (h + "self_attn.v_proj.weight", t), "layers/wo": (h + "self_attn.o_proj.weight", t),
      "layers/mlp_norm": (h + "post_attention_layernorm.weight", same),
  }
  if mc.n_experts:
    names.update(_moe_names(mc, h, moe_layout))
  if not mc.n_experts or mc.moe_every > 1:
    names.update({"layers/w_gate": (h + "mlp.gate_proj.weight", t),
                  "layers/w_up": (h + "mlp.up_proj.weight", t),
                  "layers/w_down": (h + "mlp.down_proj.weight", t)})
  if mc.qkv_bias:
    names.update({f"layers/b{x}": (h + f"self_attn.{x}_proj.bias", same) for x in "qkv"})
  if mc.qk_norm:
    names.update({f"layers/{x}_norm": (h + f"self_attn.{x}_norm.weight", same) for x in "qk"})
  if not mc.tie_embeddings:
    names["head"] = ("lm_head.weight", t)
  return names


def layers_of(mc, path: str) -> range | list[int]:
  """The Hugging Face layers whose tensors jaxpar's stacked parameter `path` holds, in row
  order: every layer, or with a mixture in every k-th layer (model.moe_every, decoder_sparse_step)
  the mixtures' (i + 1) % k == 0 for its weights and the others for the dense MLP's."""
  L, name = mc.n_layers, path.rsplit("/", 1)[-1]
  if not mc.n_experts or mc.moe_every == 1 or not path.startswith("layers/"):
    return range(L)
  if name in moe.PARAMS:
    return [i for i in range(L) if mc.is_mixture(i)]
  if name in llama.DENSE:
    return [i for i in range(L) if not mc.is_mixture(i)]
  return range(L)


def names(mc, moe_layout=QWEN_MOE) -> dict[str, tuple[str, Callable]]:
  """jaxpar parameter path -> (HF tensor name, '{i}' for the layer and '{e}' for the expert;
  HF -> jaxpar transform). `moe_layout`: where the folder's family keeps its experts."""
  return _gpt2_names(mc) if mc.kind == "gpt" else _llama_names(mc, moe_layout)


# safetensors' names of the dtypes jaxpar casts to the parameter dtype. An integer tensor holds
# indices or quantized values, a float8 one needs its scales: neither is the weight it would be
# cast as.
FLOATING = ("F16", "BF16", "F32", "F64")
# Tensors a folder may hold that are not parameters: GPT-2's causal-mask buffers and an older
# Llama's rotary table, which transformers also skips.
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")


def _header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """{tensor: (safetensors dtype, shape)} of one file, from its header; ConfigError naming the
  file when it cannot be read (missing, cut short, a garbled or oversized header)."""
  from safetensors import SafetensorError, safe_open  # the optional dependency of model folders
  try:
    with safe_open(path, framework="numpy") as f:
      return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
              for name in f.keys()}
  except (SafetensorError, OSError) as e:
    raise ConfigError(f"{path} is not a readable safetensors file ({e})") from None


class Folder:
  """The tensors of a model folder's safetensors files, their headers read at once (a shard the
  index names that is missing or unreadable, or that lacks a tensor the index puts in it, is a
  ConfigError sentence) and their tensors one at a time."""

  def __init__(self, folder: str):
    self.folder = folder
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(index):
      weight_map = _read_json(index).get("weight_map")
      if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                     for f in weight_map.values()):
        raise ConfigError(f"{index} has no weight_map of tensor names to shard files")
      self.files = {name: os.path.join(folder, f) for name, f in weight_map.items()}
      for name, path in sorted(self.files.items()):
        if not os.path.isfile(path):
          raise ConfigError(f"{index} puts tensor {name} in {path}, which does not exist")
    elif os.path.exists(single):
      self.files = dict.fromkeys(_header(single), single)
    else:
      raise ConfigError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    headers = {path: _header(path) for path in sorted(set(self.files.values()))}
    for name, path in sorted(self.files.items()):
      if name not in headers[path]:
        raise ConfigError(f"{index} puts tensor {name} in {path}, which does not hold it")
    self.dtypes = {name: headers[path][name][0] for name, path in self.files.items()}
    self.shapes = {name: headers[path][name][1] for name, path in self.files.items()}

  def key(self, name: str) -> str | None:
    """The folder's name for tensor `name` (GPT-2's with or without `transformer.`); None."""
    for key in (name, name.removeprefix("transformer.")):
      if key in self.files:
        return key
    return None

  def shape(self, name: str) -> tuple[int, ...]:
    """Tensor `name`'s shape, from its file's header."""
    key = self.key(name)
    if key is None:
      raise ConfigError(f"{self.folder} has no tensor {name}")
    return self.shapes[key]

  def read(self, name: str) -> np.ndarray:
    """One tensor of a floating dtype (FLOATING); GPT-2 names are found with or without their
    `transformer.` prefix."""
    from safetensors import SafetensorError, safe_open  # the optional dependency (see _header)
    key = self.key(name)
    if key is None:
      raise ConfigError(f"{self.folder} has no tensor {name}")
    path = self.files[key]
    if self.dtypes[key] not in FLOATING:
      raise ConfigError(f"{path}: tensor {key} is {self.dtypes[key]}, not floating point "
                        f"({', '.join(FLOATING)}): jaxpar does not cast integer or quantized "
                        f"tensors to weights")
    try:
      with safe_open(path, framework="numpy") as f:
        return f.get_tensor(key)
    except (SafetensorError, OSError) as e:
      raise ConfigError(f"{path}: tensor {key} cannot be read ({e})") from None


def wanted(mc, layout=QWEN_MOE) -> set[str]:
  """Every Hugging Face tensor name the model `mc` reads (`names` with each layer and expert)."""
  out = set()
  for path, (hf_name, _) in names(mc, layout).items():
    rows = layers_of(mc, path) if "{i}" in hf_name else [0]
    experts = range(mc.n_experts) if "{e}" in hf_name else [0]
    out.update(hf_name.format(i=i, e=e) for i in rows for e in experts)
  return out


def check(folder: str, mc, abstract: Any = None) -> Folder:
  """The folder, once its tensors are exactly those the model `mc` reads (less non-parameter
  buffers, and lm_head.weight beside tied embeddings, which transformers skips too), of floating
  dtypes and, given jaxpar's `abstract` parameters, of the shapes they need (`planned_shape`):
  otherwise a ConfigError naming the file and tensor. Reads headers only."""
  src = Folder(folder)
  want = wanted(mc, moe_layout(src))
  for name in sorted(want):
    if src.key(name) is None:
      raise ConfigError(f"{folder} has no tensor {name}")
  if mc.kind == "gpt":  # GPT-2 folders name their tensors with or without `transformer.`
    want |= {name.removeprefix("transformer.") for name in want}
  for name in sorted(src.files):
    if name in want:
      if src.dtypes[name] not in FLOATING:
        src.read(name)  # its refusal
    elif not (_BUFFERS.search(name) or (name == "lm_head.weight" and mc.tie_embeddings)):
      raise ConfigError(f"{src.files[name]} holds tensor {name}, which the model of "
                        f"{os.path.join(folder, 'config.json')} and the model.* settings has no "
                        f"place for ({mc.n_layers} layers): jaxpar refuses to train on part of a "
                        f"checkpoint")
  if abstract is not None:
    layout, table = moe_layout(src), names(mc, moe_layout(src))
    for p, a in jax.tree_util.tree_leaves_with_path(abstract):
      path = path_str(p)
      if path in table:
        _same_shape(src, path, mc, planned_shape(src, path, mc, layout), a.shape, layout)
  return src


def _same_shape(src: Folder, path: str, mc, got, want, layout) -> None:
  if tuple(got) != tuple(want):
    hf_name = names(mc, layout)[path][0]
    where = hf_name.format(i=layers_of(mc, path)[0], e=0)
    raise ConfigError(f"{src.folder}: tensor {where} gives {path} the shape {tuple(got)}, but "
                      f"config.json makes {tuple(want)}")


def planned_shape(src: Folder, path: str, mc, layout=QWEN_MOE) -> tuple[int, ...]:
  """The shape `read_param` gives jaxpar's parameter `path`, from the headers alone: the
  transforms run on a zero-stride stand-in of one tensor (no memory), the layers and experts
  counted; ConfigError when they differ in shape, which stacking them would trip on."""
  hf_name, transform = names(mc, layout)[path]
  rows = list(layers_of(mc, path)) if "{i}" in hf_name else [0]
  experts = range(mc.n_experts) if "{e}" in hf_name else [0]
  first = hf_name.format(i=rows[0], e=0)
  shape = src.shape(first)
  for other in (hf_name.format(i=i, e=e) for i in rows for e in experts):
    if src.shape(other) != shape:
      raise ConfigError(f"{src.files[src.key(other)]}: tensor {other} has the shape "
                        f"{src.shape(other)}, but {first} has {shape}")
  out = transform(np.broadcast_to(np.zeros((), np.float32), shape)).shape
  out = (len(rows),) * ("{i}" in hf_name) + (len(experts),) * ("{e}" in hf_name) + out
  if path in ("wte", "head") and len(out) == 2:  # the vocabulary's padding, as read_param's
    axis = 0 if path == "wte" else 1
    out = tuple(n + (mc.padded_vocab() - mc.vocab_size if a == axis else 0)
                for a, n in enumerate(out))
  return out


def read_param(folder: Folder, path: str, mc, want: tuple[int, ...],
               moe_layout=QWEN_MOE) -> np.ndarray:
  """jaxpar parameter `path` (shape `want`) from the folder: layers (and experts) stacked,
  transforms applied."""
  hf_name, transform = names(mc, moe_layout)[path]

  def layer(i):
    if "{e}" in hf_name:
      return np.stack([transform(folder.read(hf_name.format(i=i, e=e)))
                       for e in range(mc.n_experts)])
    return transform(folder.read(hf_name.format(i=i)))
  rows = layers_of(mc, path)
  x = np.stack([layer(i) for i in rows]) if "{i}" in hf_name else layer(0)
  if path in ("wte", "head") and x.ndim == 2:  # the vocabulary's padding (model.vocab_multiple)
    axis = 0 if path == "wte" else 1
    x = np.pad(x, [(0, mc.padded_vocab() - mc.vocab_size if a == axis else 0) for a in (0, 1)])
  _same_shape(folder, path, mc, x.shape, want, moe_layout)
  return x


def moe_layout(folder: Folder) -> tuple:
  """Where the folder keeps its experts: fused (FUSED_MOE), else by family, Mixtral's
  block_sparse_moe or Qwen's mlp."""
  if any(name.endswith(".experts.gate_up_proj") for name in folder.files):
    return FUSED_MOE
  arch = (_read_json(os.path.join(folder.folder, "config.json")).get("architectures") or [None])[0]
  return MIXTRAL_MOE if arch == "MixtralForCausalLM" else QWEN_MOE


def load_params(folder: str, mc, abstract: Any, shardings: Any) -> Any:
  """The folder's parameters as jaxpar's tree, each put onto its sharding as soon as it is read
  (after `check`)."""
  src = check(folder, mc, abstract)
  layout = moe_layout(src)
  table = names(mc, layout)
  have = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
  for gap in (sorted(set(table) - have), sorted(have - set(table))):  # both ways: nothing left
    if gap:  # at its initial value
      raise ConfigError(f"jaxpar's model and {folder} do not agree on parameter {gap[0]}")

  def one(path, a, sharding):
    x = read_param(src, path_str(path), mc, a.shape, layout).astype(a.dtype)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: x[index])
  return jax.tree_util.tree_map_with_path(one, abstract, shardings)
