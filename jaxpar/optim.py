"""The optax chain: global-norm clipping, AdamW with warmup + cosine decay, no decay on norms/biases."""
from __future__ import annotations

from typing import Any

import jax
import optax

from jaxpar.config import TrainConfig


def schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `steps`."""
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=warmup,
      decay_steps=max(tc.steps, warmup + 1), end_value=tc.lr * tc.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """Weight decay on matrices only: norms' scales, biases (1-D per layer) are left alone."""
  def one(path, x):
    name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    stacked = name.startswith("layers/")  # jaxpar's decoder stacks layers on a leading axis
    return x.ndim - int(stacked) >= 2
  return jax.tree_util.tree_map_with_path(one, params)


def make(tc: TrainConfig) -> optax.GradientTransformation:
  """clip_by_global_norm -> AdamW(schedule, b1, b2, weight_decay masked)."""
  parts = []
  if tc.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(tc.clip_norm))
  parts.append(optax.adamw(schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                           mask=decay_mask))
  return optax.chain(*parts)
