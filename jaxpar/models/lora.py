"""Low-rank adapters (LoRA) on a decoder's layer weights: train.lora_rank, lora_alpha, lora_targets.

A target W (L, ..., in, out) of the layer stack gets two stacked adapters beside it, A (L, ..., in,
r) and B (L, ..., r, out), B zero at the start; each layer runs with W + alpha/r * A @ B. Every
other parameter (the embeddings, norms, biases and the base weights) is frozen: the trainer holds
no optimizer state for it and reduces no gradient of it (`ModelDef.frozen`).

The adapters name the logical axes of their base weight, the rank axis `rank` where W has its
output (A) or input (B), which the rules leave unsplit and ZeRO never picks, so tensor parallelism,
ZeRO 1-3 and the pipeline's `layers` rows cut them as they cut W, and A @ B comes out split as W
is. The merge runs per layer inside the scan (after ZeRO-3's gather), under the same remat, so no
merged stack is ever held: the block's matmuls are the base model's, and the weight gradient of the
merged weight gives A's and B's by two r-wide matmuls (`merged`).
Letters: L layers, E experts, r rank.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.config import ConfigError, TrainConfig
from jaxpar.models.base import ModelDef

A, B = "_lora_a", "_lora_b"  # an adapter's name: its base weight's, then one of these

# the names lora_targets may use for several weights at once; the others are weights' own names
GROUPS = {
    "attention": ("wq", "wk", "wv", "wo"),
    "mlp": ("w1", "w2", "w_gate", "w_up", "w_down"),  # the dense MLP (gpt, llama)
    "experts": ("e_w1", "e_w2", "e_gate", "e_up", "e_down"),  # a mixture's experts
    "shared": ("s_w1", "s_w2", "s_gate", "s_up", "s_down"),  # a mixture's shared experts
}
ADAPTABLE = tuple(name for names in GROUPS.values() for name in names)


def base_name(name: str) -> str:
  """'wq_lora_a' -> 'wq'; any other name as it is."""
  for suffix in (A, B):
    if name.endswith(suffix):
      return name[:-len(suffix)]
  return name


def is_adapter(path: str) -> bool:
  """Whether a parameter path ('layers/wq_lora_a') is an adapter."""
  return path.endswith(A) or path.endswith(B)


def scale(tc: TrainConfig) -> float:
  """alpha / r, what A @ B is multiplied by."""
  return tc.lora_alpha / tc.lora_rank


def targets(tc: TrainConfig, layers: dict) -> tuple[str, ...]:
  """The stacked weights of `layers` (the model's 'layers' subtree) that train.lora_targets names,
  in the stack's order; one sentence for a name that names none of them."""
  words = [w.strip() for w in tc.lora_targets.split(",") if w.strip()]
  if not words:
    raise ConfigError("config key train.lora_targets is empty; name the weights to adapt, e.g. "
                      "attention, mlp, experts, shared or wq,wv")
  have = [name for name in layers if name in ADAPTABLE]
  chosen = set()
  for word in words:
    names = [n for n in GROUPS.get(word, (word,)) if n in have]
    if not names:
      what = f"the group {word!r}" if word in GROUPS else repr(word)
      raise ConfigError(f"config key train.lora_targets={tc.lora_targets!r}: {what} names none of "
                        f"this model's layer weights; valid here: {', '.join(have)} or the groups "
                        f"{', '.join(g for g, ns in GROUPS.items() if set(ns) & set(have))}")
    chosen.update(names)
  return tuple(n for n in layers if n in chosen)


def _axes(logical: tuple, rank_at: int) -> tuple:
  """A weight's logical axes with dimension `rank_at` (-1 its output, -2 its input) named 'rank'."""
  axes = list(logical)
  axes[rank_at] = "rank"
  return tuple(axes)


def with_adapters(model: ModelDef, tc: TrainConfig) -> ModelDef:
  """`model` (a decoder's ModelDef) with an adapter pair beside each target weight, its other
  parameters frozen; `model` itself at train.lora_rank=0."""
  if not tc.lora_rank:
    return model
  names = targets(tc, model.abstract["layers"])
  r = tc.lora_rank
  abstract, logical = dict(model.abstract["layers"]), dict(model.logical["layers"])
  for name in names:
    w, axes = abstract[name], logical[name]
    *lead, n_in, n_out = w.shape
    abstract[name + A] = jax.ShapeDtypeStruct((*lead, n_in, r), w.dtype)
    abstract[name + B] = jax.ShapeDtypeStruct((*lead, r, n_out), w.dtype)
    logical[name + A], logical[name + B] = _axes(axes, -1), _axes(axes, -2)
  base_init = model.init

  def init(key):
    params = base_init(key)  # the same base weights as without adapters
    return {**params, "layers": {**params["layers"],
                                 **init_adapters(jax.random.fold_in(key, 0x10A), params["layers"],
                                                 names, r)}}
  frozen = jax.tree_util.tree_map_with_path(lambda p, _: not _is_adapter_path(p),
                                            {**model.abstract, "layers": abstract})
  return replace(model, init=init, abstract={**model.abstract, "layers": abstract},
                 logical={**model.logical, "layers": logical}, frozen=frozen)


def _is_adapter_path(path) -> bool:
  return is_adapter(str(getattr(path[-1], "key", path[-1])))


def init_adapters(key, layers: Any, names: tuple[str, ...], r: int) -> dict:
  """{name_lora_a, name_lora_b} for each target of the stacked `layers` (arrays or abstract):
  A uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))), B zero, in W's dtype."""
  out = {}
  for i, name in enumerate(names):
    w = layers[name]
    *lead, n_in, n_out = w.shape
    bound = 1.0 / n_in ** 0.5
    out[name + A] = jax.random.uniform(jax.random.fold_in(key, i), (*lead, n_in, r), w.dtype,
                                       -bound, bound)
    out[name + B] = jnp.zeros((*lead, r, n_out), w.dtype)
  return out


def add_adapters(params: dict, model: ModelDef, tc: TrainConfig, shardings: Any, seed: int) -> dict:
  """Base parameters (e.g. a Hugging Face folder's, `model.init_from`) with fresh adapters
  added, created on their shardings (`shardings`: the whole tree's)."""
  if not tc.lora_rank:
    return params
  names = targets(tc, params["layers"])
  abstract = {n: model.abstract["layers"][n] for n in names}
  where = {n: s for n, s in shardings["layers"].items() if is_adapter(n)}
  new = jax.jit(lambda key: init_adapters(jax.random.fold_in(key, 0x10A), abstract, names,
                                          tc.lora_rank), out_shardings=where)(jax.random.key(seed))
  return {**params, "layers": {**params["layers"], **new}}


def base_only(tree: dict) -> dict:
  """A parameter tree (or its abstract, shardings) without the adapters."""
  return {**tree, "layers": {n: v for n, v in tree["layers"].items() if not is_adapter(n)}}


def merged(p: dict, s: float) -> dict:
  """One layer's weights (or a stack's: any leading axes) with each adapted W replaced by
  stop_gradient(W) + s * A @ B and the adapters dropped; p itself where it holds none.

  A @ B is (..., in, r) x (..., r, out): split like W under tensor parallelism with no
  collective. Its product and the sum run in float32 and come back in W's dtype."""
  if not any(is_adapter(n) for n in p):
    return p
  out = {}
  for name, w in p.items():
    if is_adapter(name):
      continue
    if name + A in p:
      delta = jnp.matmul(p[name + A].astype(jnp.float32), p[name + B].astype(jnp.float32))
      w = (jax.lax.stop_gradient(w).astype(jnp.float32) + s * delta).astype(w.dtype)
    out[name] = w
  return out


def merge_params(params: dict, tc: TrainConfig) -> dict:
  """A LoRA model's whole parameter tree -> the base model's, each target W + alpha/r * A @ B
  (what generation and `export --hf` use); params itself without adapters."""
  if not tc.lora_rank:
    return params
  return {**params, "layers": merged(params["layers"], scale(tc))}


def wrap_parts(parts, tc: TrainConfig):
  """`parts` (stack.Parts) whose block merges its layer's adapters first (`merged`)."""
  if not tc.lora_rank:
    return parts
  block, s = parts.block, scale(tc)
  return replace(parts, block=lambda p, x, ctx: block(merged(p, s), x, ctx))
