"""What jaxpar's decoders share: the layer scan, the forward, the loss, the pipeline form and the
way their stacked parameters are made.

A decoder (gpt.py, llama.py) supplies three pure functions over its parameter tree: `embed`
(tokens -> activations), `block` (one layer) and `head` (final norm + logits). What runs them
the same way for both lives here once: layers stacked on a leading `layers` axis under one
`lax.scan` (compile time flat in depth), ZeRO-3 shards all-gathered one layer at a time inside the
scan and again in the backward, and the pipeline schedule's stage / embed / loss functions. The
blocks' tensor-parallel matmuls are parallel/tensor.py's; the step's dtype, ZeRO-3 dims and manual
mesh axes arrive as one `StepContext` (parallel/context.py).
Letters: B batch, T seq, D embed, V vocab, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import precision
from jaxpar.models.base import ModelDef, from_nnx
from jaxpar.parallel import pipeline, zero
from jaxpar.parallel.context import StepContext
from jaxpar.parallel.rules import constrain


@dataclass(frozen=True)
class Parts:
  """A decoder's own functions; `top` is every parameter outside the layer stack."""
  embed: Callable[[dict, jax.Array, Any], jax.Array]  # (top, tokens (B, T), dtype) -> x (B, T, D)
  block: Callable[..., jax.Array]  # (one layer's params, x (B, T, D), ctx) -> x (B, T, D)
  head: Callable[[dict, jax.Array], jax.Array]  # (top, x (B, T, D)) -> logits (B, T, V) float32


# -- what both decoders' parameter stacks are built from ------------------------------------------

def sizes(cfg) -> tuple[int, int, int, int, int, int]:
  """A ModelConfig's (L, D, F, H, G, K): layers, embed, mlp, heads, kv heads, head dim."""
  H = cfg.n_heads
  return cfg.n_layers, cfg.d_model, cfg.d_ff, H, cfg.n_kv_heads or H, cfg.d_model // H


def param_maker(rngs, dtype) -> Callable:
  """param(shape, logical axes, init) -> an nnx.Param drawn from `rngs` in call order, its axes
  kept as the variable's sharding metadata (what jaxpar's partition rules read)."""
  def param(shape, axes, init):
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes)
  return param


def split(params: dict, dims: Any) -> tuple[dict, Any, Any]:
  """(top params, top ZeRO dims, layer-stack ZeRO dims); dims None = nothing sharded."""
  top = {k: v for k, v in params.items() if k != "layers"}
  if dims is None:
    return top, None, None
  return top, {k: v for k, v in dims.items() if k != "layers"}, dims["layers"]


REMAT = ("none", "full", "dots_saveable", "offload")


def remat_policy(remat: str):
  """`parallel.remat` -> the jax.checkpoint policy of one layer (None: save nothing but its input).

  dots_saveable keeps the weight matmuls' outputs and recomputes the rest (norms, activations,
  attention's score matmuls and softmax, whose (B, H, T, T) buffers dominate at long sequences);
  offload keeps the same outputs, but in host memory (`pinned_host`).
  Gathered ZeRO-3 weights are never dot outputs, so every policy re-gathers them in the backward.
  """
  return {"full": None, "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
          }[remat]


def run_layers(layers: dict, x: jax.Array, block: Callable[..., jax.Array],
               ctx: StepContext = StepContext(), remat: str = "none") -> jax.Array:
  """Scan `block` over a stack of layers. layers: leaves (L, ...); x (B, T, D).

  Each layer runs under `remat`'s checkpoint policy (`remat_policy`). `ctx.dims` are the ZeRO-3
  dims of the stacked leaves: each layer's shards are all-gathered inside the scan body and
  gathered again in the backward (`zero.regather` when nothing is rematerialised), so at most a
  layer or two is whole on a device at a time. The block gets `ctx` without dims: its weights
  arrive whole.
  """
  layer_dims = zero.shift(ctx.dims)
  layer_ctx = replace(ctx, dims=None)  # the block's weights arrive gathered

  def body(x, p):
    return block(zero.gather(p, layer_dims), x, layer_ctx), None
  if remat != "none":
    body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(remat))
  elif ctx.dims is not None:
    body = zero.regather(body)
  x, _ = jax.lax.scan(body, x, layers)
  return x


