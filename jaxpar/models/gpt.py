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

import functools
import math
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import ModelConfig
from jaxpar.models import blockwise, decoder, kvcache, moe, ring
from jaxpar.models.base import ModelDef
from jaxpar.models.segments import same as segments_same
from jaxpar.parallel import tensor
from jaxpar.parallel.context import StepContext
from jaxpar.parallel.mesh import CONTEXT
from jaxpar.parallel.rules import constrain, is_split


class Layers(nnx.Module):
  """The L decoder blocks' weights, stacked on a leading `layers` axis."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
    L, D, F, H, G, K = decoder.sizes(cfg)
    param = decoder.param_maker(rngs, dtype)
    normal = lambda std: nnx.initializers.normal(std)
    proj_std = 0.02 / math.sqrt(2 * L)  # GPT-2: residual projections scaled by depth
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
    if cfg.n_experts:  # a mixture of GELU experts, without biases (models/moe.py)
      for name, value in moe.make_params(cfg, param, glu=False, out_std=proj_std).items():
        setattr(self, name, value)
      if cfg.moe_every == 1:
        return
    L -= cfg.mixture_layers()  # the dense MLPs between the mixtures (decoder.in_groups)
    self.w1 = param((L, D, F), ("layers", "embed", "mlp"), normal(0.02))
    self.b1 = param((L, F), ("layers", "mlp"), zeros)
    self.w2 = param((L, F, D), ("layers", "mlp", "embed"), normal(proj_std))
    self.b2 = param((L, D), ("layers", "embed"), zeros)


DENSE = ("w1", "b1", "w2", "b2")  # the dense MLP's weights


class GPT(nnx.Module):
  """Token + position embeddings, L pre-norm blocks, final norm, LM head (or wte, when tied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.cfg = cfg
    V, T, D = cfg.padded_vocab(), cfg.seq_len, cfg.d_model  # V: with model.vocab_multiple's padding
    param, normal = decoder.param_maker(rngs, param_dtype), nnx.initializers.normal(0.02)
    self.wte = param((V, D), ("vocab", "embed"), normal)
    T = cfg.max_positions or T  # the position table may be longer than the training window
    self.wpe = param((T, D), (None, "embed"), normal)
    self.layers = Layers(cfg, rngs, param_dtype)
    self.lnf_scale = nnx.Param(jnp.ones((D,), param_dtype), out_sharding=("embed",))
    self.lnf_bias = nnx.Param(jnp.zeros((D,), param_dtype), out_sharding=("embed",))
    if not cfg.tie_embeddings:
      self.head = param((D, V), ("embed", "vocab"), normal)

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


@functools.cache
def attention_implementation(q_shape: tuple, kv_shape: tuple, dtype: str) -> tuple[str, str]:
  """(`implementation` for jax.nn.dot_product_attention, why) for q (B, T, H, K), k/v (B, T, G, K).

  'cudnn' (fused flash attention) on a GPU where it traces for these shapes, forward and
  backward: cuDNN present and recent enough, float16/bfloat16, head dim a multiple of 8 up to the
  GPU's limit. Else 'xla'. Decided once per shape, at trace time, with jax.eval_shape (nothing
  is compiled or run); refusals that only a compilation would show are not caught here.
  """
  if jax.default_backend() != "gpu":
    return "xla", f"{jax.default_backend()} backend"
  if dtype not in ("bfloat16", "float16"):
    return "xla", f"cuDNN flash attention needs float16 or bfloat16, not {dtype}"

  def loss(q, k, v):
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return o.astype(jnp.float32).sum()
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  except Exception as e:  # no cuDNN, too old, or this shape unsupported: XLA's is always there
    return "xla", f"cuDNN refused: {type(e).__name__}: {e}"
  return "cudnn", "cuDNN flash attention"


def _attention_matmuls(q, k, v, segments=None) -> jax.Array:
  """Causal attention as batched matmuls over (batch, kv head). q (B, T, H, K), k and v
  (B, T, G, K) -> (B, T, H, K); with `segments` (B, T) int (packed documents) a query sees only
  its own segment's keys.

  The R = H/G query heads of one kv head are stacked along the query axis, so a single
  (R*T, K) x (K, T) matmul per (batch, kv head) serves them all, with heads-first operands XLA
  need not transpose again. On XLA:CPU its forward and backward ran 1.5-2x faster than
  jax.nn.dot_product_attention's XLA form at T 128 (~15 vs ~25 ms a layer in the vs_pytorch
  shape); the sums are the same (masked logits, softmax, probabilities @ v), not the same rounding.
  """
  B, T, H, K = q.shape
  G = k.shape[2]
  R = H // G
  q = q.reshape(B, T, G, R, K).transpose(0, 2, 3, 1, 4).reshape(B, G, R * T, K)
  k = k.transpose(0, 2, 3, 1)  # (B, G, K, T)
  v = v.transpose(0, 2, 1, 3)  # (B, G, T, K)
  s = jnp.matmul(q, k) * (1.0 / math.sqrt(K))  # (B, G, R*T, T)
  causal = jnp.tile(jnp.tril(jnp.ones((T, T), bool)), (R, 1))  # (R*T, T): query t sees keys <= t
  if segments is not None:  # and only its own document's: (B, 1, R*T, T), as the scores are
    causal = causal & jnp.tile(segments_same(segments, segments), (1, R, 1))[:, None]
  # a large finite negative, as jax.nn.dot_product_attention masks: exp underflows to exactly 0
  s = jnp.where(causal, s, -0.7 * jnp.finfo(s.dtype).max)
  o = jnp.matmul(jax.nn.softmax(s, axis=-1), v)  # (B, G, R*T, K)
  return o.reshape(B, G, R, T, K).transpose(0, 3, 1, 2, 4).reshape(B, T, H, K)


# From this sequence length on, attention without cuDNN runs block by block (models/blockwise.py):
# its temporaries grow as T, not T^2. One layer's forward + backward on this 2-core CPU (fp32,
# 4 heads of 32, process CPU ms, least of 8), matmul form vs blockwise: T 128 batch 16 (the main
# job) 9.1 vs 11.5; T 256 batch 2 5.3 vs 5.9, batch 8 22.5 vs 16.4 (mixed); T 512 batch 2 21.6 vs
# 12.8, batch 8 144 vs 52; T 2048 batch 2 610 vs 168.
BLOCKWISE_MIN_SEQ = 512


def attention(q, k, v, segments=None) -> jax.Array:
  """Causal attention. q (B, T, H, K), k and v (B, T, G, K) -> (B, T, H, K) in q's dtype;
  `segments` (B, T) int: packed documents' segment ids, a query seeing only its own (None: one
  sequence per row, the program without them).

  On GPU, cuDNN's fused kernel where `attention_implementation` finds it usable. Otherwise
  `blockwise.attention` from T = BLOCKWISE_MIN_SEQ on, and below it `_attention_matmuls` on CPU,
  XLA's jax.nn.dot_product_attention elsewhere. XLA:CPU has no half-precision matmul with a
  float32 accumulator, so there float16 and bfloat16 attention runs in float32 and is cast back.
  With segments the fused cuDNN kernel is not used (jaxpar does not hand it segment ids): XLA's
  form with a (B, 1, T, T) mask, or blockwise from BLOCKWISE_MIN_SEQ on.
  """
  long = q.shape[1] >= BLOCKWISE_MIN_SEQ
  if jax.default_backend() == "cpu":
    f32 = lambda t: t.astype(jnp.float32)
    if long:
      return blockwise.attention(f32(q), f32(k), f32(v), segments=segments).astype(q.dtype)
    return _attention_matmuls(f32(q), f32(k), f32(v), segments).astype(q.dtype)
  if segments is not None:
    if long:
      return blockwise.attention(q, k, v, segments=segments)
    mask = segments_same(segments, segments)[:, None]  # (B, 1, T, T)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
  impl, _ = attention_implementation(tuple(q.shape), tuple(k.shape), jnp.dtype(q.dtype).name)
  if impl == "xla" and long:
    return blockwise.attention(q, k, v)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def attend(q, k, v, ctx: StepContext) -> jax.Array:
  """`attention`, or around the ring (models/ring.py; all-gathered with
  ctx.context_attention="allgather") where the step is manual over `context`: q, k, v are then
  this device's T/C tokens in the ring's order. XLA:CPU has no half-precision matmul with a
  float32 accumulator: there the ring runs in float32 too. `ctx.segments` (packed documents):
  each query sees only its own document's keys."""
  seg = None if ctx.segments is None else ctx.segments.ids
  if CONTEXT not in ctx.manual:
    return attention(q, k, v, seg)
  gather = ctx.context_attention == "allgather"
  if jax.default_backend() == "cpu":
    f32 = lambda t: t.astype(jnp.float32)
    return ring.ring_attention(f32(q), f32(k), f32(v), CONTEXT, gather, seg).astype(q.dtype)
  return ring.ring_attention(q, k, v, CONTEXT, gather, seg)


# What the backward keeps of a block besides its inputs and attention's own residuals: the
# residual stream after attention and the MLP's pre-activation. The norms and the GELU are
# recomputed from them (elementwise work; no matmul runs twice). Left to autodiff, the tanh GELU
# alone keeps six (B*T, F) intermediates per layer: the 4-layer d_model 256 benchmark step had
# 403 MB of XLA:CPU temporaries, freshly page-faulted on every step; with this, 183 MB.
# A mixture's block keeps moe.SAVED too: recomputing it would run its all-to-alls and the
# experts' matmuls a second time.
_KEEP = jax.checkpoint_policies.save_only_these_names("mid", "mlp_in", *moe.SAVED)
_NOTHING = jax.checkpoint_policies.nothing_saveable


def _qkv(p: dict, x: jax.Array, cfg: ModelConfig, manual) -> tuple[jax.Array, ...]:
  """Pre-norm and projections. x (B, T, D) -> q (B, T, H, K), k and v (B, T, G, K)."""
  B, T, D = x.shape
  H, G = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
  K = cfg.head_width()
  w = lambda name: p[name].astype(x.dtype)
  h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])  # split along seq under sequence parallel
  if is_split("heads"):
    R = H // G  # query heads per kv head
    # q, k and v in one matmul, grouped by kv head (column-parallel over heads): its transpose is
    # one partial sum, so the backward needs one all-reduce over `model`, not three.
    wqkv = jnp.concatenate([w("wq").reshape(D, G, R * K), w("wk").reshape(D, G, K),
                            w("wv").reshape(D, G, K)], axis=-1)  # (D, G, (R+2)K)
    qkv, = tensor.column_parallel(h, [wqkv], manual)
    qkv = qkv.reshape(B * T, G, (R + 2) * K)
    q = qkv[..., :R * K].reshape(B * T, H * K)
    k = qkv[..., R * K:(R + 1) * K].reshape(B * T, G * K)
    v = qkv[..., (R + 1) * K:].reshape(B * T, G * K)
  else:  # without tensor parallelism the joined weight would only cost a copy per layer
    q, k, v = (y.reshape(B * T, -1)
               for y in tensor.column_parallel(h, [w("wq"), w("wk"), w("wv")], manual))
  q = (q + w("bq")).reshape(B, T, H, K)
  k = k.reshape(B, T, G, K)
  v = (v + w("bv")).reshape(B, T, G, K)
  return constrain(q, ("batch", "seq", "heads", "kv"), manual=manual), k, v


