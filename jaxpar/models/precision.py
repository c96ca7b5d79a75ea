"""Dtype policy: parameters are stored in `param_dtype`, matmuls run in `compute_dtype`,
logits and the loss in float32. `auto` compute is bfloat16 on GPU/TPU and float32 on CPU.

Loss scaling keeps float16's small backward values from flushing to zero: the loss is multiplied
by a scale before differentiation and the gradients divided by it after. `loss_scale` is either
a static number or `dynamic`. Dynamic scaling (float16 compute only; elsewhere it is a no-op, as
bfloat16 and float32 share float32's exponent range) keeps the scale in the train state
({"scale": float32, "good_steps": int32}, replicated): a step whose gradients are not finite is
skipped and multiplies the scale by `backoff` (not below `min_scale`); `growth_interval` finite
steps in a row double it.

A skipped step leaves parameters and optimizer moments as they were but, like a
`train.skip_nonfinite` skip, still advances the learning-rate schedule (optim.keep_unless): the
rate is a function of the step, so the logged rate is the applied one and the decay ends at
`train.steps` however many steps overflowed. (DeepSpeed holds its scheduler on an overflow step;
the difference is the few steps a run spends finding its scale.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import PrecisionConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DYNAMIC = "dynamic"
GROWTH = 2.0


def param_dtype(pc: PrecisionConfig):
  return _DTYPES[pc.param_dtype]


def compute_dtype(pc: PrecisionConfig):
  if pc.compute_dtype == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return _DTYPES[pc.compute_dtype]


def is_dynamic(pc: PrecisionConfig) -> bool:
  """Whether the train state carries a dynamic loss scale: `dynamic` with float16 compute."""
  return pc.loss_scale == DYNAMIC and compute_dtype(pc) == jnp.float16


def static_scale(pc: PrecisionConfig) -> float:
  """The fixed loss scale; 1.0 for `dynamic` (whose scale lives in the state, see is_dynamic)."""
  return 1.0 if pc.loss_scale == DYNAMIC else float(pc.loss_scale)


def scale_abstract() -> dict:
  """Shapes and dtypes of the dynamic scale's train-state entry."""
  return {"scale": jax.ShapeDtypeStruct((), jnp.float32),
          "good_steps": jax.ShapeDtypeStruct((), jnp.int32)}


def init_scale(pc: PrecisionConfig) -> dict:
  return {"scale": jnp.asarray(pc.initial_scale, jnp.float32),
          "good_steps": jnp.zeros((), jnp.int32)}


def next_scale(ls: dict, ok: jax.Array, pc: PrecisionConfig) -> dict:
  """The scale after a step that was finite (`ok`) or overflowed (DeepSpeed's and torch.amp's rule)."""
  good = jnp.where(ok, ls["good_steps"] + 1, 0)
  grow = good >= pc.growth_interval
  scale = jnp.where(ok, jnp.where(grow, ls["scale"] * GROWTH, ls["scale"]),
                    jnp.maximum(ls["scale"] * pc.backoff, pc.min_scale))
  return {"scale": scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good)}
