"""Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention,
untied or tied LM head; optionally q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3). The
same parameter conventions as Hugging Face's LlamaForCausalLM (rotary on the two halves of each
head, `rotate_half`), so its checkpoints load without permutation.

Only the model's own pieces live here (parameters, `block`, `embed`, `head`); the layer scan,
ZeRO-3 gathers, loss and pipeline form are shared with the GPT in decoder.py.
Letters: B batch, T seq, D embed, H heads, G kv heads, K head dim, F mlp, V vocab, L layers.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models import decoder, kvcache, moe, ring
from jaxpar.models.base import ModelDef
from jaxpar.models.gpt import attend
from jaxpar.parallel import tensor
from jaxpar.parallel.context import StepContext
from jaxpar.parallel.mesh import CONTEXT
from jaxpar.parallel.rules import constrain


class Layers(nnx.Module):
  """The L decoder blocks' weights, stacked on a leading `layers` axis."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
    L, D, F, H, G, K = decoder.sizes(cfg)
    param = decoder.param_maker(rngs, dtype)
    normal, ones = nnx.initializers.normal(0.02), nnx.initializers.ones
    self.attn_norm = param((L, D), ("layers", "embed"), ones)
    self.wq = param((L, D, H * K), ("layers", "embed", "heads"), normal)
    self.wk = param((L, D, G * K), ("layers", "embed", "heads"), normal)
    self.wv = param((L, D, G * K), ("layers", "embed", "heads"), normal)
    self.wo = param((L, H * K, D), ("layers", "heads", "embed"), normal)
    if cfg.qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = param((L, H * K), ("layers", "heads"), zeros)
      self.bk = param((L, G * K), ("layers", "heads"), zeros)
      self.bv = param((L, G * K), ("layers", "heads"), zeros)
    if cfg.qk_norm:
      self.q_norm = param((L, K), ("layers", "kv"), ones)
      self.k_norm = param((L, K), ("layers", "kv"), ones)
    self.mlp_norm = param((L, D), ("layers", "embed"), ones)
    if cfg.n_experts:  # a mixture of SwiGLU experts (models/moe.py), Mixtral's
      for name, value in moe.make_params(cfg, param, glu=True, out_std=0.02).items():
        setattr(self, name, value)
      if cfg.moe_every == 1:
        return
    L -= cfg.mixture_layers()  # the dense MLPs between the mixtures (decoder.in_groups)
    self.w_gate = param((L, D, F), ("layers", "embed", "mlp"), normal)
    self.w_up = param((L, D, F), ("layers", "embed", "mlp"), normal)
    self.w_down = param((L, F, D), ("layers", "mlp", "embed"), normal)


DENSE = ("w_gate", "w_up", "w_down")  # the dense MLP's weights


class Llama(nnx.Module):
  """Token embedding, L pre-norm blocks, final RMSNorm, LM head (or the embedding, when tied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.cfg = cfg
    V, D = cfg.padded_vocab(), cfg.d_model  # V: with model.vocab_multiple's padding
    param, normal = decoder.param_maker(rngs, param_dtype), nnx.initializers.normal(0.02)
    self.wte = param((V, D), ("vocab", "embed"), normal)
    self.layers = Layers(cfg, rngs, param_dtype)
    self.norm = nnx.Param(jnp.ones((D,), param_dtype), out_sharding=("embed",))
    if not cfg.tie_embeddings:
      self.head = param((D, V), ("embed", "vocab"), normal)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * scale over the last axis, in float32, cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding of x (B, T, N, K): the pair (i, i + K/2) turns by pos / theta^(2i/K).
  pos is the index along T, or `positions` (B, T) int where the tokens sit elsewhere (a cache)."""
  T, K = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))  # (K/2,)
  if positions is None:
    angle = jnp.arange(T, dtype=jnp.float32)[None, :, None] * inv_freq  # (1, T, K/2)
  else:
    angle = positions.astype(jnp.float32)[:, :, None] * inv_freq  # (B, T, K/2)
  cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]  # (1 or B, T, 1, K/2)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _qkv(p: dict, x: jax.Array, cfg: ModelConfig, manual, positions=None) -> tuple[jax.Array, ...]:
  """Pre-norm, projections (+ biases), q/k norms, rotary. x (B, T, D) -> q (B, T, H, K), k and v
  (B, T, G, K)."""
  B, T, D = x.shape
  H, G = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
  K = cfg.head_width()
  w = lambda name: p[name].astype(x.dtype)
  h = rms_norm(x, p["attn_norm"], cfg.norm_eps)  # split along seq under sequence parallel
  q, k, v = tensor.column_parallel(h, [w("wq"), w("wk"), w("wv")], manual)  # over heads
  if cfg.qkv_bias:
    q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
  q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, G, K), v.reshape(B, T, G, K)
  if cfg.qk_norm:  # over each head's K, before the rotation
    q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
  q = rotary(q, cfg.rope_theta, positions)
  k = rotary(k, cfg.rope_theta, positions)
  return constrain(q, ("batch", "seq", "heads", "kv"), manual=manual), k, v


