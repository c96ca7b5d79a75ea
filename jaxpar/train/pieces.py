"""How the pieces of a batch (data shards, accumulated microbatches, context shares) combine their
losses and metrics into the whole batch's: plain means of equal pieces, or weighted means where
loss_fn reports a weight (WEIGHT).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import zero

CONTEXT = jmesh.CONTEXT
# A loss_fn metric with this name is the loss's denominator in its piece of the batch (e.g. the
# unmasked tokens of a masked mean). Pieces (data shards, accumulated microbatches) then combine
# as sum(weight * loss) / sum(weight), the global batch's loss, instead of a mean of their means,
# and so do the other float metrics (each taken as a mean over its piece). Without it every
# metric is a plain mean over the pieces, which are equal in size.
WEIGHT = "loss_weight"



# What the step reports itself; loss_fn's metrics may not take these names.
STEP_METRICS = ("loss", "grad_norm", "learning_rate", "grads", "skipped", "loss_scale")


def as_float_weight(loss, aux):
  """(loss, metrics) of loss_fn, the WEIGHT metric, if any, in float32 (a count may come as an
  int); a metric named like one of the step's own is refused."""
  taken = sorted(set(aux) & set(STEP_METRICS))
  if taken:
    raise ConfigError(f"loss_fn returns the metric(s) {', '.join(map(repr, taken))}, a name the "
                      f"step reports itself ({', '.join(STEP_METRICS)}); rename it")
  if WEIGHT in aux:
    aux = {**aux, WEIGHT: jnp.asarray(aux[WEIGHT], jnp.float32)}
  return loss, aux


def over_context(loss, aux, manual: frozenset):
  """A context-split piece's (loss, metrics), the means over its T/C tokens -> the means over the
  sequence (the shares are equal in size); as it is without a context axis. Taken inside the
  differentiated function: the parameters' gradients then come back summed over the ring."""
  if CONTEXT not in manual:
    return loss, aux
  return jax.lax.pmean(loss, CONTEXT), {k: jax.lax.pmean(v, CONTEXT) if is_float(v) else v
                                        for k, v in aux.items()}


def is_float(v) -> bool:
  return jnp.issubdtype(jnp.result_type(v), jnp.floating)


def weighed(loss, aux):
  """One piece's loss and float metrics (its means) times its weight: its sums. A piece of
  weight 0 adds 0 even where its own mean is 0/0; the gradient of such a mean is still NaN, so
  loss_fn must keep a piece with nothing in it finite (divide by max(weight, 1))."""
  w = jax.lax.stop_gradient(aux[WEIGHT])
  times_w = lambda v: jnp.where(w > 0, v * w, jnp.zeros_like(v))
  return times_w(loss), {k: times_w(v) if k != WEIGHT and is_float(v) else v
                         for k, v in aux.items()}


def unweighted(loss, aux, grads, accum: int, manual: frozenset):
  """Means over the pieces of the weighed sums (loss, float metrics, gradients) and of the
  weights -> the whole batch's weighted means; the logged weight becomes the batch's total."""
  mean_w = aux[WEIGHT]
  denom = jnp.maximum(mean_w, jnp.finfo(jnp.float32).tiny)  # a batch with no weight: loss 0
  n = accum * (jax.lax.axis_size(zero.DATA) if zero.DATA in manual else 1)
  aux = {k: v / denom if k != WEIGHT and is_float(v) else v for k, v in aux.items()}
  aux[WEIGHT] = mean_w * n
  if grads is None:
    return loss / denom, aux
  return loss / denom, aux, jax.tree_util.tree_map(lambda g: g / denom.astype(g.dtype), grads)
