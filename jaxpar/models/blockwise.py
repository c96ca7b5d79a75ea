"""Causal attention block by block (flash attention's online softmax): no T x T score matrix is
ever held, so its temporaries grow linearly in T, where the matmul form's grow as T^2.

The sequence is cut into n = ceil(T/b) blocks of b positions. For each query block a loop folds
in the key/value blocks at or before it (blocks wholly above the diagonal are never visited),
keeping a running row max, row sum and unnormalised output; a custom VJP saves only (out,
logsumexp) besides the inputs, and its backward recomputes each block pair's scores from them.
Letters: B batch, T seq, H heads, G kv heads, R = H/G query heads per kv head, K head dim,
b block, n blocks.

The per-block contract, for a ring attention (context parallelism) that passes k/v blocks around
a mesh axis and folds each into the query block it holds:
- layout: a query block q (B, G, R, bq, K), a key or value block (B, G, bk, K) (the R query
  heads that share a kv head sit together; `grouped_q` and `grouped_kv` make it). Positions are
  absolute token indices; `q_start`/`k_start` are the first query's/key's (ints or traced
  scalars); a query at position p sees the keys at positions <= p.
- `init_state(q, k, v)` -> `State(acc, m, l)`: acc (B, G, R, bq, K) float32, the unnormalised
  output sum_j exp(s_j - m) v_j; m (B, G, R, bq) the row max of the scores folded so far (-inf
  before any); l (B, G, R, bq) the row sum of exp(s_j - m). k and v only lend their type: under
  shard_map the state varies over every manual axis its inputs vary over, as a loop carry must.
- `fold(state, q, k, v, q_start, k_start, scale, q_seg=None, k_seg=None)` -> State with one kv
  block folded in; the scores are scale * q k^T (scale 1/sqrt(K)). With the queries' and keys'
  segment ids q_seg (B, bq), k_seg (B, bk) (packed documents, models/segments.py) a query also
  sees only the keys of its own segment: the mask is made per block pair, never (T, T). Blocks
  may be folded in any order (the same sums, different rounding); a pair for which
  `visible(q_start, bq, k_start)` is false changes nothing and may be skipped (in a ring, under
  lax.cond).
- `finish(state)` -> (out (B, G, R, bq, K) float32, lse (B, G, R, bq)): out = acc / l and
  lse = m + log l, the row's logsumexp (+inf for a row that saw no key, so the backward's
  exp(s - lse) is 0 there and its out is 0).
- `fold_grad(q, k, v, do, lse, delta, q_start, k_start, scale, q_seg=None, k_seg=None)` ->
  (dq, dk, dv), float32, one
  pair's share of the gradients, with do the cotangent of out (B, G, R, bq, K), lse from
  `finish` and delta = sum(do * out, -1) (B, G, R, bq). The whole dq of a query block is the sum
  of its pairs' dq over the kv blocks; dk and dv of a kv block the sums over the query blocks
  (in a ring they travel with their block). Skippable pairs contribute zeros.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32

# Queries and keys per block. One layer's forward + backward at T 2048, batch 2, on this 2-core
# CPU (fp32, process CPU ms, least of 8) at b = 64 / 128 / 256 / 512: 145 / 168 / 187 / 296 with
# 4 heads of 32, 674 / 572 / 685 / - with 8 heads of 64. Smaller blocks keep a pair's scores
# (B, H, b, b) in cache; the loops' overhead grows as (T/b)^2. A block's temporaries do not
# depend on T.
BLOCK = 128


class State(NamedTuple):
  """The running sums of one query block's online softmax (see the module docstring)."""
  acc: jax.Array  # (B, G, R, bq, K) float32
  m: jax.Array  # (B, G, R, bq) float32
  l: jax.Array  # (B, G, R, bq) float32


def grouped_q(q: jax.Array, G: int) -> jax.Array:
  """q (B, T, H, K) -> the query layout (B, G, R, T, K), R = H / G query heads per kv head."""
  B, T, H, K = q.shape
  return q.reshape(B, T, G, H // G, K).transpose(0, 2, 3, 1, 4)


def grouped_kv(k: jax.Array) -> jax.Array:
  """k or v (B, T, G, K) -> the key/value layout (B, G, T, K)."""
  return k.transpose(0, 2, 1, 3)


def ungrouped_q(o: jax.Array) -> jax.Array:
  """(B, G, R, T, K) -> (B, T, H, K): the inverse of `grouped_q`."""
  B, G, R, T, K = o.shape
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, G * R, K)


def visible(q_start, bq: int, k_start) -> jax.Array | bool:
  """Whether a query block of bq positions from q_start sees any key of the block from k_start."""
  return k_start <= q_start + bq - 1


def _zeros(shape, *like) -> jax.Array:
  """float32 zeros of `shape`, varying over the manual mesh axes that any of `like` varies over:
  inside shard_map a loop's initial carry must have the type of the carry its body returns."""
  anchor = sum(jnp.zeros_like(x[(0,) * x.ndim], F32) for x in like)  # a scalar
  return jnp.broadcast_to(anchor, shape)


