"""A user's model as a stack of identical blocks: `from_stack`, the pipeline form of your own model.

`from_nnx` and `from_linen` see a model as one call, so jaxpar cannot cut it into pipeline stages
nor gather its ZeRO-3 shards one layer at a time. `from_stack` takes the model in three parts, an
embedding, one block and a head (each a Flax Linen module or an NNX factory), initialises
`n_layers` blocks into one stack of parameters on a leading 'layers' axis and runs them as
jaxpar's decoders run theirs (stack.py): one `lax.scan`, each layer gathered and checkpointed
under `parallel.remat`, and GPipe, 1F1B or the circular schedule when the mesh has pipeline > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from jaxpar.config import ConfigError
from jaxpar.models import stack
from jaxpar.models.base import (LossFn, ModelDef, _arguments, _in_dtype, _logical_from, cast,
                                linen_annotations, nnx_annotations)
from jaxpar.parallel import rules
from jaxpar.parallel.context import StepContext

# A loss_fn metric of this name weighs the batch's pieces (train/step.py's WEIGHT); the pipeline's
# microbatches are equal pieces, so a stack's loss may not use it there.
_WEIGHT = "loss_weight"


@dataclass(frozen=True)
class _Part:
  """One of the three parts as pure functions: init(key) -> params, apply(params, *args)."""
  init: Callable[[jax.Array], Any]
  apply: Callable[..., Any]
  abstract: Any  # jax.ShapeDtypeStruct leaves
  annotated: Any  # per leaf its logical axes, or None


def _paths(tree) -> str:
  return ", ".join(rules.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def _nnx_part(name: str, factory: Callable) -> _Part:
  """An NNX factory (rngs -> module) whose state is parameters only."""
  from flax import nnx
  with nnx.use_eager_sharding(False):
    module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
  if not isinstance(module, nnx.Module):
    raise ConfigError(f"from_stack's {name} must be a Flax Linen module or a factory rngs -> "
                      f"nnx.Module; it returned {type(module).__name__}")
  graphdef, state, streams, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
  if jax.tree_util.tree_leaves(streams):
    raise ConfigError(f"from_stack's {name} holds RNG streams ({_paths(nnx.to_pure_dict(streams))})"
                      f", but a stack's blocks run without a key; build it without rngs= "
                      f"(no dropout), or use from_nnx on a mesh with pipeline=1")
  if jax.tree_util.tree_leaves(rest):
    raise ConfigError(f"from_stack's {name} holds state other than nnx.Param "
                      f"({_paths(nnx.to_pure_dict(rest))}), and a stack's parts may hold "
                      f"parameters only")

  def init(key):
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(key)), nnx.Param))

  def apply(params, *args, **kwargs):
    return nnx.merge(graphdef, params)(*args, **kwargs)
  return _Part(init, apply, nnx.to_pure_dict(state), nnx_annotations(state))


def _linen_part(name: str, module, args: tuple, kwargs: dict) -> _Part:
  """A Linen module whose variables are `params` only, initialised on inputs shaped like
  `args`/`kwargs` (arrays or jax.ShapeDtypeStruct)."""
  import flax.linen as nn
  zeros = lambda tree: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  variables = jax.eval_shape(lambda k: module.init(k, *zeros(args), **zeros(kwargs)),
                             jax.random.key(0))
  others = sorted(k for k in variables if k != "params")
  if others:
    raise ConfigError(f"from_stack's {name} has the variables {', '.join(others)} beside "
                      f"'params', and a stack's parts may hold parameters only")
  boxed = variables.get("params", {})

  def init(key):
    return nn.unbox(module.init(key, *zeros(args), **zeros(kwargs)).get("params", {}))

  def apply(params, *a, **kw):
    return module.apply({"params": params}, *a, **kw)
  return _Part(init, apply, nn.unbox(boxed), linen_annotations(boxed))


def _is_linen(part) -> bool:
  import flax.linen as nn
  return isinstance(part, nn.Module)


def _abstract(tree):
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                                tree)


def from_stack(embed: Any, block: Any, head: Any, n_layers: int, loss_fn: LossFn,
               input_key: Any = "x", inputs: Callable | None = None,
               example_input: Any = None, path_rules: Iterable[tuple[str, tuple]] = ()
               ) -> ModelDef:
  """A model of `n_layers` identical blocks: embed(inputs) -> x, block(x) -> x (n_layers times,
  each with its own parameters), head(x) -> outputs, scored by loss_fn(outputs, batch) -> (loss,
  metrics). With a mesh whose pipeline axis is > 1 the blocks are the pipeline's stages.

  Each part is a Flax Linen module or an NNX factory (rngs -> nnx.Module), holding parameters
  only (no dropout streams, batch statistics or caches). The embedding's inputs come from the
  batch by `input_key` (a key, a tuple of keys, or None: the whole batch) or `inputs(batch)`, as
  in `from_nnx`. A Linen part is initialised on example inputs: `example_input` (the embedding's
  input for one key, else an example batch), the block and head on the embedding's output.
  The parameters are {'embed': ..., 'layers': the blocks' parameters stacked on a leading axis of
  n_layers, logical name 'layers', 'head': ...}; logical axes come from the parts' annotations,
  else from `path_rules` (regexes on those paths, e.g. 'layers/.*kernel', axes of one block).

  Through the pipeline loss_fn's metrics (float scalars) are means over the microbatches, which
  weigh the same, so a 'loss_weight' metric is refused there.
  """
  if not isinstance(n_layers, int) or n_layers < 1:
    raise ConfigError(f"from_stack's n_layers={n_layers!r} must be a positive int")
  if inputs is None and isinstance(input_key, str) and example_input is not None:
    example_args, example_kwargs = (example_input,), {}
  elif example_input is not None:
    example_args, example_kwargs = _arguments(example_input, input_key, inputs)
  linen = [n for n, p in (("block", block), ("head", head)) if _is_linen(p)]
  if example_input is None and (linen or _is_linen(embed)):
    raise ConfigError(f"from_stack needs example_input= (the embedding's input, or an example "
                      f"batch) to initialise its Linen {', '.join(linen) or 'embed'}")
  parts = {}
  if _is_linen(embed):
    parts["embed"] = _linen_part("embed", embed, _abstract(example_args),
                                 _abstract(example_kwargs))
  else:
    parts["embed"] = _nnx_part("embed", embed)
  x = None
  if example_input is not None:
    x = jax.eval_shape(lambda p, a, kw: parts["embed"].apply(p, *a, **kw),
                       parts["embed"].abstract, _abstract(example_args), _abstract(example_kwargs))
    if not isinstance(x, jax.ShapeDtypeStruct):
      raise ConfigError(f"from_stack's embed must return one array, the blocks' input; it "
                        f"returned {type(x).__name__}")
  for name, part in (("block", block), ("head", head)):
    parts[name] = _linen_part(name, part, (x,), {}) if _is_linen(part) else _nnx_part(name, part)
  one_block = parts["block"]
  if not jax.tree_util.tree_leaves(one_block.abstract):
    raise ConfigError("from_stack's block has no parameters, so there is no stack to scan "
                      "or to cut into pipeline stages")
  layered = lambda a: jax.ShapeDtypeStruct((n_layers,) + tuple(a.shape), a.dtype)
  abstract = {"embed": parts["embed"].abstract,
              "layers": jax.tree_util.tree_map(layered, one_block.abstract),
              "head": parts["head"].abstract}
  annotated = {k: parts["block" if k == "layers" else k].annotated for k in abstract}
  # the block's own axes, matched on one block's shapes, then the stack's 'layers' in front
  one = {**abstract, "layers": one_block.abstract}
  logical = _logical_from(one, annotated, tuple(path_rules))
  logical["layers"] = jax.tree_util.tree_map(lambda names: ("layers",) + tuple(names),
                                             logical["layers"],
                                             is_leaf=lambda n: isinstance(n, tuple))

  def init(key):
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    return {"embed": parts["embed"].init(k_embed),
            "layers": jax.vmap(one_block.init)(jax.random.split(k_layers, n_layers)),
            "head": parts["head"].init(k_head)}

  def embed_fn(top, batch_inputs, dtype):
    args, kwargs = batch_inputs
    return parts["embed"].apply(cast(top["embed"], dtype), *_in_dtype(args, dtype),
                                **_in_dtype(kwargs, dtype))

  def block_fn(p, x, ctx):
    y = one_block.apply(cast(p, ctx.dtype), x)
    if not hasattr(y, "shape") or y.shape != x.shape:
      raise ConfigError(f"from_stack's block maps x of shape {x.shape} to "
                        f"{getattr(y, 'shape', type(y).__name__)}; a stack's blocks must keep "
                        f"their input's shape")
    return y.astype(x.dtype)

  def head_fn(top, x):
    return parts["head"].apply(cast(top["head"], x.dtype), x)
  model = stack.Parts(embed=embed_fn, block=block_fn, head=head_fn)
  arguments = lambda batch: _arguments(batch, input_key, inputs)

  def loss(params, batch, ctx=StepContext(), rng=None):
    outputs = stack.forward(model, params, arguments(batch), ctx, ctx.remat)
    return loss_fn(outputs, batch)

  def score(outputs, mb):
    loss, metrics = loss_fn(outputs, mb)
    if _WEIGHT in metrics:
      raise ConfigError(f"loss_fn's {_WEIGHT!r} metric weighs the batch's pieces, but the "
                        f"pipeline's microbatches weigh the same; drop it, or use a mesh with "
                        f"pipeline=1")
    return loss, metrics

  def pipeline(params, micro, sched, ctx=StepContext(), loss_scale=1.0, forward_only=False):
    return stack.pipeline_grads(model, params, micro, sched, score, inputs=arguments, ctx=ctx,
                                remat=ctx.remat, loss_scale=loss_scale,
                                forward_only=forward_only)
  return ModelDef(init=init, loss=loss, logical=logical, abstract=abstract, pipeline=pipeline)
