"""The loss-spike guard (train.spike_factor > 0): judges each logged loss, keeps the last good
state in host memory and rolls the run back to it, skipping the batches since.
"""
from __future__ import annotations

import math
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxpar import config as jconfig


def _index_key(index: tuple) -> tuple:
  """A shard's index (a tuple of slices, unhashable before Python 3.12) as a dict key."""
  return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


class HostCopy:
  """This process's shards of a train state, copied to host memory; each distinct shard once
  (a replicated leaf is one copy, not one per device)."""

  def __init__(self, state: dict):
    leaves, self.treedef = jax.tree_util.tree_flatten(state)
    self.leaves, self.nbytes = [], 0
    for x in leaves:
      shards = {}
      for s in x.addressable_shards:
        key = _index_key(s.index)
        if key not in shards:  # a copy: the step donates the device buffers it would view
          shards[key] = np.array(s.data, copy=True)
          self.nbytes += shards[key].nbytes
      self.leaves.append((x.shape, x.sharding, shards))

  def restore(self) -> dict:
    """The state again, on the devices and with the shardings it had."""
    out = []
    for shape, sharding, shards in self.leaves:
      kind = getattr(sharding, "memory_kind", None)  # an offloaded optimizer stays in host memory
      parts = [jax.device_put(shards[_index_key(index)], SingleDeviceSharding(d, memory_kind=kind))
               for d, index in sharding.addressable_devices_indices_map(shape).items()]
      out.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    return jax.tree_util.tree_unflatten(self.treedef, out)


class SpikeGuard:
  """train.spike_factor > 0: judges each step's loss and keeps the state to roll back to.

  A loss is high when it is above spike_factor x the median of the last spike_window losses
  (judged once 5 are known); spike_steps high losses in a row, or one non-finite loss or gradient
  norm, call for a rollback. The state is copied to host memory at every log step whose losses
  were all good (none high, none pending), since losses are fetched only there: a rollback returns
  to the last such step and drops every batch trained since, the spike's and those between.
  """

  def __init__(self, tc: jconfig.TrainConfig):
    self.factor, self.steps, self.window = tc.spike_factor, tc.spike_steps, tc.spike_window
    self.history: list[tuple[int, float]] = []  # (step, loss) of steps kept, oldest first
    self.high: list[int] = []  # steps of the current run of high losses
    self.copy: HostCopy | None = None
    self.good_step = 0  # the step `copy` holds
    self.good_t = 0.0  # perf_counter when it was taken
    self.rollbacks = 0

  def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
    """Takes one step's loss; the reason for a rollback, or None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      self.high.append(step)
      return f"loss {loss} and gradient norm {grad_norm}"
    recent = [l for _, l in self.history[-self.window:]]
    median = float(np.median(recent)) if len(recent) >= min(5, self.window) else math.inf
    self.history.append((step, loss))
    if loss > self.factor * median:
      self.high.append(step)
      if len(self.high) >= self.steps:
        return (f"loss {loss:.4g} > {self.factor:g} x running median {median:.4g} for "
                f"{len(self.high)} step{'s' if len(self.high) > 1 else ''}")
    else:
      self.high.clear()
    return None

  @property
  def clear(self) -> bool:
    """No high loss is waiting to be confirmed or cleared: the current state may be kept."""
    return not self.high

  def keep(self, step: int, state: dict, skipped: int) -> None:
    """Copies `state`, the state after `step`, whose losses were all good."""
    self.copy, self.good_step, self.good_t = HostCopy(state), step, time.perf_counter()
    self.skipped = skipped  # steps whose update was dropped, up to this one

  def roll_back(self) -> dict:
    """The kept state; forgets the losses of the steps rolled back."""
    self.rollbacks += 1
    self.high.clear()
    self.history = [(s, l) for s, l in self.history if s <= self.good_step]
    return self.copy.restore()