def _out_mlp(p: dict, x: jax.Array, a: jax.Array, cfg: ModelConfig, manual, rate: float = 0.0,
             key=None) -> tuple[jax.Array, dict]:
  """Attention's out-projection, residual, pre-norm MLP (or mixture of experts), residual.
  x (B, T, D), a (B, T, H, K) -> (x, the mixture's metrics or {}). With a key, each branch's
  output is dropped out (`rate`) before it joins the residual."""
  B, T = x.shape[:2]
  w = lambda name: p[name].astype(x.dtype)
  a = tensor.row_parallel(a.reshape(B, T, -1), w("wo"), manual) + w("bo")
  x = checkpoint_name(x + decoder.dropout(a, rate, key, 0), "mid")
  if "router" in p:  # this layer's MLP is a mixture
    m, metrics = moe.mlp(p, layer_norm(x, p["ln2_scale"], p["ln2_bias"]), cfg, manual)
    return x + decoder.dropout(m, rate, key, 1), metrics
  h, = tensor.column_parallel(layer_norm(x, p["ln2_scale"], p["ln2_bias"]), [w("w1")], manual)
  h = jax.nn.gelu(checkpoint_name(h + w("b1"), "mlp_in"))  # (B, T, F)
  return x + decoder.dropout(tensor.row_parallel(h, w("w2"), manual) + w("b2"), rate, key, 1), {}


