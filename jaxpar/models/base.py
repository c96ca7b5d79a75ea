"""What the trainer needs from a model, and adapters from Flax NNX and Flax Linen modules.

A `ModelDef` is pure: `init(key) -> params` (a plain nested dict of arrays), `loss(params, batch,
ctx)`, and the logical axes of every parameter. jaxpar's own models and a user's Flax module
reach the trainer the same way, so the rules, ZeRO and the step treat them alike; what the step
decides (compute dtype, ZeRO-3 shards, manual mesh axes) reaches the model as one `StepContext`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import jax
import jax.extend.random as jrandom
import jax.numpy as jnp
from jax import lax

from jaxpar.config import ConfigError
from jaxpar.parallel import rules, zero
from jaxpar.parallel.context import StepContext

# loss_fn(outputs, batch) -> (scalar loss, dict of scalar metrics); with loss_takes, also the
# keyword arguments it names (LOSS_EXTRAS)
LossFn = Callable[..., tuple[jax.Array, dict]]
LOSS_EXTRAS = ("params", "rng", "aux")


@dataclass(frozen=True)
class ModelDef:
  """init(key) -> params; loss(params, batch, ctx=StepContext(), rng=None) -> (loss, metrics),
  `ctx` the step's dtype, ZeRO-3 dims and manual axes (parallel/context.py); logical axes."""
  init: Callable[[jax.Array], Any]
  loss: Callable[..., tuple[jax.Array, dict]]
  logical: Any  # same tree as params; each leaf a tuple of logical axis names (or None)
  abstract: Any  # same tree; jax.ShapeDtypeStruct leaves
  tokens_per_example: int = 0  # for tokens/s; 0 = not a sequence model
  flops_per_example: float = 0.0  # training FLOPs of one example (MFU); 0 = unknown
  # (params, micro, schedule, ctx, loss_scale=1.0, forward_only=False) -> (loss, metrics, grads of
  # loss_scale * loss, or None when forward_only); None = no pipeline
  pipeline: Callable[..., tuple[jax.Array, dict, Any]] | None = None
  # loss(..., rng=key) takes the step's key (train_key) for the piece of the batch it is given;
  # rng=None (eval) runs deterministic
  takes_rng: bool = False
  # the `model.kind` jaxpar built it from (models/registry.py); None for a model of the user's
  # own (from_nnx, from_linen): checkpoints record it, so an export can say which it holds
  kind: str | None = None
  # (batch, C) -> the batch with every leaf's sequence on axis 1 in models/ring.py's order, which
  # the step splits over a `context` axis of C; its loss then runs on one device's share and its
  # attention around the ring. None: the model cannot be split along the sequence (context=1)
  seq_split: Callable[[Any, int], Any] | None = None
  # the parameters the model itself holds fixed (a tree of bools like `abstract`), joined to the
  # trainer's `frozen`: a LoRA model's base weights (models/lora.py). None: none
  frozen: Any = None


# -- the per-step RNG ---------------------------------------------------------------------------
# A step's key is fold_in(key(train.seed), step). A data shard (or accumulated microbatch) holds
# rows r0.. of the global batch and must draw the bits that rows r0.. of a one-device draw hold,
# or dropout masks would depend on the layout. Partitionable threefry numbers each element of a
# draw by its flat index, so a key that also carries r0 (the "rows" key below) shifts its counter
# by r0 rows: a draw of shape (b, ...) is then rows r0..r0+b of the global draw of the same key.
# With r0 = 0 it is threefry, bit for bit, so a plain-JAX reference with jax.random.key draws the
# same masks. Draws without a leading batch axis (e.g. on a weight) would differ per shard.
#
# Split over a `context` axis of C, a device holds positions of chunks i and 2C-1-i of each row
# (models/ring.py's order): its key also carries i (the "ring" key, one impl per C), and a draw
# of shape (b, n, ...) numbers the element at local position t by its global position, so the
# device draws exactly the bits one device's (b, C n, ...) draw holds there.
_THREEFRY = jrandom.threefry_prng_impl
_U32 = jnp.uint32


def _extra_seed(n: int):
  return lambda seed: jnp.concatenate([_THREEFRY.seed(seed), jnp.zeros((n,), _U32)])


def _extra_split(key, shape):
  sub = _THREEFRY.split(key[:2], shape)
  return jnp.concatenate([sub, jnp.broadcast_to(key[2:], shape + key[2:].shape)], axis=-1)


