"""What jaxpar's decoders share: the next-token loss, the pipeline form and the way their stacked
parameters are made.

A decoder (gpt.py, llama.py) supplies three pure functions over its parameter tree (`Parts`):
`embed` (tokens -> activations), `block` (one layer) and `head` (final norm + logits). They run
as any stack of identical blocks does (stack.py, shared with a user's `from_stack`): layers on a
leading `layers` axis under one `lax.scan` (compile time flat in depth), ZeRO-3 shards all-gathered
one layer at a time inside the scan and again in the backward, and the pipeline schedule's stage /
embed / loss functions. What is a decoder's own lives here: tokens in, vocab-parallel
cross-entropy out. The blocks' tensor-parallel matmuls are parallel/tensor.py's; the step's dtype,
ZeRO-3 dims and manual mesh axes arrive as one `StepContext` (parallel/context.py).
Letters: B batch, T seq, D embed, V vocab, L layers.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ConfigError
from jaxpar.models import lora, moe, precision, ring, segments, stack
from jaxpar.models.base import ModelDef, from_nnx
from jaxpar.models.stack import Parts
from jaxpar.parallel.context import StepContext
from jaxpar.parallel.mesh import CONTEXT
from jaxpar.parallel.rules import constrain

# -- what both decoders' parameter stacks are built from ------------------------------------------

def sizes(cfg) -> tuple[int, int, int, int, int, int]:
  """A ModelConfig's (L, D, F, H, G, K): layers, embed, mlp, heads, kv heads, head dim."""
  H = cfg.n_heads
  return cfg.n_layers, cfg.d_model, cfg.d_ff, H, cfg.n_kv_heads or H, cfg.head_width()


def param_maker(rngs, dtype) -> Callable:
  """param(shape, logical axes, init) -> an nnx.Param drawn from `rngs` in call order, its axes
  kept as the variable's sharding metadata (what jaxpar's partition rules read)."""
  def param(shape, axes, init):
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes)
  return param


def in_groups(parts, cfg, dense: tuple[str, ...]):
  """`parts` (Parts or kvcache.CachedParts) whose stack runs in groups of model.moe_every
  layers, the last of each a mixture, where moe_every > 1; `parts` itself otherwise.

  The stack then keeps each kind of weight once per layer that has it: attention's and the
  norms' (L, ...), the dense MLP's (`dense`, its names) (L - L/k, ...), the mixture's
  (moe.PARAMS) (L/k, ...). Cut into groups (stack.groups), layer j of a group takes the j-th
  row of its attention and norms, and the j-th of its dense MLPs or (j = k - 1) its mixture."""
  k = cfg.moe_every
  if not cfg.n_experts or k == 1:
    return parts

  def pick(p: dict, j: int) -> dict:  # (a weight's LoRA adapters go with it: lora.base_name)
    skip = dense if j == k - 1 else moe.PARAMS  # the mixture's layer has no dense MLP, and back
    return {name: v[0] if lora.base_name(name) in moe.PARAMS else v[j] for name, v in p.items()
            if lora.base_name(name) not in skip}
  return replace(parts, every=k, pick=pick)