def block(p: dict, x: jax.Array, cfg: ModelConfig, ctx: StepContext = StepContext()) -> jax.Array:
  """One pre-norm decoder block. p: one layer's weights, whole; x (B, T, D) -> (B, T, D) in x's
  dtype (with a mixture of experts: (x, its metrics)); `ctx.manual` says which collectives the
  tensor-parallel matmuls run; `ctx.rng` (this layer's key, training only) turns on
  `cfg.dropout`'s residual dropout.

  The projections before attention and the MLP after it are checkpoints that keep only `_KEEP`'s
  names; attention, between them, keeps its own residuals, so neither cuDNN's fused kernel nor
  the softmax runs twice. prevent_cse=False: the block runs inside the layer scan, whose forward
  and backward are separate loops that XLA cannot merge anyway.
  """
  manual = ctx.manual
  q, k, v = jax.checkpoint(lambda p, x: _qkv(p, x, cfg, manual), policy=_NOTHING,
                           prevent_cse=False)(p, x)
  a = attend(q, k, v, ctx)  # (B, T, H, K)
  x, metrics = jax.checkpoint(lambda p, x, a, key: _out_mlp(p, x, a, cfg, manual, cfg.dropout, key),
                              policy=_KEEP, prevent_cse=False)(p, x, a, ctx.rng)
  return (x, metrics) if cfg.n_experts else x


