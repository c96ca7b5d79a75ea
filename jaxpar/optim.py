"""The optax chain: global-norm clipping, AdamW with warmup + cosine decay, no decay on norms/biases."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import TrainConfig


def schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `steps`."""
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=warmup,
      decay_steps=max(tc.steps, warmup + 1), end_value=tc.lr * tc.min_lr_ratio)


def decay_mask(logical: Any) -> Any:
  """Weight decay on matrices only, read off each parameter's logical axes: a leaf with at least
  two axes besides a stacked `layers` axis decays; norms' scales and biases do not.

  `logical` is the model's tree of logical-axis tuples (ModelDef.logical), so the decision follows
  what a parameter is, not what its path is called.
  """
  return jax.tree_util.tree_map(lambda names: sum(a != "layers" for a in names) >= 2, logical,
                                is_leaf=lambda x: isinstance(x, tuple))


def make(tc: TrainConfig, logical: Any) -> optax.GradientTransformation:
  """clip_by_global_norm -> AdamW(schedule, b1, b2, weight_decay masked by `decay_mask(logical)`)."""
  parts = []
  if tc.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(tc.clip_norm))
  parts.append(optax.adamw(schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                           mask=decay_mask(logical)))
  return optax.chain(*parts)


def keep_unless(ok: jax.Array, new: Any, old: Any) -> Any:
  """The optimizer state after a step that is applied only if `ok`: the old moments when not,
  but the learning-rate schedule's count advances either way, so the rate follows the training
  step (logged and applied alike) and reaches its floor at `train.steps`."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  return jax.tree_util.tree_map(
      lambda n, o: n if is_sched(n) else jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), n, o),
      new, old, is_leaf=is_sched)
