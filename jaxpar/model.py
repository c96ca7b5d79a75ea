"""What the trainer needs from a model, and adapters from Flax NNX and Flax Linen modules.

A `ModelDef` is pure: `init(key) -> params` (a plain nested dict of arrays), `loss(params, batch,
...)`, and the logical axes of every parameter. jaxpar's own models and a user's Flax module
reach the trainer the same way, so the rules, ZeRO and the step treat them alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from jaxpar import rules, zero

# loss_fn(outputs, batch) -> (scalar loss, dict of scalar metrics)
LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]


@dataclass(frozen=True)
class ModelDef:
  """init(key) -> params; loss(params, batch, dtype, dims, manual) -> (loss, metrics); logical axes."""
  init: Callable[[jax.Array], Any]
  loss: Callable[..., tuple[jax.Array, dict]]
  logical: Any  # same tree as params; each leaf a tuple of logical axis names (or None)
  abstract: Any  # same tree; jax.ShapeDtypeStruct leaves
  tokens_per_example: int = 0  # for tokens/s; 0 = not a sequence model
  flops_per_example: float = 0.0  # training FLOPs of one example (MFU); 0 = unknown
  # (params, micro, schedule, dtype, dims, manual, loss_scale, forward_only) -> (loss, metrics,
  # grads of loss_scale * loss, or None when forward_only); None = no pipeline
  pipeline: Callable[..., tuple[jax.Array, dict, Any]] | None = None


def cast(params, dtype):
  """Float leaves of `params` in `dtype`; the others as they are."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def stored_as(model: ModelDef, dtype) -> ModelDef:
  """`model` whose parameters are created (and described) in `dtype`: the trainer's storage
  dtype, `precision.param_dtype`, for jaxpar's models and a user's alike. Non-float leaves keep
  theirs."""
  def as_dtype(a):
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype:
      return jax.ShapeDtypeStruct(a.shape, dtype)
    return a
  init = model.init
  return replace(model, init=lambda key: cast(init(key), dtype),
                 abstract=jax.tree_util.tree_map(as_dtype, model.abstract))


def _logical_from(abstract, annotated, path_rules):
  """Per leaf: the annotation when the model gave one, else the first matching path rule."""
  def one(path, leaf, names):
    if names is not None:
      if len(names) != len(leaf.shape):
        raise ValueError(f"parameter {rules.path_str(path)} of shape {tuple(leaf.shape)} is "
                         f"annotated with {len(names)} axes {tuple(names)}")
      return tuple(names)
    return rules.match_path(rules.path_str(path), leaf.shape, path_rules)
  return jax.tree_util.tree_map_with_path(one, abstract, annotated,
                                          is_leaf=lambda x: x is None or isinstance(x, tuple))


def from_nnx(factory: Callable[..., Any], loss_fn: LossFn, input_key: str = "x",
             path_rules: Iterable[tuple[str, tuple]] = ()) -> ModelDef:
  """A Flax NNX model. factory(rngs) -> module; module(batch[input_key]) -> outputs.

  Parameters annotated with `nnx.with_partitioning(init, axes)` (or `out_sharding=`; older flax:
  `sharding_names=`) use those logical axes; the others are matched by `path_rules`. Only
  `nnx.Param` state is supported.
  """
  from flax import nnx
  with nnx.use_eager_sharding(False):
    module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
  graphdef, state, rest = nnx.split(module, nnx.Param, ...)
  if jax.tree_util.tree_leaves(rest):
    raise ValueError("from_nnx supports models whose state is nnx.Param only; found other state: "
                     + ", ".join(rules.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(rest)))
  abstract = nnx.to_pure_dict(state)

  def names(var):
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(axes) if axes else None
  annotated = nnx.to_pure_dict(jax.tree_util.tree_map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  logical = _logical_from(abstract, annotated, tuple(path_rules))

  def init(key):
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(key)), nnx.Param))

  def loss(params, batch, dtype=jnp.float32, dims=None, manual=frozenset()):
    params = cast(zero.gather(params, dims), dtype)
    return loss_fn(nnx.merge(graphdef, params)(batch[input_key].astype(dtype)
                                               if jnp.issubdtype(batch[input_key].dtype, jnp.floating)
                                               else batch[input_key]), batch)
  return ModelDef(init=init, loss=loss, logical=logical, abstract=abstract)


