"""A mixture-of-experts MLP for the decoders' blocks (gpt.py, llama.py, where model.n_experts > 0).

A router scores each token against the E experts and sends it to its k best; the expert MLPs run
on the tokens sorted by expert as grouped matmuls (grouped.py: `jax.lax.ragged_dot`, or tiles on
the CPU, whose ragged_dot is a masked dense matmul), so no (tokens x experts x width) tensor is
made, and each token's k outputs are summed with the router's weights.
Dropless by default: every expert takes all its tokens. With model.capacity_factor an expert
takes at most C = ceil(factor x tokens x k / E) of a device's tokens, earliest first, and the rest
skip it (the block's residual carries them); the kept rows then take fixed slots, C an expert,
and each expert runs one batched matmul on its slots (`_slotted`: no sort, no tiles). Shared experts (model.shared_experts) are one dense
MLP every token goes through, split over `model` like the dense block's, its output scaled per
token by sigmoid(h . shared_gate) with model.shared_expert_gate (Qwen2-MoE's).

The experts' weights have the logical axis `expert`, which the rules map to `data` (expert
parallelism): inside the step each device holds E/d experts and parallel/expert.py carries the
rows to their owners and back. The router's statistics (the load-balancing and z losses, the
load) are means over the whole batch whatever the layout (expert.token_mean).
Letters: B batch, T seq, N tokens (B*T), D embed, E experts, k experts per token, A rows (N*k),
F an expert's width.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import ModelConfig
from jaxpar.models import grouped
from jaxpar.parallel import expert, tensor
from jaxpar.parallel.rules import constrain

# What a block's checkpoint policy keeps of the mixture so that its backward runs no exchange and
# no expert matmul again: the rows an owner receives, the experts' matmul outputs before their
# activation, and the rows come back (the router's small matmul and the sorts are recomputed).
SAVED = ("moe_rows", "moe_gate", "moe_up", "moe_out")

# what a MoE block reports beside its output, each a mean over the MoE layers; and, per expert,
# load_names(E): the share of the routed rows expert e received (the E shares sum to 1)
METRICS = ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped")


def load_names(E: int) -> tuple[str, ...]:
  """The per-expert load metrics' names, moe_load/0 .. moe_load/{E-1} zero-padded so that they
  sort in order (TensorBoard groups them under moe_load)."""
  width = len(str(E - 1))
  return tuple(f"moe_load/{e:0{width}d}" for e in range(E))


def metric_names(cfg: ModelConfig) -> tuple[str, ...]:
  """The metrics a block of `cfg` reports (stack.Parts.metrics): none for a dense MLP."""
  if not cfg.n_experts:
    return ()
  return (METRICS if cfg.capacity_factor else METRICS[:-1]) + load_names(cfg.n_experts)


def width(cfg: ModelConfig) -> int:
  """An expert's hidden width, F."""
  return cfg.moe_d_ff or cfg.d_ff


# every weight `make_params` may make: the leaves of a decoder's stack that only its mixture
# layers have
PARAMS = ("router", "e_gate", "e_up", "e_down", "e_w1", "e_w2", "s_gate", "s_up", "s_down", "s_w1",
          "s_w2", "shared_gate")


def make_params(cfg: ModelConfig, param, glu: bool, out_std: float) -> dict:
  """The MoE MLP's weights for its L stacked layers (n_layers / moe_every), by name: the router
  (L, D, E); each expert's in and out matmuls (L, E, D, F) and (L, E, F, D), SwiGLU's gate and
  up (`glu`) or GELU's one; the shared experts' dense MLP of width shared_experts x F. `param`
  is decoder.param_maker's."""
  L, D, E, F = cfg.mixture_layers(), cfg.d_model, cfg.n_experts, width(cfg)
  normal = nnx.initializers.normal
  ins = ("e_gate", "e_up") if glu else ("e_w1",)
  out = {"router": param((L, D, E), ("layers", "embed", None), normal(0.02))}
  for name in ins:
    out[name] = param((L, E, D, F), ("layers", "expert", "embed", "mlp"), normal(0.02))
  out["e_down" if glu else "e_w2"] = param((L, E, F, D), ("layers", "expert", "mlp", "embed"),
                                           normal(out_std))
  Fs = cfg.shared_experts * F
  if Fs:
    for name in ("s_gate", "s_up") if glu else ("s_w1",):
      out[name] = param((L, D, Fs), ("layers", "embed", "mlp"), normal(0.02))
    out["s_down" if glu else "s_w2"] = param((L, Fs, D), ("layers", "mlp", "embed"),
                                             normal(out_std))
  if cfg.shared_expert_gate:
    out["shared_gate"] = param((L, D), ("layers", "embed"), normal(0.02))
  return out


def n_params(cfg: ModelConfig, glu: bool, active: bool) -> int:
  """The MoE MLP's parameters in one layer: all of them, or those one token uses (`active`:
  the router, k experts, the shared ones), the N of 6N FLOPs per token."""
  D, E, F = cfg.d_model, cfg.n_experts, width(cfg)
  per_expert = (3 if glu else 2) * D * F
  used = cfg.experts_per_token if active else E
  return D * E + (used + cfg.shared_experts) * per_expert + D * cfg.shared_expert_gate