def dropout(x: jax.Array, rate: float, key, which: int) -> jax.Array:
  """GPT-2's residual dropout of x (B, T, D): each element kept with probability 1 - rate and
  scaled by 1 / (1 - rate), the mask drawn from fold_in(key, which); x itself without a key.

  `key` is the step's key for the rows x holds (models/base.py's at_rows, folded with the layer),
  and the draw has x's leading batch axis, so row r gets the bits of global row r on any split of
  the batch; the bits are counter-based (iota and threefry per element), so a draw split over
  `model` (sequence parallelism) is the same draw.
  """
  if key is None or rate == 0:
    return x
  keep = jax.random.bernoulli(jax.random.fold_in(key, which), 1.0 - rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def forward(parts: Parts, params: dict, tokens: jax.Array, ctx: StepContext = StepContext(),
            remat: str = "none", segment_ids: jax.Array | None = None) -> jax.Array:
  """tokens (B, T) int -> logits (B, T, V) float32; `segment_ids` (B, T) int: packed documents
  (models/segments.py), each at positions from 0 and seeing only itself."""
  if segment_ids is None:
    return stack.forward(parts, params, tokens, ctx, remat)
  seg = segments.Segments(segment_ids, segments.positions(segment_ids))
  return stack.forward(_positioned(parts, tokens.shape[1], ctx, seg), params, tokens,
                       replace(ctx, segments=seg), remat)


def mask_padding(logits: jax.Array, cfg) -> jax.Array:
  """logits (B, T, Vp) float32 with the vocabulary's padding (model.vocab_multiple: columns from
  vocab_size on) at -inf, so the softmax, the loss and sampling never see it; logits unchanged
  without padding. The iota is the global column, so a vocab-split head masks the same columns."""
  if logits.shape[-1] == cfg.vocab_size:
    return logits
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(vocab < cfg.vocab_size, logits, -jnp.inf)


def padding_params(abstract, cfg) -> int:
  """How many of the parameters in `abstract` are the vocabulary's padding (model.vocab_multiple):
  the embedding's extra rows and an untied head's extra columns, which count as no parameters."""
  flat = abstract if isinstance(abstract, dict) else {}
  extra = cfg.padded_vocab() - cfg.vocab_size
  if not extra or cfg.kind not in ("gpt", "llama"):
    return 0
  return sum(extra * int(flat[name].shape[1 - i]) for i, name in enumerate(("wte", "head"))
             if name in flat and flat[name].shape[i] == cfg.padded_vocab())


def cross_entropy(logits: jax.Array, targets: jax.Array, manual=frozenset()) -> jax.Array:
  """Mean next-token loss, vocab-parallel. logits (B, T, V) float32, targets (B, T) int.

  The logits stay split over `vocab` (the head is column-parallel): the max, the sum of
  exponentials and the target's logit are each reduced over the vocabulary's shards, an
  all-reduce of (B, T) values over `model`, so no device ever holds a whole (B, T, V) buffer
  (Megatron's vocab-parallel cross-entropy, expressed as sharded reductions for GSPMD).
  """
  return jnp.mean(token_losses(logits, targets, manual))


def token_losses(logits: jax.Array, targets: jax.Array, manual=frozenset()) -> jax.Array:
  """`cross_entropy`'s loss of each token (B, T) float32, before the mean."""
  logits = constrain(logits, ("batch", "seq", "vocab"), manual=manual)
  top = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))  # (B, T, 1), for exp's range
  lse = jnp.log(jnp.sum(jnp.exp(logits - top), -1)) + top[..., 0]  # (B, T)
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), -1)  # (B, T)
  return lse - picked


def share_weights(weights: jax.Array, manual=frozenset(), pieces: int = 1):
  """A packed batch's target weights (..., T) -> (weights scaled so that a mean over `pieces`
  equal pieces and over the context shares of sum(token loss x scaled weight) is the weighted
  mean over all of them, their total count (the WEIGHT metric)). The count is summed over
  `context` where the step is manual over it (the shares' counts differ), so each share's
  gradient is already of its part of the one mean the step averages the shares into."""
  n = jnp.sum(weights)
  C = 1
  if CONTEXT in manual:
    n, C = jax.lax.psum(n, CONTEXT), jax.lax.axis_size(CONTEXT)
  # a piece with nothing counted stays finite (train/pieces.py's `weighed`)
  return weights * (pieces * C / jnp.maximum(n, 1.0)), n


def with_embed_dropout(parts: Parts, rate: float, key, n_layers: int) -> Parts:
  """`parts` whose embedding output is dropped out with fold_in(key, n_layers), a key no layer
  gets (layer i folds in i); `parts` itself without a key."""
  if key is None or rate == 0:
    return parts
  key = jax.random.fold_in(key, n_layers)
  embed, embed_at = parts.embed, parts.embed_at
  drop = lambda x: dropout(x, rate, key, 0)
  return replace(parts, embed=lambda top, inputs, dtype: drop(embed(top, inputs, dtype)),
                 embed_at=embed_at and (lambda top, inputs, positions, dtype:
                                        drop(embed_at(top, inputs, positions, dtype))))


def split_sequence(batch: dict, C: int) -> dict:
  """batch['tokens'] (B, T+1) -> {'inputs', 'targets'} (B, T), each in the ring's order for a
  context axis of C (models/ring.py): what the step splits along the sequence over `context`.
  The loss is a mean over tokens, so their order does not change it. A packed batch's
  (segments.py) 'weights', 'segments' and 'positions' (B, T) come too, the positions taken from
  the whole sequence before it is split."""
  return {k: ring.split_sequence(v, C) for k, v in segments.split(batch).items()}


