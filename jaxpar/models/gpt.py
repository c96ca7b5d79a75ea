"""GPT-2-style decoder: a Flax NNX module that owns the parameters and a pure forward over them.

The module creates every parameter with its logical axes; the layers are stacked on a leading
`layers` axis and run under one `lax.scan`, so compile time is flat in depth and the pipeline can
view the stack as `[stages, layers_per_stage, ...]`. The forward is a pure function of the
parameter tree so the trainer can gather ZeRO-3 shards per layer inside the scan.

Activations inside a block are 2-D `(B*T, D)` matrices: XLA lowers those to plain GEMMs, which
ran 1.6x faster on XLA:CPU than the same block written with 3-D einsums.
Letters: B batch, T seq, D embed, H heads, G kv heads, K head dim, F mlp, V vocab, L layers.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import zero
from jaxpar.config import ModelConfig
from jaxpar.models import decoder
from jaxpar.rules import constrain, is_split


class Layers(nnx.Module):
  """The L decoder blocks' weights, stacked on a leading `layers` axis."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
    L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
    H, G = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    K = D // H
    normal = lambda std: nnx.initializers.normal(std)
    proj_std = 0.02 / math.sqrt(2 * L)  # GPT-2: residual projections scaled by depth

    def param(shape, axes, init):
      return nnx.Param(init(rngs.params(), shape, dtype), sharding_names=axes)
    ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
    self.ln1_scale = param((L, D), ("layers", "embed"), ones)
    self.ln1_bias = param((L, D), ("layers", "embed"), zeros)
    self.wq = param((L, D, H * K), ("layers", "embed", "heads"), normal(0.02))
    self.wk = param((L, D, G * K), ("layers", "embed", "heads"), normal(0.02))
    self.wv = param((L, D, G * K), ("layers", "embed", "heads"), normal(0.02))
    # No key bias: it shifts every score of a query by the same amount, which softmax ignores, so
    # its gradient is exactly zero and Adam would only amplify rounding noise into it.
    self.bq = param((L, H * K), ("layers", "heads"), zeros)
    self.bv = param((L, G * K), ("layers", "heads"), zeros)
    self.wo = param((L, H * K, D), ("layers", "heads", "embed"), normal(proj_std))
    self.bo = param((L, D), ("layers", "embed"), zeros)
    self.ln2_scale = param((L, D), ("layers", "embed"), ones)
    self.ln2_bias = param((L, D), ("layers", "embed"), zeros)
    self.w1 = param((L, D, F), ("layers", "embed", "mlp"), normal(0.02))
    self.b1 = param((L, F), ("layers", "mlp"), zeros)
    self.w2 = param((L, F, D), ("layers", "mlp", "embed"), normal(proj_std))
    self.b2 = param((L, D), ("layers", "embed"), zeros)


class GPT(nnx.Module):
  """Token + position embeddings, L pre-norm blocks, final norm, LM head (or wte, when tied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.cfg = cfg
    V, T, D = cfg.vocab_size, cfg.seq_len, cfg.d_model
    normal = nnx.initializers.normal(0.02)
    self.wte = nnx.Param(normal(rngs.params(), (V, D), param_dtype), sharding_names=("vocab", "embed"))
    T = cfg.max_positions or T  # the position table may be longer than the training window
    self.wpe = nnx.Param(normal(rngs.params(), (T, D), param_dtype), sharding_names=(None, "embed"))
    self.layers = Layers(cfg, rngs, param_dtype)
    self.lnf_scale = nnx.Param(jnp.ones((D,), param_dtype), sharding_names=("embed",))
    self.lnf_bias = nnx.Param(jnp.zeros((D,), param_dtype), sharding_names=("embed",))
    if not cfg.tie_embeddings:
      self.head = nnx.Param(normal(rngs.params(), (D, V), param_dtype), sharding_names=("embed", "vocab"))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens (B, T) int -> logits (B, T, V) float32."""
    params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
    return forward(params, tokens, self.cfg)