def route(logits: jax.Array, k: int, softmax: str) -> tuple[jax.Array, jax.Array]:
  """logits (N, E) float32 -> (weights (N, k) float32, experts (N, k) int32), the best first.
  after_topk: the softmax over the k chosen logits (= Mixtral's softmax, top-k, renormalise);
  before_topk: the softmax over all E, the k chosen probabilities as they are."""
  top, experts = jax.lax.top_k(logits, k)
  if softmax == "after_topk":
    return jax.nn.softmax(top, -1), experts
  return jnp.take_along_axis(jax.nn.softmax(logits, -1), experts, -1), experts


def mlp(p: dict, h: jax.Array, cfg: ModelConfig, manual=frozenset()) -> tuple[jax.Array, dict]:
  """One layer's MoE MLP. p: its weights (`make_params`' names, one layer's); h (B, T, D), the
  normed residual -> ((B, T, D) in h's dtype, {METRICS name: float32 scalar})."""
  B, T, D = h.shape
  N, E, k = B * T, cfg.n_experts, cfg.experts_per_token
  glu = "e_gate" in p
  # whole along D, so that where the exchange's backward brings the rows' cotangent split along
  # D (expert.width_axis) it is gathered here, N rows rather than the buffers' rows
  x = constrain(h.reshape(N, D), (None, "embed"), manual=manual)
  logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)  # (N, E)
  weights, experts = route(logits, k, cfg.router_softmax)
  flat = experts.reshape(N * k)  # row a = token a // k's choice a % k
  counts = jnp.zeros((E,), jnp.int32).at[flat].add(1)  # (E,) rows per expert
  starts = jnp.cumsum(counts) - counts
  A = N * k
  axis = expert.owner_axis(manual)
  d = 1 if axis is None else jax.lax.axis_size(axis)
  if cfg.capacity_factor:
    C = math.ceil(cfg.capacity_factor * A / E)
    rank = _rank_in_group(flat, starts, E)  # earlier tokens first, as a stable sort orders them
    keep = rank < C
    if d == 1 or E // d * C <= A:  # slots: no sort, no tiles, buffers no larger than A rows
      out = _slotted(p, x, flat, rank, keep, C, glu, axis, manual)
    else:  # an owner's buffers of E/d x C rows would exceed all the rows: the sorted exchange's
      order = jnp.argsort(jnp.where(keep, flat, E), stable=True)  # dropped rows sort last
      out = expert.run_owned(x[order // k], jnp.minimum(counts, C), _grouped(p, x, glu, manual),
                             A, axis, manual)[jnp.argsort(order)]
  else:
    keep = None
    order = jnp.argsort(flat, stable=True)  # (A,) rows sorted by expert
    rows, compute = x[order // k], _grouped(p, x, glu, manual)
    if axis is None:
      out = compute(rows, counts)
    else:  # an owner's buffer may hold every row
      out = expert.run_owned(rows, counts, compute, A, axis, manual)
    out = out[jnp.argsort(order)]  # back in row order
  out = checkpoint_name(out, "moe_out").reshape(N, k, D)
  if keep is not None:
    weights = jnp.where(keep.reshape(N, k), weights, 0.0)
  y = jnp.einsum("nkd,nk->nd", out, weights.astype(out.dtype)).reshape(B, T, D)
  # the exchange may bring the rows back split along D (expert.width_axis): whole again here,
  # N rows rather than N x k
  y = constrain(y, ("batch", "seq", "embed"), manual=manual)
  if "s_down" in p or "s_w2" in p:
    s = _shared(p, h, glu, manual)  # (B, T, D), split along seq like h under sequence parallel
    if "shared_gate" in p:
      s = s * jax.nn.sigmoid(h @ p["shared_gate"].astype(h.dtype))[..., None]
    y = y + s

  mean = lambda v: expert.token_mean(v, manual)
  load = mean(counts.astype(jnp.float32) / N)  # (E,) each expert's rows per token, summing to k
  prob = mean(jnp.mean(jax.nn.softmax(logits, -1), 0))  # (E,)
  metrics = {"moe_aux_loss": E * jnp.sum(load * prob),
             "moe_z_loss": mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits, -1)))),
             "moe_max_load": jnp.max(load) * E / k,
             **dict(zip(load_names(E), load / k))}
  if keep is not None:
    metrics["moe_dropped"] = mean(1.0 - jnp.sum(keep) / A)
  return y, metrics


def _experts(p: dict, rows: jax.Array, glu: bool, dot, hidden_axes, manual) -> jax.Array:
  """The experts' MLP on rows by `dot(a, name)` (a grouped or a batched matmul with the weight
  `name`); hidden_axes: the logical axes of the hidden activations, F split over `model`."""
  rows = checkpoint_name(rows, "moe_rows")
  if glu:
    hid = jax.nn.silu(checkpoint_name(dot(rows, "e_gate"), "moe_gate")) * checkpoint_name(
        dot(rows, "e_up"), "moe_up")
  else:
    hid = jax.nn.gelu(checkpoint_name(dot(rows, "e_w1"), "moe_up"))
  hid = constrain(hid, hidden_axes, manual=manual)
  return dot(hid, "e_down" if glu else "e_w2")