def _out_mlp(p: dict, x: jax.Array, a: jax.Array, cfg: ModelConfig, manual,
             key=None) -> tuple[jax.Array, dict]:
  """Attention's out-projection, residual, pre-norm SwiGLU MLP (or mixture of experts), residual.
  x (B, T, D), a (B, T, H, K) -> ((B, T, D), the mixture's metrics or {}). With a key, each
  branch's output is dropped out (`cfg.dropout`) before it joins the residual."""
  B, T = x.shape[:2]
  w = lambda name: p[name].astype(x.dtype)
  a = tensor.row_parallel(a.reshape(B, T, -1), w("wo"), manual)
  x = x + decoder.dropout(a, cfg.dropout, key, 0)
  h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  if "router" in p:  # this layer's MLP is a mixture
    m, metrics = moe.mlp(p, h, cfg, manual)
    return x + decoder.dropout(m, cfg.dropout, key, 1), metrics
  gate, up = tensor.column_parallel(h, [w("w_gate"), w("w_up")], manual)  # over mlp
  m = tensor.row_parallel(jax.nn.silu(gate) * up, w("w_down"), manual)
  return x + decoder.dropout(m, cfg.dropout, key, 1), {}


def block(p: dict, x: jax.Array, cfg: ModelConfig, ctx: StepContext = StepContext()) -> jax.Array:
  """One pre-norm Llama block. p: one layer's weights, whole; x (B, T, D) -> (B, T, D) in x's
  dtype (with a mixture of experts: (x, its metrics)); `ctx.manual` says which collectives the
  tensor-parallel matmuls run; `ctx.rng` (this layer's key, training only) turns on
  `cfg.dropout`'s residual dropout."""
  positions = None
  if ctx.segments is not None:  # packed documents: each one's positions restart at 0
    positions = ctx.segments.positions
  elif CONTEXT in ctx.manual:  # this device's tokens of a context-split sequence: their rotary
    positions = ring.local_positions(x.shape[1], CONTEXT)[None]  # angles are global positions
  q, k, v = _qkv(p, x, cfg, ctx.manual, positions)
  x, metrics = _out_mlp(p, x, attend(q, k, v, ctx), cfg, ctx.manual, ctx.rng)
  return (x, metrics) if cfg.n_experts else x


def block_cached(p: dict, x: jax.Array, positions: jax.Array, k_cache: jax.Array,
                 v_cache: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
  """`block` for new tokens x (B, S, D) at positions (B, S) (their rotary angles) that attend
  over one layer's cache k, v (B, T, G, K) -> (x, k, v), the new keys and values written."""
  q, k, v = _qkv(p, x, cfg, frozenset(), positions)
  k_cache = kvcache.write(k_cache, k, positions[:, 0])
  v_cache = kvcache.write(v_cache, v, positions[:, 0])
  a = kvcache.attend(q, k_cache, v_cache, positions)  # (B, S, H, K)
  return _out_mlp(p, x, a, cfg, frozenset())[0], k_cache, v_cache


def embed(p: dict, tokens: jax.Array, dtype) -> jax.Array:
  """tokens (B, T) -> x (B, T, D) in the compute dtype (positions enter through rotary)."""
  return jnp.take(p["wte"], tokens, axis=0).astype(dtype)


def parts(cfg: ModelConfig) -> decoder.Parts:
  """The Llama's functions for decoder.py's scan, loss and pipeline."""
  def head(p: dict, x: jax.Array) -> jax.Array:  # x (B, T, D) -> logits (B, T, V) float32
    w = p["wte"].T if cfg.tie_embeddings else p["head"]  # (D, V), vocab-parallel either way
    logits, = tensor.column_parallel(rms_norm(x, p["norm"], cfg.norm_eps), [w.astype(x.dtype)])
    return decoder.mask_padding(logits.astype(jnp.float32), cfg)
  return decoder.in_groups(
      decoder.Parts(embed=embed, block=lambda p, x, ctx: block(p, x, cfg, ctx), head=head,
                    metrics=moe.metric_names(cfg)), cfg, DENSE)


def cached_parts(cfg: ModelConfig) -> kvcache.CachedParts:
  """The Llama's functions for incremental decoding (kvcache.extend)."""
  return decoder.in_groups(
      kvcache.CachedParts(embed=lambda p, tokens, positions, dtype: embed(p, tokens, dtype),
                          head=parts(cfg).head,
                          block=lambda p, x, pos, k, v: block_cached(p, x, pos, k, v, cfg)),
      cfg, DENSE)


def n_params_nonembedding(cfg: ModelConfig) -> int:
  """Parameters outside the embedding and LM head that a token uses (the N of 6N)."""
  D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
  G = cfg.n_kv_heads or cfg.n_heads
  K = cfg.head_width()
  n_moe = cfg.mixture_layers()
  mlp = n_moe * moe.n_params(cfg, glu=True, active=True) + (L - n_moe) * 3 * D * F
  HK = cfg.n_heads * K  # = D unless model.head_dim decouples them
  attn_extra = (HK + 2 * G * K) * cfg.qkv_bias + 2 * K * cfg.qk_norm
  return L * (2 * D * HK + 2 * D * G * K + attn_extra + 2 * D) + mlp + D


MODULE = Llama


def model_def(cfg) -> ModelDef:
  """This decoder for `cfg` (models/decoder.py)."""
  return decoder.model_def(cfg, sys.modules[__name__])