def forward(parts: Parts, params: dict, tokens: jax.Array, ctx: StepContext = StepContext(),
            remat: str = "none") -> jax.Array:
  """tokens (B, T) int -> logits (B, T, V) float32."""
  top, top_dims, layer_dims = split(params, ctx.dims)
  top = zero.gather(top, top_dims)
  x = parts.embed(top, tokens, ctx.dtype)
  x = run_layers(params["layers"], x, parts.block, replace(ctx, dims=layer_dims), remat)
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


def loss(parts: Parts, params: dict, batch: dict, ctx: StepContext = StepContext(),
         remat: str = "none") -> tuple[jax.Array, dict]:
  """batch['tokens'] (B, T+1) -> (mean next-token loss, {})."""
  tokens = batch["tokens"]
  logits = forward(parts, params, tokens[:, :-1], ctx, remat)
  return cross_entropy(logits, tokens[:, 1:], ctx.manual), {}


def pipeline_grads(parts: Parts, params: dict, micro: dict, sched,
                   ctx: StepContext = StepContext(), remat: str = "none", loss_scale=1.0,
                   forward_only=False):
  """Loss and gradients through the pipeline schedule `sched` (inside a shard_map over `pipeline`).

  params: this stage's layers (leaves [L/P, ...]) and the replicated embeddings / head;
  micro['tokens']: [M, b, T+1]. ZeRO-3 shards are gathered inside each use, so their gradients
  come back reduce-scattered. Gradients are of `loss_scale` times the loss; with `forward_only`
  (evaluation) there are none (None).
  """
  top, top_dims, layer_dims = split(params, ctx.dims)
  layer_ctx = replace(ctx, dims=layer_dims)

  # inputs and targets are sliced here, where every device runs, not in the per-stage branches:
  # XLA:CPU cannot run a collective (sequence parallel's seq-split shift) that only some run
  tokens = micro["tokens"]
  micro = {"inputs": tokens[:, :, :-1], "targets": tokens[:, :, 1:]}

  def embed_fn(t, mb):
    return parts.embed(zero.gather(t, top_dims), mb["inputs"], ctx.dtype)

  def stage_fn(layers, x):
    return run_layers(layers, x, parts.block, layer_ctx, remat)

  def loss_fn(t, x, mb):
    return cross_entropy(parts.head(zero.gather(t, top_dims), x), mb["targets"], ctx.manual)
  loss, g_layers, g_top = pipeline.execute(sched, params["layers"], top, micro, embed_fn, stage_fn,
                                           loss_fn, loss_scale, forward_only)
  if forward_only:
    return loss, {}, None
  return loss, {}, {**g_top, "layers": g_layers}


def model_def(cfg, module) -> ModelDef:
  """A decoder of `module` (models/gpt.py, models/llama.py: its MODULE, parts and parameter
  count) for `cfg`, in `precision.param_dtype`, each layer under `parallel.remat`'s policy:
  ZeRO-3 gathers one layer at a time inside the scan; the pipeline form runs any schedule."""
  param_dtype, remat = precision.param_dtype(cfg.precision), cfg.parallel.remat
  mc = cfg.model
  parts = module.parts(mc)
  base = from_nnx(lambda rngs: module.MODULE(mc, rngs=rngs, param_dtype=param_dtype),
                  loss_fn=lambda out, batch: (out, {}))

  def loss_(params, batch, ctx=StepContext(), rng=None):
    return loss(parts, params, batch, ctx, remat)

  def pipeline(params, micro, sched, ctx=StepContext(), loss_scale=1.0, forward_only=False):
    return pipeline_grads(parts, params, micro, sched, ctx, remat, loss_scale, forward_only)
  # DESIGN's model FLOPs per token: 6 N_nonembedding + 12 L D T (causal attention counted in full)
  flops_tok = 6 * module.n_params_nonembedding(mc) + 12 * mc.n_layers * mc.d_model * mc.seq_len
  return ModelDef(init=base.init, loss=loss_, logical=base.logical, abstract=base.abstract,
                  tokens_per_example=mc.seq_len, flops_per_example=flops_tok * mc.seq_len,
                  pipeline=pipeline)
