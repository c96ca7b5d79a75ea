"""Dtype policy: parameters are stored in `param_dtype`, matmuls run in `compute_dtype`,
logits and the loss in float32. `auto` compute is bfloat16 on GPU/TPU and float32 on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import PrecisionConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param_dtype(pc: PrecisionConfig):
  return _DTYPES[pc.param_dtype]


def compute_dtype(pc: PrecisionConfig):
  if pc.compute_dtype == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  return _DTYPES[pc.compute_dtype]
