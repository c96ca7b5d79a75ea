"""Grouped matmuls for a mixture's experts: rows sorted by group (expert), each group multiplied by
its own weight matrix, with no (rows x groups x width) tensor made.

`jax.lax.ragged_dot` is that operation, and XLA's GPU and TPU backends run it as one; XLA:CPU
computes it as a matmul of every row with every group's weights, masked: temporaries of rows x
groups x width and groups times the FLOPs (36 MiB for 4,096 rows, 8 groups, width 256). On the
CPU `matmul` therefore runs tiles instead: each group's rows are laid out in whole tiles of
`t` rows (a group's last tile padded with zeros), and one loop over the tiles multiplies each by
its group's weights, skipping the tiles past the last group; the backward (a custom VJP) does the
same for the input's and the weights' gradients. Work and temporaries are those of the rows
themselves plus at most t - 1 padding rows per group.
Letters: M rows, K in width, N out width, G groups, t rows per tile, P padded rows (T tiles).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


# True: `matmul` runs jax.lax.ragged_dot on the CPU as well, the path it takes on accelerators
# (tests/test_moe.py runs whole expert-parallel steps through it against the tiles)
RAGGED_DOT_ON_CPU = False


def ragged() -> bool:
  """Whether `matmul` runs jax.lax.ragged_dot (off the CPU) rather than tiles."""
  return RAGGED_DOT_ON_CPU or jax.default_backend() != "cpu"


class Layout(NamedTuple):
  """Where each row goes in the tiled buffer, and each tile's group (`layout`)."""
  dest: jax.Array  # (M,) int32: a row's place among the P padded rows; P for a row past the groups
  tile_group: jax.Array  # (T,) int32: a tile's group; G for a tile past the last group
  tile: int  # t


def _tile_rows(M: int, G: int) -> int:
  """t: a power of two near the mean group's rows, between 8 and 128 (128 rows of a matmul keep the
  CPU's vector units busy; smaller tiles waste less padding on small groups)."""
  t = 8
  while t < 128 and t < M // max(G, 1):
    t *= 2
  return t


def layout(group_sizes: jax.Array, M: int) -> Layout | None:
  """The tiled layout of M rows sorted by group, group_sizes (G,) of them (the rest are padding);
  None where `matmul` runs ragged_dot (not on the CPU), which needs none."""
  if ragged():
    return None
  G = group_sizes.shape[0]
  t = _tile_rows(M, G)
  P = -(-(M + G * (t - 1)) // t) * t  # every group rounded up to whole tiles fits
  ends = jnp.cumsum(group_sizes)
  padded = (group_sizes + t - 1) // t * t
  padded_ends = jnp.cumsum(padded)
  rows = jnp.arange(M, dtype=jnp.int32)
  g = _count_le(ends, rows)  # (M,) a row's group; G: past the groups
  gc = jnp.minimum(g, G - 1)
  dest = jnp.where(g < G, padded_ends[gc] - padded[gc] + rows - (ends[gc] - group_sizes[gc]), P)
  tiles = jnp.arange(P // t, dtype=jnp.int32) * t
  tile_group = _count_le(padded_ends, tiles)
  return Layout(dest.astype(jnp.int32), tile_group, t)


def _count_le(ends: jax.Array, at: jax.Array) -> jax.Array:
  """For each of `at`, how many of the sorted `ends` are at or below it (searchsorted right, by
  comparison: inside a shard_map the sort-based search trips on the ends varying over an axis)."""
  return jnp.sum(at[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
           where: Layout | None = None) -> jax.Array:
  """x (M, K) rows sorted by group, w (G, K, N), group_sizes (G,) int32 -> (M, N) in x's dtype:
  row i times its group's w; rows past sum(group_sizes) give zeros (`jax.lax.ragged_dot`'s
  contract). `where`: the rows' `layout`, made once for several matmuls of the same rows."""
  if ragged():
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
  where = where if where is not None else layout(group_sizes, x.shape[0])
  w = w.astype(x.dtype)
  # Both varying over every manual axis either does (the experts' weights do not vary over
  # `context`, the rows do): the custom backward then returns each gradient in its input's type,
  # and autodiff sums the weights' over the axes they did not vary over.
  x, w = _varying(x, w), _varying(w, x)
  return _tiled(x, w, where.dest, where.tile_group, where.tile)


def _spread(x: jax.Array, dest: jax.Array, P: int) -> jax.Array:
  """x (M, C) -> (P, C): each row at its place in the tiled buffer, zeros elsewhere."""
  return jnp.zeros((P,) + x.shape[1:], x.dtype).at[dest].set(x, mode="drop")


def _gather(y: jax.Array, dest: jax.Array) -> jax.Array:
  """(P, C) -> (M, C): each row's result, zeros for rows past the groups."""
  P = y.shape[0]
  return jnp.where((dest < P)[:, None], y[jnp.minimum(dest, P - 1)], 0).astype(y.dtype)


def _varying(z: jax.Array, *like: jax.Array) -> jax.Array:
  """z (zeros) made varying over the manual mesh axes any of `like` varies over: inside a
  shard_map that checks them, a loop's carry and a cond's branches must agree. (A zero of each,
  added, carries its axes.)"""
  for a in like:
    z = z + jnp.zeros_like(a, shape=()).astype(z.dtype)
  return z


def _per_tile(fn, tile_group: jax.Array, G: int, xs, out_shape, like, carry=None):
  """fn(carry, group, *tile slices) -> (carry, (t, C)) over the tiles of a group; a tile past the
  last group yields zeros and leaves the carry. xs: (T, t, ...) arrays; -> (carry, (T, t, C)).
  `like`: the arrays fn's result is made of (their manual axes)."""
  zeros = _varying(jnp.zeros(out_shape, xs[0].dtype), *like)

  def body(c, args):
    g, *tiles = args
    return jax.lax.cond(g < G, lambda: fn(c, jnp.minimum(g, G - 1), *tiles), lambda: (c, zeros))
  return jax.lax.scan(body, carry, (tile_group, *xs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled(x, w, dest, tile_group, t):
  return _forward(x, w, dest, tile_group, t)


def _forward(x, w, dest, tile_group, t):
  G, K, N = w.shape
  T = tile_group.shape[0]
  xt = _spread(x, dest, T * t).reshape(T, t, K)
  _, y = _per_tile(lambda c, g, a: (c, a @ w[g]), tile_group, G, (xt,), (t, N), (x, w))
  return _gather(y.reshape(T * t, N), dest)


def _fwd(x, w, dest, tile_group, t):
  return _forward(x, w, dest, tile_group, t), (x, w, dest, tile_group)


def _bwd(t, res, dy):
  x, w, dest, tile_group = res
  G, K, N = w.shape
  T = tile_group.shape[0]
  xt = _spread(x, dest, T * t).reshape(T, t, K)
  dyt = _spread(dy.astype(x.dtype), dest, T * t).reshape(T, t, N)

  def tile(dw, g, a, b):  # a (t, K) rows, b (t, N) their output's cotangent
    dw = dw.at[g].add((a.T @ b).astype(jnp.float32))
    return dw, b @ w[g].T
  dw, dx = _per_tile(tile, tile_group, G, (xt, dyt), (t, K), (x, w, dy),
                     carry=_varying(jnp.zeros((G, K, N), jnp.float32), x, dy))
  return _gather(dx.reshape(T * t, K), dest), dw.astype(w.dtype), None, None


_tiled.defvjp(_fwd, _bwd)