def init_state(q: jax.Array, *like: jax.Array) -> State:
  """The state before any key: q (B, G, R, bq, K); `like`: the k and v blocks to be folded
  (under shard_map the state varies over their manual axes too)."""
  zeros = _zeros(q.shape[:-1], q, *like)  # (B, G, R, bq)
  return State(_zeros(q.shape, q, *like), zeros - jnp.inf, zeros)


def _scores(q, k, q_start, k_start, scale, q_seg=None, k_seg=None):
  """Scaled scores (B, G, R, bq, bk) float32 and the mask of one block pair: causal (bq, bk), and
  with segment ids q_seg (B, bq), k_seg (B, bk) within a segment too (B, 1, 1, bq, bk)."""
  B, G, R, bq, K = q.shape
  bk = k.shape[2]
  s = jnp.matmul(q.reshape(B, G, R * bq, K), jnp.swapaxes(k, 2, 3),
                 preferred_element_type=F32)  # (B, G, R*bq, bk)
  s = s.reshape(B, G, R, bq, bk) * scale
  q_pos = q_start + lax.iota(jnp.int32, bq)
  k_pos = k_start + lax.iota(jnp.int32, bk)
  mask = q_pos[:, None] >= k_pos[None, :]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
  return s, mask


def _pv(p, v):
  """p (B, G, R, bq, bk) @ v (B, G, bk, K) -> (B, G, R, bq, K) float32."""
  B, G, R, bq, bk = p.shape
  o = jnp.matmul(p.reshape(B, G, R * bq, bk).astype(v.dtype), v, preferred_element_type=F32)
  return o.reshape(B, G, R, bq, v.shape[-1])


def fold(state: State, q, k, v, q_start, k_start, scale: float, q_seg=None, k_seg=None) -> State:
  """`state` with the key/value block k, v (B, G, bk, K) from k_start folded in; q (B, G, R, bq, K)
  from q_start; q_seg (B, bq), k_seg (B, bk): their segment ids (None: one sequence)."""
  s, mask = _scores(q, k, q_start, k_start, scale, q_seg, k_seg)
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.maximum(state.m, s.max(-1))  # (B, G, R, bq)
  # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp() at 0, not NaN.
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m_safe[..., None])  # (B, G, R, bq, bk)
  rescale = jnp.exp(state.m - m_safe)  # what was summed under the old max, moved to the new one
  return State(rescale[..., None] * state.acc + _pv(p, v), m, rescale * state.l + p.sum(-1))


def finish(state: State) -> tuple[jax.Array, jax.Array]:
  """(out (B, G, R, bq, K) float32, lse (B, G, R, bq)) of a query block's folded state."""
  seen = state.l > 0
  l = jnp.where(seen, state.l, 1.0)
  return state.acc / l[..., None], jnp.where(seen, state.m + jnp.log(l), jnp.inf)


def fold_grad(q, k, v, do, lse, delta, q_start, k_start, scale: float, q_seg=None, k_seg=None):
  """One block pair's (dq (B, G, R, bq, K), dk (B, G, bk, K), dv (B, G, bk, K)), float32, from
  the pair's scores recomputed against the saved lse; do (B, G, R, bq, K), delta (B, G, R, bq)."""
  B, G, R, bq, K = q.shape
  s, mask = _scores(q, k, q_start, k_start, scale, q_seg, k_seg)
  p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # (B, G, R, bq, bk): the probabilities
  rows = lambda x: x.reshape(B, G, R * bq, x.shape[-1])  # the R heads' rows stacked
  do_r = rows(do).astype(v.dtype)
  dv = jnp.matmul(jnp.swapaxes(rows(p), 2, 3).astype(v.dtype), do_r,
                  preferred_element_type=F32)  # (B, G, bk, K)
  dp = jnp.matmul(do_r, jnp.swapaxes(v, 2, 3), preferred_element_type=F32)  # (B, G, R*bq, bk)
  ds = rows(p) * (dp - rows(delta[..., None])) * scale  # softmax's backward, then the scale
  dq = jnp.matmul(ds.astype(k.dtype), k, preferred_element_type=F32)  # (B, G, R*bq, K)
  dk = jnp.matmul(jnp.swapaxes(ds, 2, 3).astype(q.dtype), rows(q),
                  preferred_element_type=F32)  # (B, G, bk, K)
  return dq.reshape(B, G, R, bq, K), dk, dv


def _pad(x, b: int):
  """x (B, T, ...) zero-padded along T to a multiple of b."""
  T = x.shape[1]
  return jnp.pad(x, [(0, 0), (0, -T % b)] + [(0, 0)] * (x.ndim - 2))


