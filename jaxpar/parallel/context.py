"""How one step runs a model: the context the trainer hands a model's loss and pipeline form.

A model's loss needs facts that belong to the step, not to the model: the dtype to compute in,
which parameters arrive as ZeRO-3 shards (and along which dimension) so the model can gather them
where it uses them, which mesh axes are manual where it runs (inside the step's shard_map over
`data`, and `pipeline` with a schedule), which the tensor-parallel collectives and the activation
constraints must know, and what a layer scan keeps for the backward (`parallel.remat`). They
travel together as one `StepContext`, so a model's signature does not change when the step learns
something new about its layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp


@dataclass(frozen=True)
class StepContext:
  """The step's side of a model call. The defaults are one device's: float32, nothing sharded,
  no manual axes, which is how a model runs outside the trainer."""
  dtype: Any = jnp.float32  # the compute dtype: parameters and float inputs are cast to it
  # the ZeRO-3 dimension of each parameter leaf (-1: whole), a tree like the parameters' (None:
  # every leaf whole); left out of the hash, since a dict is not hashable
  dims: Any = field(default=None, hash=False)
  manual: frozenset = frozenset()  # mesh axes a shard_map around the call is manual over
  # `parallel.remat`: what a layer scan keeps for the backward (models/stack.py's remat_policy)
  remat: str = "none"
  # attention over `context` where it is manual: "ring" or "allgather" (models/ring.py)
  context_attention: str = "ring"
  # the key of this piece of the batch (models/base.py's at_rows), for a model's dropout; None:
  # run deterministic (evaluation, or no dropout). A layer scan folds in the layer's index
  rng: Any = field(default=None, hash=False, compare=False)
  # packed documents (models/segments.py's Segments: segment ids and positions, each (B, T)
  # int32) of the tokens the activations hold, in their order (the ring's over `context`);
  # None: one sequence per row at positions 0..T-1. Arrays: left out of the hash
  segments: Any = field(default=None, hash=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, "manual", frozenset(self.manual))