def _extra_fold_in(key, data):
  return jnp.concatenate([_THREEFRY.fold_in(key[:2], data), key[2:]])


def _mul_64(a, b: int):
  """(hi, lo) uint32 words of the 64-bit product of uint32 `a` and a Python int b < 2**32
  (no uint64 without jax_enable_x64)."""
  a_lo, a_hi = a & 0xFFFF, a >> 16
  b_lo, b_hi = _U32(b & 0xFFFF), _U32(b >> 16)
  ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
  mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
  return hh + (lh >> 16) + (hl >> 16) + (mid >> 16), (ll & 0xFFFF) | (mid << 16)


def _counter_bits(key, bit_width, shape, flat, row: int):
  """Threefry's bits of the elements numbered `flat` (uint32, `shape`) within the draw, the whole
  counter moved on by key[2] rows of `row` elements."""
  hi, lo = _mul_64(key[2], row)
  lo = flat + lo
  hi = hi + (lo < flat).astype(_U32)  # the carry
  b1, b2 = jrandom.threefry2x32_p.bind(key[0], key[1], hi, lo)
  if bit_width == 64:
    return (b1.astype(jnp.uint64) << 32) | b2.astype(jnp.uint64)
  return (b1 ^ b2).astype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width])


def _too_many(n: int) -> ConfigError:
  # The row offset is added to a 64-bit counter, but one draw's own counter is 32-bit.
  return ConfigError(f"a random draw of {n} elements in one piece of the batch is more than the "
                     f"2**32 the step's key can number; draw in smaller pieces")


def _flat(shape, first: int = 0):
  """Each element's row-major index within its axes `first`.. of `shape` (uint32)."""
  flat = jnp.zeros(shape, _U32)
  for d in range(first, len(shape)):
    flat = flat + lax.broadcasted_iota(_U32, shape, d) * _U32(math.prod(shape[d + 1:]))
  return flat


def _rows_bits(key, bit_width, shape):
  """Partitionable threefry's bits with the flat counter moved on by key[2] rows of `shape`."""
  if math.prod(shape) >= 2 ** 32:
    raise _too_many(math.prod(shape))
  return _counter_bits(key, bit_width, shape, _flat(shape), math.prod(shape[1:]) if shape else 1)


def _ring_bits(C: int):
  def bits(key, bit_width, shape):
    """`_rows_bits` of the global draw (b, C n, ...) at this device's positions (key[3] = i)."""
    if len(shape) < 2 or shape[1] % 2:
      raise ConfigError(f"a random draw of shape {tuple(shape)} inside a step split over "
                        "context must have the batch, then the sequence (two equal chunks), as "
                        "its leading axes")
    n, rest = shape[1], math.prod(shape[2:])
    row = C * n * rest  # a global row's elements
    if shape[0] * row >= 2 ** 32:
      raise _too_many(shape[0] * row)
    c, i = n // 2, key[3]
    t = lax.broadcasted_iota(_U32, shape, 1)
    position = jnp.where(t < c, i * c + t, (2 * C - 1 - i) * c + t - c)
    flat = (lax.broadcasted_iota(_U32, shape, 0) * _U32(row) + position * _U32(rest)
            + _flat(shape, 2))
    return _counter_bits(key, bit_width, shape, flat, row)
  return bits


_ROWS = jrandom.define_prng_impl(key_shape=(3,), seed=_extra_seed(1), split=_extra_split,
                                 random_bits=_rows_bits, fold_in=_extra_fold_in,
                                 name="jaxpar_rows_threefry", tag="jprows")


@functools.lru_cache(maxsize=None)
def _ring(C: int):
  return jrandom.define_prng_impl(key_shape=(4,), seed=_extra_seed(2), split=_extra_split,
                                  random_bits=_ring_bits(C), fold_in=_extra_fold_in,
                                  name=f"jaxpar_ring{C}_threefry", tag=f"jpring{C}")


def train_key(seed: int, step) -> jax.Array:
  """The key of training step `step` (a traced int): fold_in(key(seed), step), threefry."""
  return jax.random.fold_in(jax.random.key(seed), step)


