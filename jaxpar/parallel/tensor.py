"""Megatron's tensor and sequence parallelism: the column- and row-parallel matmuls of a
transformer block over the `model` axis, as explicit collectives with hand-written backward passes.

A decoder's block calls `column_parallel` for the matmuls that split their output over `model`
(q/k/v, the MLP's up projection, the vocab-parallel head) and `row_parallel` for those whose
partial sums must be reduced (attention's out-projection, the MLP's down projection). Which
collectives run follows the trainer's rules table (`rules.is_split`) and the mesh axes already
manual where the block runs: a model names its matmuls, and this module decides how they split.
Letters: B batch, T seq, D embed, N and F a matmul's split output / input features.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import zero
from jaxpar.parallel.rules import constrain, is_split

MODEL, DATA, PIPE, CONTEXT = jmesh.MODEL, jmesh.DATA, jmesh.PIPE, jmesh.CONTEXT

# Megatron's pattern for a block's two matmul pairs: column-parallel in (the output split over
# `model`), row-parallel out (partial sums reduced over `model`). With sequence parallelism the
# residual stream between them is split along `seq` over `model`: the row-parallel sum becomes a
# reduce-scatter along seq and the column-parallel input an all-gather along seq, each the other's
# backward. They are written as explicit collectives in a shard_map over `model`, so every
# backend's program holds reduce-scatters (GSPMD left alone emits an all-reduce and a slice, which
# only some compilers fuse), with hand-written backward passes: inside the step's shard_map over
# `data`, jax cannot yet transpose a nested shard_map.

def sequence_parallel(manual=frozenset()) -> bool:
  """Whether activations between the matmuls are split along seq over `model` now, by the
  explicit collectives below. Inside a shard_map manual over `pipeline` or `context` (mesh axes
  after `model`) the split is left to the activation constraints (GSPMD): XLA aborts compiling a
  shard_map over `model` nested in one over such an axis ("Manual axes must be sorted by mesh axis
  index", JAX 0.11.2 and 0.12)."""
  now = _manual_now(manual)
  return MODEL not in now and not now & {PIPE, CONTEXT} and is_split("seq")


def column_parallel(x: jax.Array, weights: list, manual=frozenset()) -> list:
  """x (B, T, D) times each w (D, N, ...) whose axis 1 is split over `model` -> [(B, T, N, ...)],
  as 2-D matmuls. Under sequence parallelism x arrives split along seq and is all-gathered first;
  the backward's partial sums over `model` come back reduce-scattered along seq."""
  if not sequence_parallel(manual):
    return [_mm(x, w) for w in weights]
  manual = _manual_now(manual)
  return _column_sp(x, [_varying(w, manual) for w in weights], manual)


def row_parallel(h: jax.Array, w: jax.Array, manual=frozenset()) -> jax.Array:
  """h (B, T, F) @ w (F, D), F split over `model` -> (B, T, D), the partial sums reduced: by an
  all-reduce, or under sequence parallelism by a reduce-scatter that leaves the result split along
  seq (its backward, an all-gather)."""
  if not sequence_parallel(manual):
    return constrain(_mm(h, w), ("batch", "seq", "embed"), manual=manual)
  manual = _manual_now(manual)
  return _row_sp(h, _varying(w, manual), manual)


def _mm(x, w):
  """x (B, T, D) @ w (D, ...) -> (B, T, ...), as one 2-D matmul."""
  D = x.shape[-1]
  return (x.reshape(-1, D) @ w.reshape(D, -1)).reshape(*x.shape[:2], *w.shape[1:])


def _mm_t(dy, w):
  """dy (B, T, ...) @ w (D, ...) transposed -> (B, T, D)."""
  D = w.shape[0]
  return (dy.reshape(dy.shape[0] * dy.shape[1], -1) @ w.reshape(D, -1).T).reshape(*dy.shape[:2], D)


def _dw(x, dy, shape):
  """The weight gradient of _mm: x (B, T, D), dy (B, T, ...) -> (D, ...) = `shape`."""
  D = x.shape[-1]
  return (x.reshape(-1, D).T @ dy.reshape(x.shape[0] * x.shape[1], -1)).reshape(shape)


def _gather_seq(x):
  return jax.lax.all_gather(x, MODEL, axis=1, tiled=True)


def _scatter_seq(y):
  # summed in float32 like every sum over `data`: a half-precision reduce-scatter loses the small
  # partial sums, and XLA:CPU aborts the process compiling it
  return zero.in_float32(
      lambda y: jax.lax.psum_scatter(y, MODEL, scatter_dimension=1, tiled=True))(y)


def _manual_now(manual) -> frozenset:
  """The mesh axes manual here: `manual` and those of every enclosing shard_map."""
  return frozenset(manual) | frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _batch_axes(manual) -> tuple:
  """(the batch dimension's spec, the axes) of a shard_map over `model`: manual over `data` too
  unless an enclosing shard_map already is, so the batch keeps its split."""
  if DATA in manual:
    return None, {MODEL}
  return DATA, {MODEL, DATA}


def _varying(w, manual):
  """Inside the step's shard_map over `data` (and `context`), marks `w` as varying over those of
  them it is manual over: they split the batch's tokens. A weight shared by the tokens' shards is
  marked before the hand-written backward returns its per-shard gradient (the mark's own backward
  is the sum over them, as jax inserts it for any matmul with the batch), and that backward's
  results, which leave a shard_map over `model` alone, are marked so their types match what they
  are."""
  for axis in (DATA, CONTEXT):
    if axis in manual:
      try:
        w = jax.lax.pcast(w, (axis,), to="varying")
      except ValueError:  # already varying (a ZeRO-3 shard gathered over `data`, an activation)
        pass
  return w


def _weight_grad_sum(dw, manual):
  """A weight gradient summed over the batch's shards where this shard_map holds them."""
  return dw if DATA in manual else zero.in_float32(lambda g: jax.lax.psum(g, DATA))(dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _column_sp(x, ws, manual):
  b, axes = _batch_axes(manual)
  n = len(ws)
  return jax.shard_map(lambda x, ws: [_mm(_gather_seq(x), w) for w in ws],
                       in_specs=(P(b, MODEL), [P(None, MODEL)] * n),
                       out_specs=[P(b, None, MODEL)] * n, axis_names=axes)(x, ws)


def _column_sp_fwd(x, ws, manual):
  return _column_sp(x, ws, manual), (x, ws)


def _column_sp_bwd(manual, res, dys):
  b, axes = _batch_axes(manual)
  x, ws = res
  n = len(ws)

  def local(x, ws, dys):
    dx = _scatter_seq(sum(_mm_t(dy, w) for dy, w in zip(dys, ws)))
    xg = _gather_seq(x)
    return dx, [_weight_grad_sum(_dw(xg, dy, w.shape), manual) for dy, w in zip(dys, ws)]
  w_spec = [P(None, MODEL)] * n
  dx, dws = jax.shard_map(local, in_specs=(P(b, MODEL), w_spec, [P(b, None, MODEL)] * n),
                          out_specs=(P(b, MODEL), w_spec), axis_names=axes)(x, ws, dys)
  return _varying(dx, manual), [_varying(dw, manual) for dw in dws]


_column_sp.defvjp(_column_sp_fwd, _column_sp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _row_sp(h, w, manual):
  b, axes = _batch_axes(manual)
  return jax.shard_map(lambda h, w: _scatter_seq(_mm(h, w)), in_specs=(P(b, None, MODEL), P(MODEL)),
                       out_specs=P(b, MODEL), axis_names=axes)(h, w)


def _row_sp_fwd(h, w, manual):
  return _row_sp(h, w, manual), (h, w)


def _row_sp_bwd(manual, res, dy):
  b, axes = _batch_axes(manual)
  h, w = res

  def local(h, w, dy):
    g = _gather_seq(dy)
    return _mm(g, w.T), _weight_grad_sum(_dw(h, g, w.shape), manual)
  dh, dw = jax.shard_map(local, in_specs=(P(b, None, MODEL), P(MODEL), P(b, MODEL)),
                         out_specs=(P(b, None, MODEL), P(MODEL)), axis_names=axes)(h, w, dy)
  return _varying(dh, manual), _varying(dw, manual)


_row_sp.defvjp(_row_sp_fwd, _row_sp_bwd)
