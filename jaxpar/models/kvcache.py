"""Incremental decoding: a key/value cache for the decoders' layer stack, and the forward that
extends it by a few tokens at a time.

The cache holds, for every layer, the keys and values of the tokens seen so far at their
positions: k and v (L, B, T, G, K), stacked over layers like the parameters so one `lax.scan`
runs the stack, T = model.seq_len slots per row. It is split like the layer's kv heads (G over
`model`, as wk / wv's output columns are) and its rows over `data`; the layer axis is not split,
since the sampler runs the whole stack on every device.

Rows advance independently: each row's new tokens start at its own slot `start` (B,), which is
also their position (GPT's learned position row, Llama's rotary angle), so prompts of different
lengths need no padding on the left. A query at slot p attends slots 0..p of its row; slots past
p hold stale keys from padding or an earlier window and are masked out, never read.

A decoder supplies `CachedParts`: `embed` at explicit positions, `block` that writes its new
keys and values into one layer's cache and attends over it, and the usual `head`.
Letters: B batch, S new tokens, T cache slots (seq), H heads, G kv heads, K head dim, D embed,
L layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.models import stack
from jaxpar.parallel.rules import constrain

LAYER_AXES = ("batch", None, "heads", "kv")  # one layer's k or v (B, T, G, K)
STACK_AXES = (None,) + LAYER_AXES  # the stack (L, B, T, G, K): layers not split (see above)


@dataclass(frozen=True)
class CachedParts:
  """A decoder's functions for incremental decoding."""
  embed: Callable[..., jax.Array]  # (top, tokens (B, S), positions (B, S), dtype) -> x (B, S, D)
  block: Callable[..., tuple]  # (layer params, x (B, S, D), positions (B, S), k, v) -> (x, k, v)
  head: Callable[[dict, jax.Array], jax.Array]  # (top, x (B, S, D)) -> logits (B, S, V) float32
  every: int = 1  # layers per scan step, and how a step's layer j's weights are picked, as in
  pick: Callable[[dict, int], dict] | None = None  # stack.Parts (decoder.in_groups)


def empty(n_layers: int, batch: int, seq_len: int, kv_heads: int, head_dim: int,
          dtype) -> dict:
  """Zeros: {'k', 'v'} each (L, B, T, G, K), split as STACK_AXES say."""
  shape = (n_layers, batch, seq_len, kv_heads, head_dim)
  return {name: constrain(jnp.zeros(shape, dtype), STACK_AXES) for name in ("k", "v")}


def write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """One layer's cache (B, T, G, K) with new (B, S, G, K) written at slots start..start+S-1 of
  each row; start (B,) int."""
  put = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
  return constrain(jax.vmap(put)(cache, new, start), LAYER_AXES)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
  """Attention of new queries over one layer's cache. q (B, S, H, K) at positions (B, S);
  k and v (B, T, G, K), the new tokens' already written -> (B, S, H, K) in q's dtype.

  The same sums as gpt._attention_matmuls (R = H/G query heads stacked per kv head, masked
  logits, softmax, probabilities @ v), in float32, with the causal mask read from positions
  instead of the query's index: query at p sees slots <= p.
  """
  B, S, H, K = q.shape
  T, G = k.shape[1], k.shape[2]
  R = H // G
  f32 = lambda t: t.astype(jnp.float32)
  qg = f32(q).reshape(B, S, G, R, K).transpose(0, 2, 3, 1, 4).reshape(B, G, R * S, K)
  s = jnp.matmul(qg, f32(k).transpose(0, 2, 3, 1)) * (1.0 / math.sqrt(K))  # (B, G, R*S, T)
  seen = jnp.arange(T)[None, None, :] <= positions[:, :, None]  # (B, S, T)
  seen = jnp.tile(seen, (1, R, 1))[:, None]  # (B, 1, R*S, T), rows ordered as qg's
  s = jnp.where(seen, s, -0.7 * jnp.finfo(s.dtype).max)  # exp underflows to exactly 0
  o = jnp.matmul(jax.nn.softmax(s, axis=-1), f32(v).transpose(0, 2, 1, 3))  # (B, G, R*S, K)
  return o.reshape(B, G, R, S, K).transpose(0, 3, 1, 2, 4).reshape(B, S, H, K).astype(q.dtype)


def extend(parts: CachedParts, params: dict, cache: dict, tokens: jax.Array, start: jax.Array,
           dtype=jnp.float32) -> tuple[jax.Array, dict]:
  """Runs tokens (B, S) at slots start..start+S-1 of each row (start (B,)) through the stack,
  writing their keys and values -> (last hidden states x (B, S, D), the cache).

  The head is left to the caller: a sampler needs the logits of one position per row only.
  """
  S = tokens.shape[1]
  positions = start[:, None] + jnp.arange(S)[None, :]  # (B, S)
  top = {k: v for k, v in params.items() if k != "layers"}
  x = parts.embed(top, tokens, positions, dtype)

  if parts.every == 1:
    def body(x, layer):
      p, k, v = layer
      x, k, v = parts.block(p, x, positions, k, v)
      return x, (k, v)
    x, (k, v) = jax.lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
  else:  # groups of `every` layers, the cache (L, ...) viewed as (L/every, every, ...)
    E = parts.every
    layers, _, n = stack.groups(params["layers"], None, E)
    grouped = lambda c: c.reshape((n, E) + c.shape[1:])

    def body(x, group):
      p, ks, vs = group
      out_k, out_v = [], []
      for j in range(E):
        x, k, v = parts.block(parts.pick(p, j), x, positions, ks[j], vs[j])
        out_k.append(k)
        out_v.append(v)
      return x, (jnp.stack(out_k), jnp.stack(out_v))
    x, (k, v) = jax.lax.scan(body, x, (layers, grouped(cache["k"]), grouped(cache["v"])))
    k, v = k.reshape(cache["k"].shape), v.reshape(cache["v"].shape)
  return x, {"k": constrain(k, STACK_AXES), "v": constrain(v, STACK_AXES)}


def logits_at(parts: CachedParts, params: dict, x: jax.Array, index: jax.Array) -> jax.Array:
  """The logits of one position per row: x (B, S, D), index (B,) -> (B, V) float32."""
  top = {k: v for k, v in params.items() if k != "layers"}
  picked = jnp.take_along_axis(x, index[:, None, None], axis=1)  # (B, 1, D)
  return parts.head(top, picked)[:, 0]