def at_rows(key: jax.Array, first_row, ring: tuple | None = None) -> jax.Array:
  """`key` (threefry) for a piece of the batch starting at global row `first_row` (traced); with
  `ring` = (i, C), of device i's positions on a context axis of C (traced i, int C)."""
  data = [jax.random.key_data(key), jnp.asarray(first_row, _U32)[None]]
  if ring is None:
    return jax.random.wrap_key_data(jnp.concatenate(data), impl=_ROWS)
  i, C = ring
  data.append(jnp.asarray(i, _U32)[None])
  return jax.random.wrap_key_data(jnp.concatenate(data), impl=_ring(C))


# -- the module's inputs and the loss's extras -------------------------------------------------

def _check_takes(loss_takes) -> tuple:
  loss_takes = tuple(loss_takes)
  bad = [t for t in loss_takes if t not in LOSS_EXTRAS]
  if bad:
    raise ConfigError(f"loss_takes names {', '.join(map(repr, bad))}; it may name "
                      f"{', '.join(map(repr, LOSS_EXTRAS))}")
  return loss_takes


def _arguments(batch, input_key, inputs):
  """(args, kwargs) of the module's call: inputs(batch) (a tuple: positional arguments, a dict:
  keyword arguments, else one argument), or batch[input_key], each of several keys, or the
  whole batch (input_key None)."""
  if inputs is not None:
    got = inputs(batch)
    if isinstance(got, dict):
      return (), got
    return (got if isinstance(got, tuple) else (got,)), {}
  if input_key is None:
    return (batch,), {}
  keys = (input_key,) if isinstance(input_key, str) else tuple(input_key)
  missing = [k for k in keys if not isinstance(batch, dict) or k not in batch]
  if missing:
    have = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise ConfigError(f"the batch has no key {missing[0]!r} (it has {have}); name the model's "
                      f"inputs with input_key= (a key, several keys, or None for the whole "
                      f"batch) or inputs=")
  return tuple(batch[k] for k in keys), {}


