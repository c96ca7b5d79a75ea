"""Expert parallelism: a mixture's experts split over the mesh axis the rules map `expert` to
(`data` in jaxpar's table, as Megatron and DeepSpeed fold expert parallelism into data
parallelism), and each token's rows carried to the device that owns its expert and back by
all-to-all, inside the step's shard_map that is manual over that axis.

models/moe.py sorts a device's (token, expert) rows by expert and calls `run_owned` with the
function that runs its experts, or, with a capacity, lays them out in each expert's C slots and
calls `run_slotted`; this module does the exchange.
The exchange has static shapes: each device sends every other device a buffer of `capacity` rows
(all of its rows when dropless, so no expert can overflow), which the receiver sorts by its own
experts for one grouped matmul. Rows past the count a buffer holds are padding: sent, never
computed into a result. The backward of an all-to-all is the reverse all-to-all, so an owned
expert's gradient comes back summed over every shard's tokens (zero.OWNED).
Under tensor parallelism every device of `model` holds the same rows: each sends only its 1/m
slice of every row's width (`width_axis`), so each routed row crosses once, and the owner gathers
the slices over `model` for the experts' matmuls (MaxText splits its dispatch the same way).
Letters: A rows (tokens x k), D embed, E experts, El experts per device, d devices of the axis,
S rows per buffer.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel.rules import axis_of

DATA, CONTEXT, PIPE = jmesh.DATA, jmesh.CONTEXT, jmesh.PIPE


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


def width_axis(D: int, manual=frozenset()) -> str | None:
  """The automatic mesh axis that splits the experts' width (`mlp`'s: `model` in jaxpar's table)
  where the exchanged rows (.., D) can cross split along D over it; None where they cross whole.
  Every device of that axis holds the same rows, so each sends its 1/m of every row's D values
  rather than all of them m times (the floor: each routed row sent once), and the owner gathers
  them over that axis, within a node, for the experts' matmuls. Not inside a shard_map manual
  over `pipeline` or `context`, where XLA refuses a nested one over `model` (tensor.py)."""
  axis = axis_of("mlp")
  mesh = jax.sharding.get_abstract_mesh()
  now = _manual_now(manual)
  if not isinstance(axis, str) or mesh.empty or axis not in mesh.axis_names or now & {PIPE, CONTEXT}:
    return None
  return axis if axis not in now and mesh.shape[axis] > 1 and D % mesh.shape[axis] == 0 else None


# None: the exchange takes the ragged path off the CPU only. True: on the CPU as well,
# jax.lax.ragged_all_to_all emulated by the padded exchange (XLA:CPU does not implement it), as
# tests/test_moe.py and gpu_check.py --small run it; False: the padded path everywhere (gpu_check's
# comparison on the device)
RAGGED: bool | None = None


def ragged() -> bool:
  """Whether the exchange sends only each sender's real rows (jax.lax.ragged_all_to_all, which
  GPUs and TPUs run) rather than padded buffers of `capacity` rows for each owner (the CPU)."""
  return jax.default_backend() != "cpu" if RAGGED is None else RAGGED


class Routes(NamedTuple):
  """A device's side of one exchange, shared by both paths; d = the devices of the axis."""
  sizes: jax.Array  # (d,) rows this device sends each owner: its experts' group sizes summed
  starts: jax.Array  # (d,) where they begin among this device's rows sorted by expert
  counts: jax.Array  # (d, El) rows each sender sends this device, by this device's El experts


