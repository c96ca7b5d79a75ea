"""A stack of identical blocks between an embedding and a head: the layer scan, ZeRO-3's gather one
layer at a time, remat, and the pipeline form, for jaxpar's decoders and a user's stack alike.

A stacked model's parameters are `{'layers': leaves (L, ...), ...the rest ('top')}`; the stack's
leading axis is named 'layers', which the rules map to `pipeline`, so each stage holds a
contiguous block of layers and the schedules of parallel/pipeline.py run the blocks. Its three
functions are `Parts`; decoder.py gives its own, and `from_stack` (user_stack.py) makes them from a
user's Flax modules. The step's dtype, ZeRO-3 dims, manual axes and remat policy arrive as one
`StepContext` (parallel/context.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.models import moe
from jaxpar.parallel import pipeline, zero
from jaxpar.parallel.context import StepContext


@dataclass(frozen=True)
class Parts:
  """A stacked model's own functions; `top` is every parameter outside the layer stack."""
  embed: Callable[[dict, Any, Any], jax.Array]  # (top, inputs, dtype) -> x, e.g. (B, T, D)
  block: Callable[..., jax.Array]  # (one layer's params, x, ctx) -> x of the same shape
  head: Callable[[dict, jax.Array], Any]  # (top, x) -> outputs (a decoder's: float32 logits)
  # (top, inputs, positions (T,) int, dtype) -> x: `embed` for tokens at those global positions
  # (a context-split sequence); None: embed has no positions of its own (e.g. rotary's model)
  embed_at: Callable[..., jax.Array] | None = None
  # names of the scalars `block` reports beside x, as (x, {name: scalar}) (a mixture's router
  # losses); forward_metrics gives their means over the layers. (): block returns x alone
  metrics: tuple[str, ...] = ()
  # layers per scan step. every > 1: the stack's leaves differ in length (a decoder with a
  # mixture in every k-th layer keeps its dense MLPs' and its mixtures' weights apart), and one
  # step runs a group of `every` layers: each leaf (N, ...) is viewed as (n, N/n, ...), n = the
  # longest leaf's N / every, and pick(a group's leaves, j) -> the group's layer j's
  every: int = 1
  pick: Callable[[dict, int], dict] | None = None


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
  dots_saveable and offload keep a mixture's moe.SAVED as well, on the device (its exchanged rows
  are no dot outputs): else the backward reruns its all-to-alls (6 buffers a layer, not 4) and,
  8x1x1, has more temporaries than no remat (1.54 MB against 1.28 MB; 1.27 MB with them kept).
  Gathered ZeRO-3 weights are never dot outputs, so every policy re-gathers them in the backward.
  """
  cp = jax.checkpoint_policies
  keep = cp.save_only_these_names(*moe.SAVED)
  dots = cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, keep)
  to_host = cp.offload_dot_with_no_batch_dims("device", "pinned_host")
  # a mixture's moe.SAVED stays on the device, the dots go to the host
  offload = lambda prim, *args, **params: keep(prim, *args, **params) or to_host(prim, *args,
                                                                                 **params)
  return {"full": None, "dots_saveable": dots, "offload": offload}[remat]


def groups(layers: dict, dims: Any, every: int) -> tuple[dict, Any, int]:
  """A stack whose longest leaves have n x `every` rows viewed as n groups: each leaf (N, ...)
  -> (n, N/n, ...), its ZeRO dim one axis on; (the leaves, the dims, n)."""
  n = max(x.shape[0] for x in jax.tree_util.tree_leaves(layers)) // every
  view = lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:])
  return jax.tree_util.tree_map(view, layers), zero.shift(dims, 1), n


def run_layers(layers: dict, x: jax.Array, block: Callable[..., jax.Array],
               ctx: StepContext = StepContext(), remat: str = "none",
               metrics: tuple[str, ...] = (), every: int = 1,
               pick: Callable[[dict, int], dict] | None = None) -> Any:
  """Scan `block` over a stack of layers. layers: leaves (L, ...); x (B, T, D) -> x, or with
  `metrics` (the names of the scalars block returns beside x) (x, {name: mean over the layers
  that report them}).

  every > 1 (`Parts.every`): the scan runs over groups (`groups`), each step the group's layers
  in turn, layer j's weights pick(group, j); a layer whose block returns no metrics ({}) is not
  counted in their means. The checkpoint, ZeRO-3's gathers and regather then hold a group.

  Each layer runs under `remat`'s checkpoint policy (`remat_policy`). `ctx.dims` are the ZeRO-3
  dims of the stacked leaves: each layer's shards are all-gathered inside the scan body and
  gathered again in the backward (`zero.regather` when nothing is rematerialised), so at most a
  layer or two is whole on a device at a time. The block gets `ctx` without dims: its weights
  arrive whole. With a key (`ctx.rng`, dropout) the block of layer i gets fold_in(key, i), i the
  index in this scan (the model's layer index when the whole stack is scanned at once).
  """
  if every > 1:  # a step runs a group of `every` layers
    layers, dims, n = groups(layers, ctx.dims, every)
  else:
    dims, n = ctx.dims, jax.tree_util.tree_leaves(layers)[0].shape[0]
  step_dims = zero.shift(dims)
  layer_ctx = replace(ctx, dims=None)  # the block's weights arrive gathered
  keyed = ctx.rng is not None
  reporting = []  # how many layers of a step report metrics (known once the body is traced)

  def body(carry, p_i):
    p, i = p_i
    p = zero.gather(p, step_dims)
    x, total = carry if metrics else (carry, {})
    count = 0
    for j in range(every):  # layer i x every + j of this scan
      lctx = layer_ctx
      if keyed:
        lctx = replace(lctx, rng=jax.random.fold_in(ctx.rng, i if every == 1 else i * every + j))
      out = block(p if every == 1 else pick(p, j), x, lctx)
      x, m = out if metrics else (out, {})
      if m:
        total, count = {k: total[k] + m[k] for k in metrics}, count + 1
    reporting.append(count)
    return ((x, total) if metrics else x), None
  if remat != "none":
    body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(remat))
  elif ctx.dims is not None:
    body = zero.regather(body)
  init = (x, {k: jnp.zeros((), jnp.float32) for k in metrics}) if metrics else x
  out, _ = jax.lax.scan(body, init, (layers, jnp.arange(n, dtype=jnp.uint32) if keyed else None))
  if not metrics:
    return out
  return out[0], {k: v / (n * reporting[-1]) for k, v in out[1].items()}


def forward(parts: Parts, params: dict, inputs: Any, ctx: StepContext = StepContext(),
            remat: str = "none") -> Any:
  """inputs -> the head's outputs: embed, the scanned stack, head (ZeRO-3 top gathered once)."""
  return forward_metrics(parts, params, inputs, ctx, remat)[0]


def forward_metrics(parts: Parts, params: dict, inputs: Any, ctx: StepContext = StepContext(),
                    remat: str = "none") -> tuple[Any, dict]:
  """`forward`, and the means over the layers of the blocks' `parts.metrics` ({} without)."""
  top, top_dims, layer_dims = split(params, ctx.dims)
  top = zero.gather(top, top_dims)
  x = parts.embed(top, inputs, ctx.dtype)
  out = run_layers(params["layers"], x, parts.block, replace(ctx, dims=layer_dims), remat,
                   parts.metrics, parts.every, parts.pick)
  x, metrics = out if parts.metrics else (out, {})
  return parts.head(top, x), metrics


def pipeline_grads(parts: Parts, params: dict, micro: dict, sched, score: Callable,
                   inputs: Callable = lambda mb: mb["inputs"], ctx: StepContext = StepContext(),
                   remat: str = "none", loss_scale=1.0, forward_only=False,
                   metric_weights: dict | None = None, segments: Callable | None = None):
  """Loss and gradients through the pipeline schedule `sched` (inside a shard_map over `pipeline`).

  params: this stage's layers (leaves [L/P, ...]) and the replicated `top`; micro: batch leaves
  [M, b, ...]; inputs(mb) -> the embedding's inputs of one microbatch; score(outputs, mb) -> its
  (mean loss, dict of scalar metrics), both averaged over the microbatches. ZeRO-3 shards are
  gathered inside each use, so their gradients come back reduce-scattered. Gradients are of
  `loss_scale` times the loss; with `forward_only` (evaluation) there are none (None).
  The blocks' `parts.metrics` join the metrics as their means over the layers and microbatches;
  `metric_weights` ({name: weight}, every name of parts.metrics) adds weight x each to the loss
  the gradients are of (a mixture's router losses), not to the loss returned.
  segments(mb) -> a microbatch's `StepContext.segments` (packed documents), which its blocks get.
  """
  top, top_dims, layer_dims = split(params, ctx.dims)
  layer_ctx = replace(ctx, dims=layer_dims)

  def embed_fn(t, mb):
    return parts.embed(zero.gather(t, top_dims), inputs(mb), ctx.dtype)

  def stage_fn(layers, x, mb):
    lctx = layer_ctx if segments is None else replace(layer_ctx, segments=segments(mb))
    return run_layers(layers, x, parts.block, lctx, remat, parts.metrics, parts.every, parts.pick)

  def loss_fn(t, x, mb):
    loss, metrics = score(parts.head(zero.gather(t, top_dims), x), mb)
    as_f32 = lambda v: jnp.asarray(v, jnp.float32)
    return as_f32(loss), {k: as_f32(v) for k, v in metrics.items()}
  (loss, metrics), g_layers, g_top = pipeline.execute(
      sched, params["layers"], top, micro, embed_fn, stage_fn, loss_fn, loss_scale, forward_only,
      aux_weights={k: (metric_weights or {}).get(k, 0.0) for k in parts.metrics} or None)
  if forward_only:
    return loss, metrics, None
  return loss, metrics, {**g_top, "layers": g_layers}