def layer_norm(x, scale, bias, eps=1e-5):
  """LayerNorm over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def attention(q, k, v) -> jax.Array:
  """Causal attention. q (B, T, H, K), k and v (B, T, G, K) -> (B, T, H, K) in q's dtype.

  XLA:CPU has no float16 matmul with a float32 accumulator, so there float16 attention runs in
  float32 and is cast back; elsewhere float16 goes to the fused kernel as it is.
  """
  if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
    f32 = lambda t: t.astype(jnp.float32)
    return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True).astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def block(p: dict, x: jax.Array, cfg: ModelConfig, manual=frozenset()) -> jax.Array:
  """One pre-norm decoder block. p: one layer's weights; x (B, T, D) -> (B, T, D)."""
  B, T, D = x.shape
  H, G = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
  K = D // H
  dt = x.dtype
  w = lambda name: p[name].astype(dt)

  h = layer_norm(x, p["ln1_scale"], p["ln1_bias"]).reshape(B * T, D)  # (B*T, D)
  if is_split("heads"):
    R = H // G  # query heads per kv head
    # q, k and v in one matmul, grouped by kv head (column-parallel over heads): its transpose is
    # one partial sum, so the backward needs one all-reduce over `model`, not three.
    wqkv = jnp.concatenate([w("wq").reshape(D, G, R * K), w("wk").reshape(D, G, K),
                            w("wv").reshape(D, G, K)], axis=-1)  # (D, G, (R+2)K)
    qkv = jnp.einsum("nd,dgj->ngj", h, wqkv)  # (B*T, G, (R+2)K)
    q = qkv[..., :R * K].reshape(B * T, H * K)
    k = qkv[..., R * K:(R + 1) * K].reshape(B * T, G * K)
    v = qkv[..., (R + 1) * K:].reshape(B * T, G * K)
  else:  # without tensor parallelism the joined weight would only cost a copy per layer
    q, k, v = h @ w("wq"), h @ w("wk"), h @ w("wv")
  q = (q + w("bq")).reshape(B, T, H, K)
  k = k.reshape(B, T, G, K)
  v = (v + w("bv")).reshape(B, T, G, K)
  q = constrain(q, ("batch", "seq", "heads", "kv"), manual=manual)
  a = attention(q, k, v)  # (B, T, H, K)
  a = a.reshape(B * T, H * K) @ w("wo") + w("bo")  # row-parallel: all-reduce over model
  x = x + constrain(a.reshape(B, T, D), ("batch", "seq", "embed"), manual=manual)

  h = layer_norm(x, p["ln2_scale"], p["ln2_bias"]).reshape(B * T, D)
  h = jax.nn.gelu(h @ w("w1") + w("b1"))  # (B*T, F), column-parallel over mlp
  h = h @ w("w2") + w("b2")  # row-parallel
  return x + constrain(h.reshape(B, T, D), ("batch", "seq", "embed"), manual=manual)


def parts(cfg: ModelConfig) -> decoder.Parts:
  """The GPT's functions for decoder.py's scan, loss and pipeline."""
  head = head_logits
  if cfg.tie_embeddings:  # the LM head is the token embedding, transposed (GPT-2)
    head = lambda p, x: head_logits({**p, "head": p["wte"].T}, x)
  return decoder.Parts(embed=embed, block=lambda p, x, manual: block(p, x, cfg, manual), head=head)


def embed(p: dict, tokens: jax.Array, dtype) -> jax.Array:
  """tokens (B, T) -> x (B, T, D) in the compute dtype."""
  T = tokens.shape[1]
  x = jnp.take(p["wte"], tokens, axis=0) + p["wpe"][:T][None]
  return x.astype(dtype)


def head_logits(p: dict, x: jax.Array) -> jax.Array:
  """x (B, T, D) -> logits (B, T, V) in float32 (vocab-parallel head)."""
  B, T, D = x.shape
  h = layer_norm(x, p["lnf_scale"], p["lnf_bias"]).reshape(B * T, D)
  logits = h @ p["head"].astype(x.dtype)
  return logits.astype(jnp.float32).reshape(B, T, -1)


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, dtype=jnp.float32, dims: Any = None,
            remat: str = "none", manual=frozenset()) -> jax.Array:
  """tokens (B, T) int -> logits (B, T, V) float32 (decoder.forward)."""
  return decoder.forward(parts(cfg), params, tokens, dtype, dims, remat, manual)


def n_params_nonembedding(cfg: ModelConfig) -> int:
  """Parameters outside the embeddings and LM head (the N of 6N)."""
  D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
  G = cfg.n_kv_heads or cfg.n_heads
  K = D // cfg.n_heads
  per_layer = 2 * D * D + 2 * D * G * K + D + G * K + D + 2 * D * F + F + D + 4 * D
  return L * per_layer + 2 * D


MODULE = GPT