def routes(group_sizes: jax.Array, axis: str) -> Routes:
  """The Routes of rows sorted by expert, group_sizes (E,) of them, E/d experts on each device
  of `axis` in order (the group sizes cross by a small all-to-all)."""
  d = jax.lax.axis_size(axis)
  by_owner = group_sizes.reshape(d, group_sizes.shape[0] // d)
  sizes = by_owner.sum(1)
  counts = jax.lax.all_to_all(by_owner, axis, 0, 0, tiled=True)
  return Routes(sizes, jnp.cumsum(sizes) - sizes, counts)


def ragged_args(rt: Routes, axis: str, S: int) -> tuple[tuple, tuple]:
  """jax.lax.ragged_all_to_all's (input_offsets, send_sizes, output_offsets, recv_sizes) for the
  rows out (sorted rows -> owners' buffers: sender s's rows at s x S of each owner's d x S) and
  back (each sender's rows from its owners' buffers to their places among its sorted rows)."""
  got = rt.counts.sum(1)  # (d,) rows from each sender
  me = jax.lax.axis_index(axis)
  d = got.shape[0]
  slots = jnp.arange(d, dtype=got.dtype) * S
  out = (rt.starts, rt.sizes, jnp.full((d,), me * S, got.dtype), got)
  back = (slots, got, jax.lax.all_to_all(rt.starts, axis, 0, 0, tiled=True), rt.sizes)
  return out, back


def _ragged_all_to_all(args: tuple, n_out: int, axis: str, slot: int) -> tuple[Callable, tuple]:
  """(fn, ints): fn(x (n, ...), *ints) -> (n_out, ...) is jax.lax.ragged_all_to_all of x into
  zeros by args (input_offsets, send_sizes, output_offsets, recv_sizes); on the CPU, its emulation
  by a padded all-to-all of `slot` rows a slice (every send size at most `slot`), bit for bit.
  fn only moves x: the emulation's indices are worked out here, outside it, so that a nested
  shard_map around fn carries no integer work that a remat policy would have to split."""
  if jax.default_backend() != "cpu":
    def fn(x, *args):
      out = jnp.zeros((n_out,) + x.shape[1:], x.dtype)
      return jax.lax.ragged_all_to_all(x, out, *args, axis_name=axis)
    return fn, args
  in_off, send, out_off, recv = args
  d = in_off.shape[0]
  r = jnp.arange(slot)
  pick = in_off[:, None] + r[None]  # (d, slot): the rows of x sent to each device, in order
  keep = r[None] < send[:, None]
  at = jax.lax.all_to_all(out_off, axis, 0, 0, tiled=True)  # (d,) where sender s's rows go here
  dest = jnp.where(r[None] < recv[:, None], at[:, None] + r[None], n_out).reshape(d * slot)

  def emulated(x, pick, keep, dest):
    buf = jnp.where(keep.reshape(d, slot, *(1,) * (x.ndim - 1)),
                    x[jnp.clip(pick, 0, x.shape[0] - 1)], 0)
    got = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)  # (d, slot, ...): [s] from device s
    return jnp.zeros((n_out,) + x.shape[1:], x.dtype).at[dest].add(
        got.reshape(d * slot, *x.shape[1:]), mode="drop")
  return emulated, (pick, keep, dest)


def _tiled_all_to_all(x, *, axis):
  return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _linear(fn, ints, x, split):
  """fn(x, *ints), linear in x (..., D) -> (..., D); with `split`, each device of that automatic
  axis applies it to its slice of D (x is alike on all of them), the result split along D over
  it."""
  if split is None:
    return fn(x, *ints)
  return _split_linear(fn, split, (x.shape, x.dtype), x, *ints)


# a shard_map over `split` nested in the step's: jax cannot yet transpose it there (tensor.py),
# so the backward is written out, fn's transpose on each slice
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _split_linear(fn, split, aval, x, *ints):
  spec = P(*(None,) * (x.ndim - 1), split)
  # stated before the nested map: under ZeRO-3 sharding propagation may otherwise put `split`
  # beside a manual axis on the rows' dimension, which the partitioner refuses
  x = jax.lax.with_sharding_constraint(x, spec)
  return jax.shard_map(fn, in_specs=(spec,) + (P(),) * len(ints), out_specs=spec,
                       axis_names={split})(x, *ints)


def _split_linear_fwd(fn, split, aval, x, *ints):
  return _split_linear(fn, split, aval, x, *ints), ints


def _split_linear_bwd(fn, split, aval, ints, ct):
  shape, dtype = aval
  m = jax.sharding.get_abstract_mesh().shape[split]
  local = jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] // m,), dtype)  # a device's slice of x

  def transpose(ct, *ints):  # fn is linear: its vjp at zeros (varying over the axes ct does)
    zero = jnp.zeros(local.shape, local.dtype) + jnp.zeros_like(ct, shape=())
    return jax.vjp(lambda x: fn(x, *ints), zero)[1](ct)[0]
  spec, ct_spec = P(*(None,) * (len(shape) - 1), split), P(*(None,) * (ct.ndim - 1), split)
  ct = jax.lax.with_sharding_constraint(ct, ct_spec)
  dx = jax.shard_map(transpose, in_specs=(ct_spec,) + (P(),) * len(ints), out_specs=spec,
                     axis_names={split})(ct, *ints)
  return (dx,) + (None,) * len(ints)


_split_linear.defvjp(_split_linear_fwd, _split_linear_bwd)


def token_mean(x, manual=frozenset()):
  """The mean of x over the shards of the tokens (`data` and `context`, where manual here): a
  router statistic of this device's tokens -> the whole batch's, so every layout agrees with one
  device (the shards hold equally many tokens)."""
  axes = tuple(a for a in (DATA, CONTEXT) if a in _manual_now(manual))
  return jax.lax.pmean(x, axes) if axes else x


def run_slotted(buf: jax.Array, compute: Callable, axis: str, manual=frozenset()) -> jax.Array:
  """compute's outputs for a capacity's slots, buf (E, C, D): expert e's rows in buf[e], zeros in
  the empty slots, each expert's slots computed on the device of `axis` that owns it.
  compute(rows (El, M, D)) -> (El, M, D) runs this device's El experts on M rows each. The
  buffers cross as they are, E/d x C rows for each owner (an expert's C slots from each sender),
  split along D over `width_axis` where that splits the experts' width; the result comes back
  split so."""
  E, C, D = buf.shape
  d = jax.lax.axis_size(axis)
  El = E // d
  split = width_axis(D, manual)
  along_d = lambda x, a: x if split is None else jax.lax.with_sharding_constraint(
      x, P(*(None,) * (x.ndim - 1), a))
  move = lambda x: _linear(functools.partial(_tiled_all_to_all, axis=axis), (), x, split)
  recv = along_d(move(buf.reshape(d, El * C, D)), None)  # (d, El*C, D): [s] from sender s
  rows = recv.reshape(d, El, C, D).transpose(1, 0, 2, 3).reshape(El, d * C, D)
  out = compute(rows).reshape(El, d, C, D).transpose(1, 0, 2, 3).reshape(d, El * C, D)
  return move(along_d(out, split)).reshape(E, C, D)  # [j] from owner j: its experts' slots


