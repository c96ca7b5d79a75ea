"""SimpleCNN from the PyTorch DDP tutorial, in Flax NNX: conv 3x3 -> ReLU -> global mean -> linear.

The conv's output channels and the head's input carry the logical axis `mlp`, so with model > 1
the conv is column-parallel and the head row-parallel (Megatron-style); with model = 1 every
parameter is replicated and the model trains data-parallel. Letters: B batch, H/W image height
and width, C image channels, F conv channels, K classes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Config, ConfigError
from jaxpar.data import image_shape as dataset_image_shape
from jaxpar.models import base as jmodel
from jaxpar.models import precision

FEATURES = 32  # conv output channels, as in the tutorial
KERNEL = 3


class SimpleCNN(nnx.Module):
  """[B, H, W, C] images -> [B, K] logits."""

  def __init__(self, in_channels: int, num_classes: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    kernel = nnx.initializers.lecun_normal()
    zeros = nnx.initializers.zeros_init()
    self.conv = nnx.Conv(
        in_channels, FEATURES, (KERNEL, KERNEL), padding="VALID", param_dtype=param_dtype,
        kernel_init=nnx.with_partitioning(kernel, (None, None, None, "mlp")),
        bias_init=nnx.with_partitioning(zeros, ("mlp",)), rngs=rngs)
    self.head = nnx.Linear(
        FEATURES, num_classes, param_dtype=param_dtype,
        kernel_init=nnx.with_partitioning(kernel, ("mlp", None)),
        bias_init=nnx.with_partitioning(zeros, (None,)), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(self.conv(x))  # [B, H-2, W-2, F]
    return self.head(jnp.mean(h, axis=(1, 2)))  # [B, K]


def loss_fn(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
  """logits [B, K], batch['label'] [B] int -> (mean softmax cross-entropy, {'accuracy'})."""
  logits = logits.astype(jnp.float32)  # the softmax in full precision under bf16 compute
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


def flops_per_example(image_shape: tuple[int, int, int], num_classes: int) -> float:
  """Training FLOPs of one image (forward + backward = 3x the forward's multiply-adds x 2)."""
  h, w, c = image_shape
  conv = 2 * (h - KERNEL + 1) * (w - KERNEL + 1) * FEATURES * KERNEL * KERNEL * c
  head = 2 * FEATURES * num_classes
  return 3.0 * (conv + head)


def model_def(cfg: Config, image_shape: tuple[int, int, int] | None = None) -> jmodel.ModelDef:
  """The CNN for `cfg`; image_shape (H, W, C) defaults to that of the configured dataset."""
  if image_shape is None:
    image_shape = dataset_image_shape(cfg.data)
  h, w, c = image_shape
  if h < KERNEL or w < KERNEL:
    raise ConfigError(f"images of {h}x{w} pixels are smaller than the CNN's "
                      f"{KERNEL}x{KERNEL} kernel")
  k = cfg.model.num_classes
  dtype = precision.param_dtype(cfg.precision)
  base = jmodel.from_nnx(lambda rngs: SimpleCNN(c, k, rngs=rngs, param_dtype=dtype), loss_fn,
                         input_key="image")
  return jmodel.ModelDef(init=base.init, loss=base.loss, logical=base.logical,
                         abstract=base.abstract, tokens_per_example=0,
                         flops_per_example=flops_per_example(image_shape, k))