def from_linen(module: Any, example_input: Any, loss_fn: LossFn, input_key: str = "x",
               path_rules: Iterable[tuple[str, tuple]] = ()) -> ModelDef:
  """A Flax Linen model. module.apply({'params': p}, batch[input_key]) -> outputs.

  Parameters created with `nn.with_logical_partitioning(init, axes)` use those logical axes; the
  others are matched by `path_rules`. Only the `params` collection is supported.
  """
  import flax.linen as nn
  variables = jax.eval_shape(lambda: module.init(jax.random.key(0), example_input))
  others = sorted(k for k in variables if k != "params")
  if others:
    raise ValueError("from_linen supports models whose variables are 'params' only; found "
                     + ", ".join(others))
  boxed = variables["params"]
  is_box = lambda x: isinstance(x, nn.Partitioned)
  annotated = jax.tree_util.tree_map(lambda x: tuple(x.names) if is_box(x) else None, boxed,
                                     is_leaf=is_box)
  abstract = nn.unbox(boxed)
  logical = _logical_from(abstract, annotated, tuple(path_rules))

  def init(key):
    return nn.unbox(module.init(key, example_input)["params"])

  def loss(params, batch, dtype=jnp.float32, dims=None, manual=frozenset()):
    params = cast(zero.gather(params, dims), dtype)
    x = batch[input_key]
    x = x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return loss_fn(module.apply({"params": params}, x), batch)
  return ModelDef(init=init, loss=loss, logical=logical, abstract=abstract)


def decoder(cfg) -> ModelDef:
  """jaxpar's decoders (`model.kind` gpt or llama) in `precision.param_dtype`, each layer under
  `parallel.remat`'s policy: ZeRO-3 gathers one layer at a time inside the scan; the pipeline
  form runs any schedule."""
  from jaxpar import precision
  from jaxpar.models import decoder as d
  param_dtype, remat = precision.param_dtype(cfg.precision), cfg.parallel.remat
  module = _decoders()[cfg.model.kind]
  mc = cfg.model
  parts = decoder_parts(mc)
  base = from_nnx(lambda rngs: module.MODULE(mc, rngs=rngs, param_dtype=param_dtype),
                  loss_fn=lambda out, batch: (out, {}))

  def loss(params, batch, dtype=jnp.float32, dims=None, manual=frozenset()):
    return d.loss(parts, params, batch, dtype, dims, remat, manual)

  def pipeline(params, micro, sched, dtype=jnp.float32, dims=None, manual=frozenset(), loss_scale=1.0,
               forward_only=False):
    return d.pipeline_grads(parts, params, micro, sched, dtype, dims, remat, manual, loss_scale,
                            forward_only)
  # DESIGN's model FLOPs per token: 6 N_nonembedding + 12 L D T (causal attention counted in full)
  flops_tok = 6 * module.n_params_nonembedding(mc) + 12 * mc.n_layers * mc.d_model * mc.seq_len
  return ModelDef(init=base.init, loss=loss, logical=base.logical, abstract=base.abstract,
                  tokens_per_example=mc.seq_len, flops_per_example=flops_tok * mc.seq_len,
                  pipeline=pipeline)


gpt = decoder  # the name jaxpar's GPT has always been built by


def _decoders() -> dict:
  from jaxpar.models import gpt as g, llama
  return {"gpt": g, "llama": llama}


def decoder_parts(mc):
  """The embed / block / head functions of the decoder `mc.kind` (models/decoder.py)."""
  return _decoders()[mc.kind].parts(mc)