def parts(cfg: ModelConfig) -> decoder.Parts:
  """The GPT's functions for decoder.py's scan, loss and pipeline."""
  head = lambda p, x: decoder.mask_padding(head_logits(p, x), cfg)
  if cfg.tie_embeddings:  # the LM head is the token embedding, transposed (GPT-2)
    head = lambda p, x: decoder.mask_padding(head_logits({**p, "head": p["wte"].T}, x), cfg)
  return decoder.in_groups(
      decoder.Parts(embed=embed, block=lambda p, x, ctx: block(p, x, cfg, ctx), head=head,
                    embed_at=embed_at, metrics=moe.metric_names(cfg)), cfg, DENSE)


def embed(p: dict, tokens: jax.Array, dtype) -> jax.Array:
  """tokens (B, T) -> x (B, T, D) in the compute dtype."""
  T = tokens.shape[1]
  x = jnp.take(p["wte"], tokens, axis=0) + p["wpe"][:T][None]
  return x.astype(dtype)


def head_logits(p: dict, x: jax.Array) -> jax.Array:
  """x (B, T, D) -> logits (B, T, V) in float32 (vocab-parallel head)."""
  logits, = tensor.column_parallel(layer_norm(x, p["lnf_scale"], p["lnf_bias"]),
                                   [p["head"].astype(x.dtype)])
  return logits.astype(jnp.float32)


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, ctx: StepContext = StepContext(),
            remat: str = "none") -> jax.Array:
  """tokens (B, T) int -> logits (B, T, V) float32 (decoder.forward)."""
  return decoder.forward(parts(cfg), params, tokens, ctx, remat)


def embed_at(p: dict, tokens: jax.Array, positions: jax.Array, dtype) -> jax.Array:
  """tokens (B, S) at positions (B, S) or (S,) -> x (B, S, D): `embed` for tokens anywhere in the
  window (a cache's, or a context-split sequence's)."""
  x = jnp.take(p["wte"], tokens, axis=0) + jnp.take(p["wpe"], positions, axis=0)
  return x.astype(dtype)


def block_cached(p: dict, x: jax.Array, positions: jax.Array, k_cache: jax.Array,
                 v_cache: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
  """`block` for new tokens x (B, S, D) at positions (B, S) that attend over one layer's cache
  k, v (B, T, G, K) -> (x, k, v), the new keys and values written at their positions.
  The same projections as `block` (no remat: nothing is differentiated here)."""
  q, k, v = _qkv(p, x, cfg, frozenset())
  k_cache = kvcache.write(k_cache, k, positions[:, 0])
  v_cache = kvcache.write(v_cache, v, positions[:, 0])
  a = kvcache.attend(q, k_cache, v_cache, positions)  # (B, S, H, K)
  return _out_mlp(p, x, a, cfg, frozenset())[0], k_cache, v_cache


def cached_parts(cfg: ModelConfig) -> kvcache.CachedParts:
  """The GPT's functions for incremental decoding (kvcache.extend)."""
  return decoder.in_groups(
      kvcache.CachedParts(embed=embed_at, head=parts(cfg).head,
                          block=lambda p, x, pos, k, v: block_cached(p, x, pos, k, v, cfg)),
      cfg, DENSE)


def n_params_nonembedding(cfg: ModelConfig) -> int:
  """Parameters outside the embeddings and LM head that a token uses (the N of 6N)."""
  D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
  G = cfg.n_kv_heads or cfg.n_heads
  K = cfg.head_width()
  n_moe = cfg.mixture_layers()
  mlp = n_moe * moe.n_params(cfg, glu=False, active=True) + (L - n_moe) * (2 * D * F + F + D)
  HK = cfg.n_heads * K  # = D unless model.head_dim decouples them
  per_layer = 2 * D * HK + 2 * D * G * K + HK + G * K + D + 4 * D
  return L * per_layer + mlp + 2 * D


MODULE = GPT


def model_def(cfg) -> ModelDef:
  """This decoder for `cfg` (models/decoder.py)."""
  return decoder.model_def(cfg, sys.modules[__name__])