def _in_dtype(tree, dtype):
  """Float leaves of a pytree of inputs in the compute dtype."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if _is_float(x) else x, tree)


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _call_loss(loss_fn, loss_takes, outputs, batch, params, rng, aux):
  extras = {"params": params, "rng": rng, "aux": aux}
  return loss_fn(outputs, batch, **{k: extras[k] for k in loss_takes})


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


def nnx_annotations(state) -> Any:
  """An NNX parameter state's logical axes as a pure dict: per leaf the axes it was annotated with
  (`nnx.with_partitioning`, `out_sharding=`; older flax: `sharding_names=`), else None."""
  from flax import nnx

  def names(var):
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(axes) if axes else None
  return nnx.to_pure_dict(jax.tree_util.tree_map(names, state,
                                                 is_leaf=lambda x: isinstance(x, nnx.Variable)))


def from_nnx(factory: Callable[..., Any], loss_fn: LossFn, input_key: Any = "x",
             path_rules: Iterable[tuple[str, tuple]] = (), inputs: Callable | None = None,
             loss_takes: Iterable[str] = ()) -> ModelDef:
  """A Flax NNX model. factory(rngs) -> module; module(*args) -> outputs, args from the batch
  by `input_key` (a key, a tuple of keys, or None: the whole batch) or `inputs(batch)`.

  Parameters annotated with `nnx.with_partitioning(init, axes)` (or `out_sharding=`; older flax:
  `sharding_names=`) use those logical axes; the others are matched by `path_rules`. The state
  may hold `nnx.Param` and RNG streams (e.g. `nnx.Dropout(rate, rngs=rngs)`): each training step
  reseeds every stream with the step's key (`nnx.reseed`) and eval runs `module.eval()`.
  `loss_takes`: the extras loss_fn also takes as keyword arguments: 'params' (the parameters'
  pure dict), 'rng' (the step's key; None in eval), 'aux' (the `nnx.sow` intermediates' pure dict).
  """
  from flax import nnx
  loss_takes = _check_takes(loss_takes)
  with nnx.use_eager_sharding(False):
    module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
  graphdef, state, rng_state, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
  if jax.tree_util.tree_leaves(rest):
    raise ValueError("from_nnx supports models whose state is nnx.Param and RNG streams only; "
                     "found other state: "
                     + ", ".join(rules.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(rest)))
  abstract = nnx.to_pure_dict(state)
  tags = sorted({s.key.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)})
  logical = _logical_from(abstract, nnx_annotations(state), tuple(path_rules))

  def init(key):
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(key)), nnx.Param))

  def placeholder(a):  # the streams' values are reseeded before use; only their shapes matter
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.zeros(a.shape + (2,), _U32), impl="threefry2x32")
    return jnp.zeros(a.shape, a.dtype)

  def loss(params, batch, ctx=StepContext(), rng=None):
    dtype = ctx.dtype
    params = cast(zero.gather(params, ctx.dims), dtype)
    streams = jax.tree_util.tree_map(placeholder, rng_state)
    model = nnx.merge(graphdef, params, streams)
    if rng is None:
      model.eval()  # dropout off (and any other module's deterministic mode)
    elif tags:
      nnx.reseed(model, **{tag: rng for tag in tags})
    args, kwargs = _arguments(batch, input_key, inputs)
    outputs = model(*_in_dtype(args, dtype), **_in_dtype(kwargs, dtype))
    aux = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate)) if "aux" in loss_takes else None
    return _call_loss(loss_fn, loss_takes, outputs, batch, params, rng, aux)
  return ModelDef(init=init, loss=loss, logical=logical, abstract=abstract,
                  takes_rng=bool(tags) or "rng" in loss_takes)


def linen_annotations(boxed) -> Any:
  """A Linen `params` collection's logical axes: per leaf the axes of its
  `nn.with_logical_partitioning` box, else None."""
  import flax.linen as nn
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree_util.tree_map(lambda x: tuple(x.names) if is_box(x) else None, boxed,
                                is_leaf=is_box)


def from_linen(module: Any, example_input: Any, loss_fn: LossFn, input_key: Any = "x",
               path_rules: Iterable[tuple[str, tuple]] = (), inputs: Callable | None = None,
               loss_takes: Iterable[str] = (), rng_names: Iterable[str] = ("dropout",),
               train_kwarg: str | None = None) -> ModelDef:
  """A Flax Linen model. module.apply({'params': p}, *args, rngs=...) -> outputs, args from
  the batch by `input_key` (a key, a tuple of keys, or None: the whole batch) or
  `inputs(batch)`. `example_input`: the module's input for one key, else an example batch.

  Parameters created with `nn.with_logical_partitioning(init, axes)` use those logical axes; the
  others are matched by `path_rules`. The variables may be `params` and `sow`'s
  `intermediates`. Training passes rngs={name: the step's key} for each of `rng_names`, and
  module(..., **{train_kwarg: True}) when `train_kwarg` is given (False in eval, where no rngs
  are passed). `loss_takes`: the extras loss_fn also takes as keyword arguments: 'params',
  'rng' (None in eval), 'aux' (the `intermediates` collection).
  """
  import flax.linen as nn
  loss_takes, rng_names = _check_takes(loss_takes), tuple(rng_names)
  if isinstance(input_key, str) and inputs is None:
    example_args, example_kwargs = (example_input,), {}
  else:
    example_args, example_kwargs = _arguments(example_input, input_key, inputs)
  flag = lambda on: {} if train_kwarg is None else {train_kwarg: on}

  def init_vars(key):
    return module.init({"params": key, **{n: key for n in rng_names}}, *example_args,
                       **example_kwargs, **flag(True))
  variables = jax.eval_shape(init_vars, jax.random.key(0))
  others = sorted(k for k in variables if k not in ("params", "intermediates"))
  if others:
    raise ValueError("from_linen supports models whose variables are 'params' only; found "
                     + ", ".join(others) + " (sown 'intermediates' are allowed: loss_fn's aux)")
  boxed = variables["params"]
  abstract = nn.unbox(boxed)
  logical = _logical_from(abstract, linen_annotations(boxed), tuple(path_rules))

  def init(key):
    return nn.unbox(init_vars(key)["params"])

  def loss(params, batch, ctx=StepContext(), rng=None):
    dtype = ctx.dtype
    params = cast(zero.gather(params, ctx.dims), dtype)
    args, kwargs = _arguments(batch, input_key, inputs)
    rngs = {} if rng is None else {n: rng for n in rng_names}
    outputs = module.apply({"params": params}, *_in_dtype(args, dtype), rngs=rngs,
                           mutable=["intermediates"], **_in_dtype(kwargs, dtype),
                           **flag(rng is not None))
    outputs, mutated = outputs
    return _call_loss(loss_fn, loss_takes, outputs, batch, params, rng,
                      dict(mutated.get("intermediates", {})))
  return ModelDef(init=init, loss=loss, logical=logical, abstract=abstract,
                  takes_rng=bool(rng_names) or "rng" in loss_takes)