def loss(parts: Parts, params: dict, batch: dict, ctx: StepContext = StepContext(),
         remat: str = "none") -> tuple[jax.Array, dict]:
  """batch['tokens'] (B, T+1) -> (mean next-token loss, the blocks' metrics: a mixture's router
  losses, {} without); `ctx.rng` is dropout's key (the blocks and `with_embed_dropout` use it),
  None: deterministic.

  Inside a step that is manual over `context` the batch is this device's share of
  `split_sequence`'s {'inputs', 'targets'} (B, T/C): the embedding takes each token's global
  position, the blocks' attention runs around the ring, and the loss is this share's mean (the
  step averages the shares).

  A packed batch (models/segments.py: `segment_ids`, `loss_mask`) runs its documents apart: their
  positions restart at 0, attention stays within a document, and the loss is the weighted mean
  over the counted targets, their count reported as the `loss_weight` metric."""
  pieces = batch if "inputs" in batch else segments.split(batch)
  inputs, targets = pieces["inputs"], pieces["targets"]
  seg = segments.of(pieces)
  logits, metrics = stack.forward_metrics(_positioned(parts, inputs.shape[1], ctx, seg), params,
                                          inputs, replace(ctx, segments=seg), remat)
  if "weights" not in pieces:
    return cross_entropy(logits, targets, ctx.manual), metrics
  weights, count = share_weights(pieces["weights"], ctx.manual)
  loss = jnp.sum(token_losses(logits, targets, ctx.manual) * weights)
  return loss, {**metrics, segments.WEIGHT: count}


def _positioned(parts: Parts, n: int, ctx: StepContext, seg) -> Parts:
  """`parts` whose embedding takes packed documents' positions (`seg`, segments.Segments; a
  GPT's learned positions, Llama's rotary reads ctx.segments in its blocks), or `_on_ring`'s."""
  if seg is None:
    return _on_ring(parts, n, ctx)
  if parts.embed_at is None:
    return parts
  embed_at = parts.embed_at
  return replace(parts, embed=lambda top, x, dtype: embed_at(top, x, seg.positions, dtype))


def _on_ring(parts: Parts, n: int, ctx: StepContext) -> Parts:
  """`parts` whose embedding takes the global positions of this device's n tokens where the step
  is manual over `context` (a GPT's learned positions; Llama's rotary angles read them in its
  blocks); `parts` itself elsewhere."""
  if CONTEXT not in ctx.manual or parts.embed_at is None:
    return parts
  positions, embed_at = ring.local_positions(n, CONTEXT), parts.embed_at
  return replace(parts, embed=lambda top, x, dtype: embed_at(top, x, positions, dtype))


def pipeline_grads(parts: Parts, params: dict, micro: dict, sched,
                   ctx: StepContext = StepContext(), remat: str = "none", loss_scale=1.0,
                   forward_only=False, metric_weights: dict | None = None):
  """Loss and gradients through the pipeline schedule `sched` (stack.pipeline_grads), the
  microbatches' tokens micro['tokens'] [M, b, T+1] scored by next-token cross-entropy (or, split
  over `context`, this device's share of `split_sequence`'s {'inputs', 'targets'} [M, b, T/C])."""
  # inputs and targets are sliced here, where every device runs, not in the per-stage branches:
  # XLA:CPU cannot run a collective (sequence parallel's seq-split shift) that only some run
  if "inputs" not in micro:
    micro = segments.split(micro)
  if "weights" not in micro:
    score = lambda logits, mb: (cross_entropy(logits, mb["targets"], ctx.manual), {})
    parts = _on_ring(parts, micro["inputs"].shape[2], ctx)
    return stack.pipeline_grads(parts, params, micro, sched, score, ctx=ctx, remat=remat,
                                loss_scale=loss_scale, forward_only=forward_only,
                                metric_weights=metric_weights)
  # packed: the weights are scaled over all M microbatches here, where every device runs (the
  # count's psum over `context` too), so each microbatch's score is its share of one mean
  M = micro["inputs"].shape[0]
  weights, count = share_weights(micro["weights"], ctx.manual, M)
  micro = {**micro, "weights": weights}

  def score(logits, mb):
    loss = jnp.sum(token_losses(logits, mb["targets"], ctx.manual) * mb["weights"])
    return loss, {segments.WEIGHT: count}
  inputs = lambda mb: mb["inputs"]
  if "positions" in micro and parts.embed_at is not None:  # a GPT's learned positions
    embed_at, inputs = parts.embed_at, lambda mb: (mb["inputs"], mb["positions"])
    parts = replace(parts, embed=lambda top, x, dtype: embed_at(top, x[0], x[1], dtype))
  elif "positions" not in micro:
    parts = _on_ring(parts, micro["inputs"].shape[2], ctx)
  return stack.pipeline_grads(parts, params, micro, sched, score, inputs=inputs, ctx=ctx,
                              remat=remat, loss_scale=loss_scale, forward_only=forward_only,
                              metric_weights=metric_weights, segments=segments.of)


