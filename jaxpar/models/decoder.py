"""What jaxpar's decoders share: the layer scan, the forward, the loss and the pipeline form.

A decoder (gpt.py, llama.py) supplies three pure functions over its parameter tree: `embed`
(tokens -> activations), `block` (one layer) and `head` (final norm + logits). Everything that
makes them parallel lives here once: layers stacked on a leading `layers` axis under one
`lax.scan` (compile time flat in depth), ZeRO-3 shards all-gathered one layer at a time inside the
scan and again in the backward, and the pipeline schedule's stage / embed / loss functions.
Letters: B batch, T seq, D embed, V vocab, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar import zero
from jaxpar.rules import constrain


@dataclass(frozen=True)
class Parts:
  """A decoder's own functions; `top` is every parameter outside the layer stack."""
  embed: Callable[[dict, jax.Array, Any], jax.Array]  # (top, tokens (B, T), dtype) -> x (B, T, D)
  block: Callable[..., jax.Array]  # (one layer's params, x (B, T, D), manual) -> x (B, T, D)
  head: Callable[[dict, jax.Array], jax.Array]  # (top, x (B, T, D)) -> logits (B, T, V) float32


def split(params: dict, dims: Any) -> tuple[dict, Any, Any]:
  """(top params, top ZeRO dims, layer-stack ZeRO dims); dims None = nothing sharded."""
  top = {k: v for k, v in params.items() if k != "layers"}
  if dims is None:
    return top, None, None
  return top, {k: v for k, v in dims.items() if k != "layers"}, dims["layers"]


REMAT = ("none", "full", "dots_saveable", "offload")


def remat_policy(remat: str):
  """`parallel.remat` -> the jax.checkpoint policy of one layer (None: save nothing but its input).

  dots_saveable keeps every matmul's output and recomputes the cheap rest (norms, activations,
  softmax); offload keeps the weight matmuls' outputs too, but in host memory (`pinned_host`).
  Gathered ZeRO-3 weights are never dot outputs, so every policy re-gathers them in the backward.
  """
  return {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable,
          "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
          }[remat]


def run_layers(layers: dict, x: jax.Array, block: Callable[..., jax.Array], dims: Any = None,
               remat: str = "none", manual=frozenset()) -> jax.Array:
  """Scan `block` over a stack of layers. layers: leaves (L, ...); x (B, T, D).

  Each layer runs under `remat`'s checkpoint policy (`remat_policy`). `dims` are the ZeRO-3 dims
  of the stacked leaves: each layer's shards are all-gathered inside the scan body and gathered
  again in the backward (`zero.regather` when nothing is rematerialised), so at most a layer or
  two is whole on a device at a time.
  """
  layer_dims = zero.shift(dims)

  def body(x, p):
    return block(zero.gather(p, layer_dims), x, manual), None
  if remat != "none":
    body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(remat))
  elif dims is not None:
    body = zero.regather(body)
  x, _ = jax.lax.scan(body, x, layers)
  return x


def forward(parts: Parts, params: dict, tokens: jax.Array, dtype=jnp.float32, dims: Any = None,
            remat: str = "none", manual=frozenset()) -> jax.Array:
  """tokens (B, T) int -> logits (B, T, V) float32."""
  top, top_dims, layer_dims = split(params, dims)
  top = zero.gather(top, top_dims)
  x = parts.embed(top, tokens, dtype)
  x = run_layers(params["layers"], x, parts.block, layer_dims, remat, manual)
  return parts.head(top, x)


def cross_entropy(logits: jax.Array, targets: jax.Array, manual=frozenset()) -> jax.Array:
  """Mean next-token loss, vocab-parallel. logits (B, T, V) float32, targets (B, T) int.

  The logits stay split over `vocab` (the head is column-parallel): the max, the sum of
  exponentials and the target's logit are each reduced over the vocabulary's shards, an
  all-reduce of (B, T) values over `model`, so no device ever holds a whole (B, T, V) buffer
  (Megatron's vocab-parallel cross-entropy, expressed as sharded reductions for GSPMD).
  """
  logits = constrain(logits, ("batch", "seq", "vocab"), manual=manual)
  top = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))  # (B, T, 1), for exp's range
  lse = jnp.log(jnp.sum(jnp.exp(logits - top), -1)) + top[..., 0]  # (B, T)
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), -1)  # (B, T)
  return jnp.mean(lse - picked)


def loss(parts: Parts, params: dict, batch: dict, dtype=jnp.float32, dims: Any = None,
         remat: str = "none", manual=frozenset()) -> tuple[jax.Array, dict]:
  """batch['tokens'] (B, T+1) -> (mean next-token loss, {})."""
  tokens = batch["tokens"]
  logits = forward(parts, params, tokens[:, :-1], dtype, dims, remat, manual)
  return cross_entropy(logits, tokens[:, 1:], manual), {}


def pipeline_grads(parts: Parts, params: dict, micro: dict, sched, dtype=jnp.float32,
                   dims: Any = None, remat: str = "none", manual=frozenset(), loss_scale=1.0,
                   forward_only=False):
  """Loss and gradients through the pipeline schedule `sched` (inside a shard_map over `pipeline`).

  params: this stage's layers (leaves [L/P, ...]) and the replicated embeddings / head;
  micro['tokens']: [M, b, T+1]. ZeRO-3 shards are gathered inside each use, so their gradients
  come back reduce-scattered. Gradients are of `loss_scale` times the loss; with `forward_only`
  (evaluation) there are none (None).
  """
  from jaxpar import pipeline
  top, top_dims, layer_dims = split(params, dims)

  def embed_fn(t, mb):
    return parts.embed(zero.gather(t, top_dims), mb["tokens"][:, :-1], dtype)

  def stage_fn(layers, x):
    return run_layers(layers, x, parts.block, layer_dims, remat, manual)

  def loss_fn(t, x, mb):
    return cross_entropy(parts.head(zero.gather(t, top_dims), x), mb["tokens"][:, 1:], manual)
  loss, g_layers, g_top = pipeline.execute(sched, params["layers"], top, micro, embed_fn, stage_fn,
                                           loss_fn, loss_scale, forward_only)
  if forward_only:
    return loss, {}, None
  return loss, {}, {**g_top, "layers": g_layers}
