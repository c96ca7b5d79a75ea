"""What jaxpar's decoders share: the layer scan, the forward, the loss, the pipeline form and the
way their stacked parameters are made.

A decoder (gpt.py, llama.py) supplies three pure functions over its parameter tree: `embed`
(tokens -> activations), `block` (one layer) and `head` (final norm + logits). Everything that
makes them parallel lives here once: layers stacked on a leading `layers` axis under one
`lax.scan` (compile time flat in depth), ZeRO-3 shards all-gathered one layer at a time inside the
scan and again in the backward, and the pipeline schedule's stage / embed / loss functions.
Letters: B batch, T seq, D embed, V vocab, L layers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.models import precision
from jaxpar.models.base import ModelDef, from_nnx
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import pipeline, zero
from jaxpar.parallel.rules import constrain, is_split

MODEL, DATA = jmesh.MODEL, jmesh.DATA


@dataclass(frozen=True)
class Parts:
  """A decoder's own functions; `top` is every parameter outside the layer stack."""
  embed: Callable[[dict, jax.Array, Any], jax.Array]  # (top, tokens (B, T), dtype) -> x (B, T, D)
  block: Callable[..., jax.Array]  # (one layer's params, x (B, T, D), manual) -> x (B, T, D)
  head: Callable[[dict, jax.Array], jax.Array]  # (top, x (B, T, D)) -> logits (B, T, V) float32


# -- tensor and sequence parallelism ---------------------------------------------------------------
# Megatron's pattern for a block's two matmul pairs: column-parallel in (the output split over
# `model`), row-parallel out (partial sums reduced over `model`). With sequence parallelism the
# residual stream between them is split along `seq` over `model`: the row-parallel sum becomes a
# reduce-scatter along seq and the column-parallel input an all-gather along seq, each the other's
# backward. They are written as explicit collectives in a shard_map over `model`, so every
# backend's program holds reduce-scatters (GSPMD left alone emits an all-reduce and a slice, which
# only some compilers fuse), with hand-written backward passes: inside the step's shard_map over
# `data`, jax cannot yet transpose a nested shard_map.

def sequence_parallel(manual=frozenset()) -> bool:
  """Whether activations between the matmuls are split along seq over `model` now."""
  return MODEL not in manual and is_split("seq")


def column_parallel(x: jax.Array, weights: list, manual=frozenset()) -> list:
  """x (B, T, D) times each w (D, N, ...) whose axis 1 is split over `model` -> [(B, T, N, ...)],
  as 2-D matmuls. Under sequence parallelism x arrives split along seq and is all-gathered first;
  the backward's partial sums over `model` come back reduce-scattered along seq."""
  if not sequence_parallel(manual):
    return [_mm(x, w) for w in weights]
  manual = _manual_now(manual)
  return _column_sp(x, [_varying(w, manual) for w in weights], manual)


def row_parallel(h: jax.Array, w: jax.Array, manual=frozenset()) -> jax.Array:
  """h (B, T, F) @ w (F, D), F split over `model` -> (B, T, D), the partial sums reduced: by an
  all-reduce, or under sequence parallelism by a reduce-scatter that leaves the result split along
  seq (its backward, an all-gather)."""
  if not sequence_parallel(manual):
    return constrain(_mm(h, w), ("batch", "seq", "embed"), manual=manual)
  manual = _manual_now(manual)
  return _row_sp(h, _varying(w, manual), manual)


def _mm(x, w):
  """x (B, T, D) @ w (D, ...) -> (B, T, ...), as one 2-D matmul."""
  D = x.shape[-1]
  return (x.reshape(-1, D) @ w.reshape(D, -1)).reshape(*x.shape[:2], *w.shape[1:])


def _mm_t(dy, w):
  """dy (B, T, ...) @ w (D, ...) transposed -> (B, T, D)."""
  D = w.shape[0]
  return (dy.reshape(dy.shape[0] * dy.shape[1], -1) @ w.reshape(D, -1).T).reshape(*dy.shape[:2], D)


def _dw(x, dy, shape):
  """The weight gradient of _mm: x (B, T, D), dy (B, T, ...) -> (D, ...) = `shape`."""
  D = x.shape[-1]
  return (x.reshape(-1, D).T @ dy.reshape(x.shape[0] * x.shape[1], -1)).reshape(shape)


def _gather_seq(x):
  return jax.lax.all_gather(x, MODEL, axis=1, tiled=True)


def _scatter_seq(y):
  # summed in float32 like every sum over `data`: a half-precision reduce-scatter loses the small
  # partial sums, and XLA:CPU aborts the process compiling it
  return zero.in_float32(
      lambda y: jax.lax.psum_scatter(y, MODEL, scatter_dimension=1, tiled=True))(y)


def _manual_now(manual) -> frozenset:
  """The mesh axes manual here: `manual` and those of every enclosing shard_map."""
  return frozenset(manual) | frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _batch_axes(manual) -> tuple:
  """(the batch dimension's spec, the axes) of a shard_map over `model`: manual over `data` too
  unless an enclosing shard_map already is, so the batch keeps its split."""
  if DATA in manual:
    return None, {MODEL}
  return DATA, {MODEL, DATA}


