"""Expert parallelism: a mixture's experts split over the mesh axis the rules map `expert` to
(`data` in jaxpar's table, as Megatron and DeepSpeed fold expert parallelism into data
parallelism), and each token's rows carried to the device that owns its expert and back by
all-to-all, inside the step's shard_map that is manual over that axis.

models/moe.py sorts a device's (token, expert) rows by expert and calls `run_owned` with the
function that runs its experts; this module decides whether that needs an exchange and does it.
The exchange has static shapes: each device sends every other device a buffer of `capacity` rows
(all of its rows when dropless, so no expert can overflow), which the receiver sorts by its own
experts for one grouped matmul. Rows past the count a buffer holds are padding: sent, never
computed into a result. The backward of an all-to-all is the reverse all-to-all, so an owned
expert's gradient comes back summed over every shard's tokens (zero.OWNED).
Letters: A rows (tokens x k), D embed, E experts, El experts per device, d devices of the axis,
S rows per buffer.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel.rules import axis_of

DATA, CONTEXT = jmesh.DATA, jmesh.CONTEXT


def _manual_now(manual) -> frozenset:
  return frozenset(manual) | frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def owner_axis(manual=frozenset()) -> str | None:
  """The mesh axis that splits the experts where a block runs manual over it (the step's shard_map
  over `data`); None where the experts are whole here, or split by GSPMD (an automatic axis)."""
  axis = axis_of("expert")
  mesh = jax.sharding.get_abstract_mesh()
  if not isinstance(axis, str) or mesh.empty or axis not in mesh.axis_names:
    return None
  return axis if axis in _manual_now(manual) and mesh.shape[axis] > 1 else None


def token_mean(x, manual=frozenset()):
  """The mean of x over the shards of the tokens (`data` and `context`, where manual here): a
  router statistic of this device's tokens -> the whole batch's, so every layout agrees with one
  device (the shards hold equally many tokens)."""
  axes = tuple(a for a in (DATA, CONTEXT) if a in _manual_now(manual))
  return jax.lax.pmean(x, axes) if axes else x


def run_owned(rows: jax.Array, group_sizes: jax.Array, compute: Callable, capacity: int,
              axis: str) -> jax.Array:
  """compute's outputs for rows (A, D) sorted by expert, group_sizes (E,) of them (the rows past
  their sum are dropped: zeros out), each row computed on the device of `axis` that owns its
  expert. compute(rows (M, D), group_sizes (El,)) -> (M, D) runs this device's El experts on
  rows sorted by them (rows past the sum are padding). `capacity`: rows per buffer, S."""
  A, D = rows.shape
  d, E = jax.lax.axis_size(axis), group_sizes.shape[0]
  El, S = E // d, capacity
  per_dev = group_sizes.reshape(d, El).sum(1)  # (d,) rows for each owner
  start = jnp.cumsum(per_dev) - per_dev  # (d,) where each owner's rows begin
  r = jnp.arange(S)
  valid = r[None] < per_dev[:, None]  # (d, S)
  send = jnp.where(valid[..., None], rows[jnp.clip(start[:, None] + r[None], 0, A - 1)], 0)
  recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # (d, S, D): recv[s] from device s
  counts = jax.lax.all_to_all(group_sizes.reshape(d, El), axis, 0, 0, tiled=True)  # (d, El)
  # each received row's expert among this device's El (El: padding), then rows sorted by it
  ends = jnp.cumsum(counts, axis=1)  # (d, El)
  local = jnp.sum(r[None, :, None] >= ends[:, None, :], -1).reshape(d * S)
  order = jnp.argsort(local, stable=True)
  out = compute(recv.reshape(d * S, D)[order], counts.sum(0))  # (d*S, D)
  out = out[jnp.argsort(order)].reshape(d, S, D)
  back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # (d, S, D): back[j] from owner j
  # sorted row i went to owner j(i), at offset i - start[j] of its buffer
  i = jnp.arange(A)
  owner = jnp.sum(i[:, None] >= jnp.cumsum(per_dev)[None], -1)  # (A,) d: dropped
  kept = owner < d
  owner = jnp.minimum(owner, d - 1)
  got = back[owner, jnp.clip(i - start[owner], 0, S - 1)]
  return jnp.where(kept[:, None], got, 0)