def _grouped(p: dict, x: jax.Array, glu: bool, manual) -> Callable:
  """compute(rows (M, D) sorted by expert, sizes (El,)) -> (M, D): this device's experts as grouped
  matmuls (rows past the sizes' sum are padding)."""
  def compute(rows, sizes):
    tiles = grouped.layout(sizes, rows.shape[0])  # once for the experts' matmuls
    dot = lambda a, name: grouped.matmul(a, p[name].astype(x.dtype), sizes, tiles)
    return _experts(p, rows, glu, dot, (None, "mlp"), manual)
  return compute


def _slotted(p: dict, x: jax.Array, flat, rank, keep, C: int, glu: bool, axis, manual):
  """A capacity's experts on fixed slots: row a (token a // k's choice a % k) takes slot rank[a]
  of its expert's C, a buffer (E, C, D) is gathered from x with zeros in the empty slots, each
  expert multiplies its C rows by one batched matmul (no sort, no tiles: GShard's layout, made by
  gathers rather than one-hot einsums, whose work grows with tokens squared), and each kept row
  reads its slot back: (A, D), zeros for the dropped rows. With the experts split over `axis`
  the buffers cross as they are (expert.run_slotted)."""
  (N, D), A, E = x.shape, flat.shape[0], p["router"].shape[-1]
  k = A // N
  slot = jnp.where(keep, flat * C + rank, E * C)  # (A,): E*C for a dropped row
  held = jnp.full((E * C,), A, jnp.int32).at[slot].set(jnp.arange(A, dtype=jnp.int32),
                                                       mode="drop")  # each slot's row, A: none
  buf = _dispatch(k, x, slot, held).reshape(E, C, D)
  dot = lambda a, name: jnp.einsum("gmd,gdf->gmf", a, p[name].astype(x.dtype))
  compute = lambda rows: _experts(p, rows, glu, dot, (None, None, "mlp"), manual)
  out = compute(buf) if axis is None else expert.run_slotted(buf, compute, axis, manual)
  return _combine(out.reshape(E * C, D), slot, held)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] along the first axis, zeros where idx is past its end."""
  n = x.shape[0]
  return jnp.where((idx < n)[:, None], x[jnp.minimum(idx, n - 1)], 0)


# The slots' moves as gathers both ways: slot and held are inverse maps between the A rows and the
# E*C slots (a row's slot, a slot's row; past the end for none), so each move's transpose is the
# other gather, not a scatter-add (which XLA:CPU runs serially)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(k, x, slot, held):
  """x (N, D) -> (E*C, D): each slot's row's token (row a is token a // k's), zeros in the empty
  slots."""
  return _gather(x, jnp.where(held < slot.shape[0], held // k, x.shape[0]))


def _dispatch_fwd(k, x, slot, held):
  return _dispatch(k, x, slot, held), (slot, held)


def _dispatch_bwd(k, res, ct):  # a token's cotangent: the sum of its k rows' slots'
  slot, held = res
  A, D = slot.shape[0], ct.shape[-1]
  return _gather(ct, slot).reshape(A // k, k, D).sum(1), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(out, slot, held):
  """out (E*C, D) -> (A, D): each row's slot's output, zeros for a dropped row."""
  return _gather(out, slot)


def _combine_fwd(out, slot, held):
  return _combine(out, slot, held), (slot, held)


def _combine_bwd(res, ct):
  slot, held = res
  return _gather(ct, held), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _rank_in_group(flat: jax.Array, starts: jax.Array, E: int) -> jax.Array:
  """Each row's place among the rows of its expert, in row order: flat (A,) experts -> (A,). A
  running count of the rows' one-hot (A, E) where that is small, else a stable sort."""
  if flat.shape[0] * E <= 1 << 22:
    onehot = flat[:, None] == jnp.arange(E, dtype=flat.dtype)
    return jnp.sum(jnp.where(onehot, jnp.cumsum(onehot, 0, dtype=jnp.int32), 0), -1) - 1
  order = jnp.argsort(flat, stable=True)
  place = jnp.zeros_like(order).at[order].set(jnp.arange(flat.shape[0], dtype=order.dtype))
  return place - starts[flat]


def _shared(p: dict, h: jax.Array, glu: bool, manual) -> jax.Array:
  """The shared experts: a dense MLP over h (B, T, D), tensor-parallel like the dense block's."""
  w = lambda name: p[name].astype(h.dtype)
  if glu:
    gate, up = tensor.column_parallel(h, [w("s_gate"), w("s_up")], manual)
    return tensor.row_parallel(jax.nn.silu(gate) * up, w("s_down"), manual)
  a, = tensor.column_parallel(h, [w("s_w1")], manual)
  return tensor.row_parallel(jax.nn.gelu(a), w("s_w2"), manual)