def _blocked_q(x, G: int, b: int):
  """x (B, T, H, ...) -> (n, B, G, R, b, ...): query blocks on a leading axis."""
  x = grouped_q(_pad(x, b), G)  # (B, G, R, n*b, ...)
  B, _, R, nb = x.shape[:4]
  return jnp.moveaxis(x.reshape(B, G, R, nb // b, b, *x.shape[4:]), 3, 0)


def _blocked_kv(x, b: int):
  """k or v (B, T, G, K) -> (n, B, G, b, K). Padding keys sit after every real query, so no real
  query sees them."""
  x = grouped_kv(_pad(x, b))  # (B, G, n*b, K)
  B, G, nb, K = x.shape
  return jnp.moveaxis(x.reshape(B, G, nb // b, b, K), 2, 0)


def _unblocked_q(xb, T: int):
  """(n, B, G, R, b, K) -> (B, T, H, K) without the padding: the inverse of `_blocked_q`."""
  n, B, G, R, b, K = xb.shape
  return ungrouped_q(jnp.moveaxis(xb, 0, 3).reshape(B, G, R, n * b, K)[:, :, :, :T])


def _unblocked_kv(xb, T: int):
  """(n, B, G, b, K) -> (B, T, G, K) without the padding: the inverse of `_blocked_kv`."""
  n, B, G, b, K = xb.shape
  return jnp.moveaxis(xb, 0, 2).reshape(B, G, n * b, K)[:, :, :T].transpose(0, 2, 1, 3)


def _blocked_seg(seg, b: int):
  """Segment ids (B, T) -> (n, B, b), the blocks of `_blocked_q`'s and `_blocked_kv`'s positions;
  None stays None."""
  if seg is None:
    return None
  x = _pad(seg, b)
  return jnp.moveaxis(x.reshape(x.shape[0], -1, b), 1, 0)


def _at(segb, j):
  """Block j of `_blocked_seg`'s blocks (None: None)."""
  return None if segb is None else segb[j]


def _forward(q, k, v, seg, block: int):
  """(out (B, T, H, K) in q's dtype, lse (n, B, G, R, b))."""
  T, K = q.shape[1], q.shape[3]
  b = min(block, T)
  scale = 1.0 / math.sqrt(K)
  G = k.shape[2]
  qb, kb, vb = _blocked_q(q, G, b), _blocked_kv(k, b), _blocked_kv(v, b)
  segb = _blocked_seg(seg, b)

  def row(_, xs):
    i, q_i = xs  # q_i (B, G, R, b, K)
    step = lambda j, st: fold(st, q_i, kb[j], vb[j], i * b, j * b, scale, _at(segb, i),
                              _at(segb, j))
    # only kv blocks 0..i: the ones after the diagonal are wholly masked
    return None, finish(lax.fori_loop(0, i + 1, step, init_state(q_i, kb, vb)))

  _, (ob, lse) = lax.scan(row, None, (jnp.arange(qb.shape[0]), qb))
  return _unblocked_q(ob, T).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, seg, block):
  return _forward(q, k, v, seg, block)[0]


def _attention_fwd(q, k, v, seg, block):
  out, lse = _forward(q, k, v, seg, block)
  return out, (q, k, v, seg, out, lse)


def _attention_bwd(block, res, dout):
  q, k, v, seg, out, lse = res
  T, G, K = q.shape[1], k.shape[2], q.shape[3]
  b = min(block, T)
  scale = 1.0 / math.sqrt(K)
  delta = (dout.astype(F32) * out.astype(F32)).sum(-1)  # (B, T, H)
  qb, kb, vb = _blocked_q(q, G, b), _blocked_kv(k, b), _blocked_kv(v, b)
  dob = _blocked_q(dout, G, b)  # (n, B, G, R, b, K)
  deltab = _blocked_q(delta[..., None], G, b)[..., 0]  # (n, B, G, R, b)
  segb = _blocked_seg(seg, b)

  def row(dkv, xs):
    i, q_i, do_i, lse_i, delta_i = xs

    def step(j, carry):
      dq_i, dk, dv = carry
      dq, dk_j, dv_j = fold_grad(q_i, kb[j], vb[j], do_i, lse_i, delta_i, i * b, j * b, scale,
                                 _at(segb, i), _at(segb, j))
      return dq_i + dq, dk.at[j].add(dk_j), dv.at[j].add(dv_j)

    dq_i = _zeros(q_i.shape, q_i, do_i, lse_i, delta_i, kb, vb)
    dq_i, dk, dv = lax.fori_loop(0, i + 1, step, (dq_i, *dkv))
    return (dk, dv), dq_i

  zeros_kv = _zeros(kb.shape, qb, kb, vb, dob, lse, deltab)  # (n, B, G, b, K)
  (dkb, dvb), dqb = lax.scan(row, (zeros_kv, zeros_kv),
                             (jnp.arange(qb.shape[0]), qb, dob, lse, deltab))
  return (_unblocked_q(dqb, T).astype(q.dtype), _unblocked_kv(dkb, T).astype(k.dtype),
          _unblocked_kv(dvb, T).astype(v.dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = BLOCK,
              segments: jax.Array | None = None) -> jax.Array:
  """Causal attention. q (B, T, H, K), k and v (B, T, G, K), H a multiple of G -> (B, T, H, K) in
  q's dtype; any T (the last block is padded). Scores and sums in float32. `segments` (B, T) int:
  each token's segment id (packed documents): a query sees only its own segment's keys, the mask
  made block pair by block pair."""
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
  return _attention(q, k, v, segments, int(block))
