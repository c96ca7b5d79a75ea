"""Packed documents: several documents in one row of a decoder's batch that never see each other.

A decoder batch may carry, beside `tokens` (B, T+1) int32:
- `segment_ids` (B, T+1) int32: 0 padding, 1, 2, ... the document each token belongs to within
  its row. Absent: one segment per row (the whole row one sequence).
- `loss_mask` (B, T+1) float32: loss_mask[b, t] weighs the prediction of tokens[b, t] (column 0
  is never predicted). Absent: 1.

From them, on the device: each token's position restarts at 0 where its document starts (column
0, and wherever the id changes), attention lets a query see only the keys of its own segment (and
causally), and the loss counts target t only where segment_ids[t] == segment_ids[t-1] != 0, times
loss_mask[t]: the mean over the counted tokens, their count reported as the `loss_weight` metric
(train/pieces.py's WEIGHT) so data shards, accumulated and pipeline microbatches and context
shares combine as one mean over every counted token of the batch. A batch without either key runs
today's program: nothing here is traced.
Letters: B batch, T seq.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# the loss's metric that weighs a batch's pieces (train/pieces.py's WEIGHT; models sit below train)
WEIGHT = "loss_weight"
KEYS = ("segment_ids", "loss_mask")  # a batch's optional packing leaves


class Segments(NamedTuple):
  """Which document each token of the activations belongs to, and its position in it."""
  ids: jax.Array  # (B, T) int32, 0 padding
  positions: jax.Array  # (B, T) int32, 0 at each document's first token


def positions(ids: jax.Array) -> jax.Array:
  """ids (..., T) int -> each token's position in its segment (..., T) int32: 0 at column 0 and
  wherever the id changes, counting on from there."""
  col = lax.broadcasted_iota(jnp.int32, ids.shape, ids.ndim - 1)
  start = jnp.concatenate([jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], -1)
  return col - lax.cummax(jnp.where(start, col, 0), axis=ids.ndim - 1)


def split(batch: dict) -> dict:
  """A decoder batch (leaves (..., T+1)) -> {'inputs', 'targets'} (..., T), and where it is packed
  'weights' (..., T) float32 (how much each target counts) and, with segment ids, 'segments' and
  'positions' (..., T) int32 of the inputs."""
  tokens = batch["tokens"]
  out = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
  if not any(k in batch for k in KEYS):
    return out
  seg, mask = batch.get("segment_ids"), batch.get("loss_mask")
  w = jnp.ones(out["targets"].shape, jnp.float32)
  if seg is not None:
    seg = seg.astype(jnp.int32)
    w = ((seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] != 0)).astype(jnp.float32)
    out["segments"] = seg[..., :-1]
    out["positions"] = positions(seg[..., :-1])
  if mask is not None:
    w = w * mask[..., 1:].astype(jnp.float32)
  out["weights"] = w
  return out


def of(pieces: dict) -> Segments | None:
  """The Segments of `split`'s pieces (or of a share or microbatch of them); None without ids."""
  if "segments" not in pieces:
    return None
  return Segments(pieces["segments"], pieces["positions"])


def same(q_ids: jax.Array, k_ids: jax.Array) -> jax.Array:
  """q_ids (B, Tq), k_ids (B, Tk) -> (B, Tq, Tk) bool: whether query and key share a segment."""
  return q_ids[:, :, None] == k_ids[:, None, :]