def with_router_losses(ce: jax.Array, metrics: dict, tc) -> tuple[jax.Array, dict]:
  """A mixture's training loss: the next-token loss `ce` plus train.moe_aux_weight x the
  load-balancing loss and train.moe_z_weight x the z-loss (means over the MoE layers), `ce` kept
  as the metric lm_loss; (ce, metrics) as they are for a dense model."""
  if "moe_aux_loss" not in metrics:
    return ce, metrics
  total = ce + tc.moe_aux_weight * metrics["moe_aux_loss"] + tc.moe_z_weight * metrics["moe_z_loss"]
  return total, {**metrics, "lm_loss": ce}


def model_def(cfg, module) -> ModelDef:
  """A decoder of `module` (models/gpt.py, models/llama.py: its MODULE, parts and parameter
  count) for `cfg`, in `precision.param_dtype`, each layer under `parallel.remat`'s policy:
  ZeRO-3 gathers one layer at a time inside the scan; the pipeline form runs any schedule. With
  train.lora_rank > 0, low-rank adapters on train.lora_targets and the rest frozen (lora.py)."""
  param_dtype, remat = precision.param_dtype(cfg.precision), cfg.parallel.remat
  mc = cfg.model
  parts = lora.wrap_parts(module.parts(mc), cfg.train)  # train.lora_rank > 0: adapters merged
  base = from_nnx(lambda rngs: module.MODULE(mc, rngs=rngs, param_dtype=param_dtype),
                  loss_fn=lambda out, batch: (out, {}))
  rate = mc.dropout
  router_weights = {"moe_aux_loss": cfg.train.moe_aux_weight, "moe_z_loss": cfg.train.moe_z_weight}

  def loss_(params, batch, ctx=StepContext(), rng=None):
    if rate == 0 or rng is None:  # evaluation, or no dropout: today's program, no key in it
      out = loss(parts, params, batch, replace(ctx, rng=None), remat)
    else:
      out = loss(with_embed_dropout(parts, rate, rng, mc.n_layers), params, batch,
                 replace(ctx, rng=rng), remat)
    return with_router_losses(*out, cfg.train)

  def pipeline(params, micro, sched, ctx=StepContext(), loss_scale=1.0, forward_only=False):
    if rate > 0 and not forward_only:  # mesh.check says so first; a Trainer made without it
      raise ConfigError(f"model.dropout={rate} is not supported with a pipeline: the schedule "
                        "does not carry the step's key; use pipeline=1 or model.dropout=0")
    loss, metrics, grads = pipeline_grads(parts, params, micro, sched, ctx, remat, loss_scale,
                                          forward_only, router_weights)
    return (*with_router_losses(loss, metrics, cfg.train), grads)
  # DESIGN's model FLOPs per token: 6 N_nonembedding + 12 L D T (causal attention counted in full;
  # its D is the heads' width H K, which model.head_dim may set apart from d_model)
  HK = mc.n_heads * mc.head_width()
  flops_tok = 6 * module.n_params_nonembedding(mc) + 12 * mc.n_layers * HK * mc.seq_len
  return lora.with_adapters(
      ModelDef(init=base.init, loss=loss_, logical=base.logical, abstract=base.abstract,
               tokens_per_example=mc.seq_len, flops_per_example=flops_tok * mc.seq_len,
               pipeline=pipeline, takes_rng=rate > 0, seq_split=split_sequence), cfg.train)