def _ragged_sends_less(A: int, S: int, d: int, split: str) -> bool:
  """Whether the ragged exchange, whose rows cross whole, sends at most the padded one's bytes
  where `split` (m devices) splits the experts' width: at most A whole rows a device (its routed
  rows, the real ones only) against d buffers of S rows, 1/m of each row's width (d S D / m).
  Dropless (S = A) the ragged path wins where m <= d. It cannot split the rows itself: inside the
  step (a layer scan under jax.checkpoint) a shard_map over `model` nested around it is split by
  the remat's partial evaluation, its constants and index arithmetic carried out as residuals
  whose shardings the partitioner refuses ("manual axis model after free axis data", JAX 0.10.2;
  the padded exchange's nested map holds nothing but the all-to-all), and left to GSPMD its
  operand is gathered over `model` first."""
  m = jax.sharding.get_abstract_mesh().shape[split]
  return m * A <= d * S


def run_owned(rows: jax.Array, group_sizes: jax.Array, compute: Callable, capacity: int,
              axis: str, manual=frozenset()) -> jax.Array:
  """compute's outputs for rows (A, D) sorted by expert, group_sizes (E,) of them (the rows past
  their sum are dropped: zeros out), each row computed on the device of `axis` that owns its
  expert. compute(rows (M, D), group_sizes (El,)) -> (M, D) runs this device's El experts on
  rows sorted by them (rows past the sum are padding). `capacity`: rows per buffer, S.
  Where `width_axis` splits the experts' width, the buffers cross split along D over it, and the
  result comes back split so (GSPMD gathers it where the block needs the whole row)."""
  A, D = rows.shape
  d, E = jax.lax.axis_size(axis), group_sizes.shape[0]
  El, S = E // d, capacity
  split = width_axis(D, manual)
  use_ragged = ragged() and (split is None or _ragged_sends_less(A, S, d, split))
  if use_ragged:
    split = None  # see _ragged_sends_less
  along_d = lambda x, a: x if split is None else jax.lax.with_sharding_constraint(
      x, P(*(None,) * (x.ndim - 1), a))  # (.., D) split over `a` along D, or whole (None)
  rt = routes(group_sizes, axis)
  r = jnp.arange(S)
  if use_ragged:  # only the real rows cross, into sender s's slot s x S of each owner's buffer
    there, home = ragged_args(rt, axis, S)
    recv = _linear(*_ragged_all_to_all(there, d * S, axis, S), rows, split)
  else:  # a buffer of S rows for each owner, its rows first, then zeros
    valid = r[None] < rt.sizes[:, None]  # (d, S)
    send = jnp.where(valid[..., None], rows[jnp.clip(rt.starts[:, None] + r[None], 0, A - 1)], 0)
    recv = _linear(functools.partial(_tiled_all_to_all, axis=axis), (), send, split)
  # (d*S, D): sender s's rows at s x S, whole rows for the experts' matmuls (an all-gather over
  # `split` of what crossed split)
  recv = along_d(recv.reshape(d * S, D), None)
  # each received row's expert among this device's El (El: padding), then rows sorted by it
  ends = jnp.cumsum(rt.counts, axis=1)  # (d, El)
  local = jnp.sum(r[None, :, None] >= ends[:, None, :], -1).reshape(d * S)
  order = jnp.argsort(local, stable=True)
  out = compute(recv[order], rt.counts.sum(0))  # (d*S, D)
  # the experts' sums over `split` sent split along D (and in the backward, the cotangent whole
  # once for the experts' matmuls, not a tile at a time)
  out = along_d(along_d(out, None)[jnp.argsort(order)], split)
  if use_ragged:  # each sender's rows straight to their places among its sorted rows, zeros past
    return _linear(*_ragged_all_to_all(home, A, axis, S), out, split)
  back = _linear(functools.partial(_tiled_all_to_all, axis=axis), (), out.reshape(d, S, D),
                 split)  # (d, S, D): back[j] from owner j
  # sorted row i went to owner j(i), at offset i - start[j] of its buffer
  i = jnp.arange(A)
  owner = jnp.sum(i[:, None] >= jnp.cumsum(rt.sizes)[None], -1)  # (A,) d: dropped
  kept = owner < d
  owner = jnp.minimum(owner, d - 1)
  got = back[owner, jnp.clip(i - rt.starts[owner], 0, S - 1)]
  return jnp.where(kept[:, None], got, 0)
