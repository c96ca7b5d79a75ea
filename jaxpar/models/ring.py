"""Ring attention: causal attention over a sequence split along a mesh axis (context parallelism).

Each of the C devices on the axis holds 2 of the sequence's 2C chunks, i and 2C-1-i (`balanced`):
under a causal mask the early chunks see few keys and the late ones many, so each device gets one
of each and the work is even. Keys and values travel around the ring (`ppermute`, C-1 hops);
each device folds every visiting key/value chunk into its two query chunks with the blockwise
online softmax (models/blockwise.py's fold/finish contract), skipping pairs the mask hides
wholly (`lax.cond`). The backward is its own ring: each device recomputes its pairs' scores from
the saved logsumexp (`fold_grad`), keeps its queries' gradient, and the keys' and values'
gradients travel with their chunk, C hops, back to the device that holds it.

What one device sends per attention call: forward, its k and v chunks C-1 times,
2 (C-1) x B x (T/C) x G x K x bytes; backward, as much again for k and v plus C times the same
for their gradients (float32). No device ever holds more than its own T/C queries and one
visiting T/C keys, and a chunk pair is folded one blockwise.BLOCK x BLOCK block pair at a time
(pairs the causal mask hides skipped): a device's scores are BLOCK x BLOCK, as one device's
blockwise attention holds, so its temporaries grow as T/C, not (T/C)^2.

The C - 1 hops are one `lax.scan` (forward and backward), so compile time does not grow with C
(one device's default-model step at T 4096 compiled in 5.5 / 6.2 / 6.0 s at C = 2 / 4 / 8, where
unrolled hops took 4.6 / 7.0 / 11.9 s) and the hops' buffers are one iteration's.

`ring_attention(..., gather=True)` is the all-gather form: the same folds in the same order, the
keys and values gathered at once (one all-gather each; the backward gathers again and
reduce-scatters their gradients), 6 (C - 1) x B x (T/C) x G x K x bytes sent per call where the
ring sends (6C - 4) x ..., C chunk pairs held where the ring holds one. Inside a pipeline stage's
branch of the schedule it is the form that runs: there only the stage's devices run the
collectives, which XLA:CPU's all-gathers and reduce-scatters allow and its collective-permutes
do not (they wait for every device of the program).

The trainer runs it on the mesh's `context` axis: the step's shard_map is manual over it, a
decoder's batch is laid out in the `balanced` order (`split_sequence`), embeddings, norms, MLPs
and the loss see each device's T/C tokens at their global positions (`local_positions`), and only
attention communicates. Called inside a shard_map that is manual over `axis`, with q
(B, T/C, H, K) and k, v (B, T/C, G, K) in the `balanced` order.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.models import blockwise as bw

F32 = jnp.float32


def balanced(T: int, C: int) -> np.ndarray:
  """The positions in the order the devices hold them: device i's T/C positions are chunk i then
  chunk 2C-1-i of 2C equal chunks. x[:, balanced(T, C)] lays a (B, T, ...) array out for the
  ring; x[:, np.argsort(balanced(T, C))] puts it back."""
  if T % (2 * C):
    raise ValueError(f"a sequence of {T} does not split into 2 x {C} equal chunks")
  c = T // (2 * C)
  chunk = lambda j: np.arange(j * c, (j + 1) * c)
  return np.concatenate([np.concatenate([chunk(i), chunk(2 * C - 1 - i)]) for i in range(C)])


def split_sequence(x: jax.Array, C: int) -> jax.Array:
  """x (B, T, ...) -> its positions in the ring's order (`balanced`): split over a context axis
  of C along axis 1, device i holds chunks i and 2C-1-i."""
  return x[:, balanced(x.shape[1], C)]


def local_positions(n: int, axis: str) -> jax.Array:
  """The global positions (n,) int32 of the n tokens this device holds on the ring `axis`
  (inside a shard_map manual over it): chunk i, then chunk 2C-1-i."""
  C, i = lax.axis_size(axis), lax.axis_index(axis)
  c = n // 2
  r = jnp.arange(c, dtype=jnp.int32)
  return jnp.concatenate([i * c + r, (2 * C - 1 - i) * c + r])


def _starts(i, C: int, c: int) -> tuple:
  """First positions of the two chunks device `i` holds."""
  return i * c, (2 * C - 1 - i) * c


def _shift(x, axis: str, C: int):
  """x from device j to device j+1 around the ring."""
  return lax.ppermute(x, axis, [(j, (j + 1) % C) for j in range(C)])


def _halves(x):
  """(B, G, [R,] 2c, K) -> its two chunks along the sequence axis (second to last)."""
  c = x.shape[-2] // 2
  return x[..., :c, :], x[..., c:, :]


def _kv_blocks(x, b: int):
  """A key or value chunk (B, G, c, K) -> (c/b, B, G, b, K): blocks on a leading axis."""
  B, G, c, K = x.shape
  return jnp.moveaxis(x.reshape(B, G, c // b, b, K), 2, 0)


def _q_blocks(x, b: int):
  """A query-side chunk (B, G, R, c, ...) -> (c/b, B, G, R, b, ...)."""
  B, G, R, c = x.shape[:4]
  return jnp.moveaxis(x.reshape(B, G, R, c // b, b, *x.shape[4:]), 3, 0)


def _q_unblocks(xb):
  """(n, B, G, R, b, ...) -> (B, G, R, n*b, ...): the inverse of `_q_blocks`."""
  n, B, G, R, b = xb.shape[:5]
  return jnp.moveaxis(xb, 0, 3).reshape(B, G, R, n * b, *xb.shape[5:])


def _block_size(c: int) -> int:
  """Positions per block within a chunk pair: blockwise's block where it divides the chunk."""
  return bw.BLOCK if c > bw.BLOCK and c % bw.BLOCK == 0 else c