def _varying(w, manual):
  """Inside the step's shard_map over `data`, marks `w` as varying over `data`. A weight shared by
  the batch's shards is marked before the hand-written backward returns its per-shard gradient
  (the mark's own backward is the sum over `data`, as jax inserts it for any matmul with the
  batch), and that backward's results, which leave a shard_map over `model` alone, are marked so
  their types match what they are."""
  if DATA not in manual:
    return w
  try:
    return jax.lax.pcast(w, (DATA,), to="varying")
  except ValueError:  # already varying (a ZeRO-3 shard gathered over `data`)
    return w


def _weight_grad_sum(dw, manual):
  """A weight gradient summed over the batch's shards where this shard_map holds them."""
  return dw if DATA in manual else zero.in_float32(lambda g: jax.lax.psum(g, DATA))(dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _column_sp(x, ws, manual):
  b, axes = _batch_axes(manual)
  n = len(ws)
  return jax.shard_map(lambda x, ws: [_mm(_gather_seq(x), w) for w in ws],
                       in_specs=(P(b, MODEL), [P(None, MODEL)] * n),
                       out_specs=[P(b, None, MODEL)] * n, axis_names=axes)(x, ws)


def _column_sp_fwd(x, ws, manual):
  return _column_sp(x, ws, manual), (x, ws)


def _column_sp_bwd(manual, res, dys):
  b, axes = _batch_axes(manual)
  x, ws = res
  n = len(ws)

  def local(x, ws, dys):
    dx = _scatter_seq(sum(_mm_t(dy, w) for dy, w in zip(dys, ws)))
    xg = _gather_seq(x)
    return dx, [_weight_grad_sum(_dw(xg, dy, w.shape), manual) for dy, w in zip(dys, ws)]
  dx, dws = jax.shard_map(local, in_specs=(P(b, MODEL), [P(None, MODEL)] * n, [P(b, None, MODEL)] * n),
                          out_specs=(P(b, MODEL), [P(None, MODEL)] * n), axis_names=axes)(x, ws, dys)
  return _varying(dx, manual), [_varying(dw, manual) for dw in dws]


_column_sp.defvjp(_column_sp_fwd, _column_sp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _row_sp(h, w, manual):
  b, axes = _batch_axes(manual)
  return jax.shard_map(lambda h, w: _scatter_seq(_mm(h, w)), in_specs=(P(b, None, MODEL), P(MODEL)),
                       out_specs=P(b, MODEL), axis_names=axes)(h, w)


def _row_sp_fwd(h, w, manual):
  return _row_sp(h, w, manual), (h, w)


def _row_sp_bwd(manual, res, dy):
  b, axes = _batch_axes(manual)
  h, w = res

  def local(h, w, dy):
    g = _gather_seq(dy)
    return _mm(g, w.T), _weight_grad_sum(_dw(h, g, w.shape), manual)
  dh, dw = jax.shard_map(local, in_specs=(P(b, None, MODEL), P(MODEL), P(b, MODEL)),
                         out_specs=(P(b, None, MODEL), P(MODEL)), axis_names=axes)(h, w, dy)
  return _varying(dh, manual), _varying(dw, manual)


_row_sp.defvjp(_row_sp_fwd, _row_sp_bwd)


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
  top, top_dims, layer_dims = split(params, dims)

  # inputs and targets are sliced here, where every device runs, not in the per-stage branches:
  # XLA:CPU cannot run a collective (sequence parallel's seq-split shift) that only some run
  tokens = micro["tokens"]
  micro = {"inputs": tokens[:, :, :-1], "targets": tokens[:, :, 1:]}

  def embed_fn(t, mb):
    return parts.embed(zero.gather(t, top_dims), mb["inputs"], dtype)

  def stage_fn(layers, x):
    return run_layers(layers, x, parts.block, layer_dims, remat, manual)

  def loss_fn(t, x, mb):
    return cross_entropy(parts.head(zero.gather(t, top_dims), x), mb["targets"], manual)
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

  def loss_(params, batch, dtype=jnp.float32, dims=None, manual=frozenset(), rng=None):
    return loss(parts, params, batch, dtype, dims, remat, manual)

  def pipeline(params, micro, sched, dtype=jnp.float32, dims=None, manual=frozenset(), loss_scale=1.0,
               forward_only=False):
    return pipeline_grads(parts, params, micro, sched, dtype, dims, remat, manual, loss_scale,
                          forward_only)
  # DESIGN's model FLOPs per token: 6 N_nonembedding + 12 L D T (causal attention counted in full)
  flops_tok = 6 * module.n_params_nonembedding(mc) + 12 * mc.n_layers * mc.d_model * mc.seq_len
  return ModelDef(init=base.init, loss=loss_, logical=base.logical, abstract=base.abstract,
                  tokens_per_example=mc.seq_len, flops_per_example=flops_tok * mc.seq_len,
                  pipeline=pipeline)