def _seen(q_start, k_start, b: int, n: int):
  """How many of a key chunk's n blocks from k_start the query block of b positions from q_start
  sees: the keys at or before its last position, the later blocks wholly masked (never visited)."""
  return jnp.clip((q_start + b - 1 - k_start) // b + 1, 0, n)


def _seg_blocks(seg, b: int):
  """A chunk's segment ids (B, c) -> (c/b, B, b); None stays None."""
  if seg is None:
    return None
  B, c = seg.shape
  return jnp.moveaxis(seg.reshape(B, c // b, b), 1, 0)


def _seg_halves(seg):
  """Segment ids (B, 2c) -> its two chunks; None -> (None, None)."""
  if seg is None:
    return None, None
  c = seg.shape[1] // 2
  return seg[:, :c], seg[:, c:]


def _fold_chunk(state, q, k, v, q_start, k_start, scale: float, q_seg=None, k_seg=None):
  """`state` with the key/value chunk k, v (B, G, c, K) folded into the query chunk q
  (B, G, R, c, K), one (b x b) block pair at a time (b = `_block_size`), the pairs the causal
  mask hides never visited (a loop of `_seen` blocks): a device's scores are (B, G, R, b, b) at a
  time, as one device's blockwise attention holds, so its temporaries grow as its T/C. q_seg,
  k_seg (B, c): the chunks' segment ids (packed documents; None: one sequence)."""
  b = _block_size(k.shape[2])
  if b == k.shape[2]:
    return bw.fold(state, q, k, v, q_start, k_start, scale, q_seg, k_seg)
  kb, vb = _kv_blocks(k, b), _kv_blocks(v, b)
  qsb, ksb = _seg_blocks(q_seg, b), _seg_blocks(k_seg, b)

  def q_row(_, xs):
    i, q_i, st_i = xs
    qs_i = q_start + i * b

    step = lambda j, st: bw.fold(st, q_i, kb[j], vb[j], qs_i, k_start + j * b, scale,
                                 bw._at(qsb, i), bw._at(ksb, j))
    return None, lax.fori_loop(0, _seen(qs_i, k_start, b, kb.shape[0]), step, st_i)
  blocks = bw.State(*(_q_blocks(x, b) for x in state))
  _, out = lax.scan(q_row, None, (jnp.arange(kb.shape[0]), _q_blocks(q, b), blocks))
  return bw.State(*(_q_unblocks(x) for x in out))


def _grad_chunk(q, k, v, do, lse, delta, q_start, k_start, scale: float, q_seg=None, k_seg=None):
  """One chunk pair's (dq, dk, dv), float32 (blockwise.fold_grad), one (b x b) block pair at a
  time as in `_fold_chunk`."""
  b = _block_size(k.shape[2])
  if b == k.shape[2]:
    return bw.fold_grad(q, k, v, do, lse, delta, q_start, k_start, scale, q_seg, k_seg)
  kb, vb = _kv_blocks(k, b), _kv_blocks(v, b)
  qsb, ksb = _seg_blocks(q_seg, b), _seg_blocks(k_seg, b)
  n = kb.shape[0]

  def q_row(dkv, xs):
    i, q_i, do_i, lse_i, delta_i = xs
    qs_i = q_start + i * b

    def step(j, carry):
      dq_i, dk, dv = carry
      dq, dk_j, dv_j = bw.fold_grad(q_i, kb[j], vb[j], do_i, lse_i, delta_i, qs_i,
                                    k_start + j * b, scale, bw._at(qsb, i), bw._at(ksb, j))
      return dq_i + dq, dk.at[j].add(dk_j), dv.at[j].add(dv_j)
    dq_i = bw._zeros(q_i.shape, q_i, do_i, lse_i, delta_i, kb, vb)
    dq_i, dk, dv = lax.fori_loop(0, _seen(qs_i, k_start, b, n), step, (dq_i, *dkv))
    return (dk, dv), dq_i
  qb, dob = _q_blocks(q, b), _q_blocks(do, b)
  lseb, deltab = _q_blocks(lse, b), _q_blocks(delta, b)
  zeros_kv = bw._zeros(kb.shape, qb, kb, vb, dob, lseb, deltab)
  (dkb, dvb), dqb = lax.scan(q_row, (zeros_kv, zeros_kv), (jnp.arange(n), qb, dob, lseb, deltab))
  unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(k.shape)  # (n, B, G, b, K) -> (B, G, c, K)
  return _q_unblocks(dqb), unblock(dkb), unblock(dvb)


def _gathered(x, axis: str):
  """Every device's chunk pair of x (B, G, 2c, K) -> (C, B, G, 2c, K), device j's at [j]; None
  stays None."""
  return None if x is None else lax.all_gather(x, axis)


def _forward(q, k, v, seg, axis: str, gather: bool):
  C, i = lax.axis_size(axis), lax.axis_index(axis)
  G, K = k.shape[2], q.shape[3]
  c = q.shape[1] // 2
  scale = 1.0 / math.sqrt(K)
  qs = _halves(bw.grouped_q(q, G))  # 2 x (B, G, R, c, K)
  q_starts = _starts(i, C, c)

  q_segs = _seg_halves(seg)

  def fold_visiting(states, kg, vg, ks, s):  # device i - s's chunks, into both query chunks
    k_starts = _starts((i - s) % C, C, c)
    states = list(states)
    for b, (kb, vb, ksb) in enumerate(zip(_halves(kg), _halves(vg), _seg_halves(ks))):
      for a in range(2):
        fold = functools.partial(_fold_chunk, q=qs[a], k=kb, v=vb, q_start=q_starts[a],
                                 k_start=k_starts[b], scale=scale, q_seg=q_segs[a], k_seg=ksb)
        states[a] = lax.cond(bw.visible(q_starts[a], c, k_starts[b]),
                             lambda st, f=fold: f(st), lambda st: st, states[a])
    return tuple(states)

  kg, vg = bw.grouped_kv(k), bw.grouped_kv(v)  # (B, G, 2c, K)
  states = tuple(bw.init_state(qa, kg, vg) for qa in qs)
  if gather:  # all chunks at once, folded in the ring's order
    k_all, v_all, s_all = _gathered(kg, axis), _gathered(vg, axis), _gathered(seg, axis)

    def visit(states, s):
      j = (i - s) % C
      return fold_visiting(states, k_all[j], v_all[j], bw._at(s_all, j), s), None
    states, _ = lax.scan(visit, states, jnp.arange(C))
  else:
    def hop(carry, s):  # fold, then pass k and v (and their segment ids) on: one loop body
      states, kg, vg, ks = carry
      shift = lambda x: None if x is None else _shift(x, axis, C)
      return (fold_visiting(states, kg, vg, ks, s), shift(kg), shift(vg), shift(ks)), None

    (states, kg, vg, ks), _ = lax.scan(hop, (states, kg, vg, seg), jnp.arange(C - 1))
    states = fold_visiting(states, kg, vg, ks, C - 1)  # the last visitors go no further
  outs, lses = zip(*(bw.finish(st) for st in states))
  out = bw.ungrouped_q(jnp.concatenate(outs, axis=-2)).astype(q.dtype)
  return out, jnp.concatenate(lses, axis=-1)  # lse (B, G, R, 2c)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, gather: bool = False,
                   segments: jax.Array | None = None) -> jax.Array:
  """Causal attention of this device's queries over the whole ring's keys (see the module
  docstring); q (B, 2c, H, K), k and v (B, 2c, G, K) -> (B, 2c, H, K) in q's dtype.

  `gather`: the all-gather form. Every device gathers all keys and values at once (one
  all-gather each) and folds them in the ring's order; the backward gathers them again and
  reduce-scatters their gradients. It holds C chunk pairs of keys and values where the ring holds
  one, and its collectives are all-gathers and reduce-scatters, which may run where only some
  devices run them (inside a pipeline stage's branch), where the ring's permutes may not.

  `segments` (B, 2c) int: the segment ids of this device's tokens (packed documents,
  models/segments.py): a query sees only its own segment's keys. They travel around the ring
  with their keys (B x 2c int32 per hop), and each block pair makes its own mask from them."""
  return _ring(q, k, v, segments, axis, gather)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, seg, axis, gather):
  return _forward(q, k, v, seg, axis, gather)[0]


def _ring_fwd(q, k, v, seg, axis, gather):
  out, lse = _forward(q, k, v, seg, axis, gather)
  return out, (q, k, v, seg, out, lse)


def _ring_bwd(axis, gather, res, dout):
  q, k, v, seg, out, lse = res
  C, i = lax.axis_size(axis), lax.axis_index(axis)
  G, K = k.shape[2], q.shape[3]
  c = q.shape[1] // 2
  scale = 1.0 / math.sqrt(K)
  delta = (dout.astype(F32) * out.astype(F32)).sum(-1)  # (B, 2c, H)
  qs, dos = _halves(bw.grouped_q(q, G)), _halves(bw.grouped_q(dout, G))
  deltas = _halves(bw.grouped_q(delta[..., None], G)[..., 0][..., None])
  lses = _halves(lse[..., None])
  q_starts = _starts(i, C, c)
  q_segs = _seg_halves(seg)

  def grad_visiting(dqs, dk, dv, kg, vg, ks, s):  # device i - s's chunks' pairs; dk, dv theirs
    k_starts = _starts((i - s) % C, C, c)
    dqs, dk_parts, dv_parts = list(dqs), list(_halves(dk)), list(_halves(dv))
    for b, (kb, vb, ksb) in enumerate(zip(_halves(kg), _halves(vg), _seg_halves(ks))):
      for a in range(2):
        grad = functools.partial(_grad_chunk, qs[a], kb, vb, dos[a], lses[a][..., 0],
                                 deltas[a][..., 0], q_starts[a], k_starts[b], scale, q_segs[a],
                                 ksb)
        zeros = lambda a=a, b=b: (jnp.zeros_like(dqs[a]), jnp.zeros_like(dk_parts[b]),
                                  jnp.zeros_like(dv_parts[b]))
        dq_ab, dk_ab, dv_ab = lax.cond(bw.visible(q_starts[a], c, k_starts[b]), grad, zeros)
        dqs[a] = dqs[a] + dq_ab
        dk_parts[b], dv_parts[b] = dk_parts[b] + dk_ab, dv_parts[b] + dv_ab
    cat = lambda parts: jnp.concatenate(parts, axis=-2)
    return tuple(dqs), cat(dk_parts), cat(dv_parts)

  kg, vg = bw.grouped_kv(k), bw.grouped_kv(v)
  dqs = tuple(bw._zeros(qa.shape, qa, kg, dout) for qa in qs)
  dk = dv = bw._zeros(kg.shape, q, kg, dout)  # the ring's travel with their chunk
  if gather:  # every chunk pair's gradients here, each summed on its owner (reduce-scatter)
    k_all, v_all, s_all = _gathered(kg, axis), _gathered(vg, axis), _gathered(seg, axis)

    def visit(carry, s):
      dqs, dk_all, dv_all = carry
      j = (i - s) % C
      dqs, dk_j, dv_j = grad_visiting(dqs, dk, dv, k_all[j], v_all[j], bw._at(s_all, j), s)
      return (dqs, dk_all.at[j].set(dk_j), dv_all.at[j].set(dv_j)), None
    zeros_all = bw._zeros((C,) + dk.shape, q, kg, dout)
    (dqs, dk_all, dv_all), _ = lax.scan(visit, (dqs, zeros_all, zeros_all), jnp.arange(C))
    dk = lax.psum_scatter(dk_all, axis, scatter_dimension=0)
    dv = lax.psum_scatter(dv_all, axis, scatter_dimension=0)
  else:
    def hop(carry, s):
      dqs, dk, dv, kg, vg, ks = carry
      dqs, dk, dv = grad_visiting(dqs, dk, dv, kg, vg, ks, s)
      shift = lambda x: None if x is None else _shift(x, axis, C)
      return (dqs, shift(dk), shift(dv), shift(kg), shift(vg), shift(ks)), None

    (dqs, dk, dv, kg, vg, ks), _ = lax.scan(hop, (dqs, dk, dv, kg, vg, seg), jnp.arange(C - 1))
    dqs, dk, dv = grad_visiting(dqs, dk, dv, kg, vg, ks, C - 1)
    dk, dv = _shift(dk, axis, C), _shift(dv, axis, C)  # the C-th hop: home again
  dq = bw.ungrouped_q(jnp.concatenate(dqs, axis=-2))
  ungroup_kv = lambda x: x.transpose(0, 2, 1, 3)  # (B, G, 2c, K) -> (B, 2c, G, K)
  return (dq.astype(q.dtype), ungroup_kv(dk).astype(k.dtype), ungroup_kv(dv).astype(v.dtype),
          None)


_ring.defvjp(_ring_fwd, _ring_bwd)
