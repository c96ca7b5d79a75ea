"""The loss-spike guard (train.spike_factor > 0, or `jaxpar.SpikeGuard` in a loop of your own):
judges each logged loss, keeps the last state a loss has judged good in host memory and rolls the
run back to it, skipping the batches since.
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class Kept:
  """A state copied to host memory: the state after `step`, with the run's count of skipped
  updates up to it, and when it was taken (perf_counter; `beside`: the loop's time beside the
  steps then, metrics.TimeSplit.beside_steps)."""
  step: int
  copy: HostCopy
  skipped: int = 0
  t: float = 0.0
  beside: float = 0.0


class SpikeGuard:
  """Judges each step's loss and keeps the state to roll back to.

  A loss is high when it is above `factor` x the median of the last `window` losses (judged once
  5 are known); `steps` high losses in a row, or one non-finite loss or gradient norm, call for a
  rollback. After `max_rollbacks` rollbacks the next spike stops the run (FloatingPointError).

  Step n's loss is computed with the parameters before update n: it judges the state after step
  n - 1, not the state update n made. So the guard holds two copies in host memory: `good`, a
  state a later loss has judged, and `candidate`, the newest state copied, which no loss has
  judged yet. At each log step whose losses were all good (none high, none pending) the candidate
  becomes good (the losses since judged it) and the newest state is copied as the candidate. A
  rollback returns to `good`, drops the candidate and every batch trained since: an update that
  harmed the state while its own loss looked normal is rolled back with the rest, never returned
  to. Until a first candidate is judged, `good` is the state the run started from.

  In a loop of your own (jaxpar.Trainer), `start` it with the state you begin from and call
  `watch` after each step (or every few: each call fetches the loss, a host sync):

    guard = jaxpar.SpikeGuard(factor=2.0)
    guard.start(step, state)
    while step < steps:
      state, metrics = trainer.step(state, next_batch())
      state, step = guard.watch(step + 1, state, metrics)  # the good step after a rollback
  """

  def __init__(self, factor: float, steps: int = 2, window: int = 100, max_rollbacks: int = 3):
    if not factor > 1 or steps < 1 or window < 1 or max_rollbacks < 0:
      raise ValueError(f"SpikeGuard(factor={factor}, steps={steps}, window={window}, "
                       f"max_rollbacks={max_rollbacks}): factor must be above 1, steps and window "
                       f"positive, max_rollbacks at least 0")
    self.factor, self.steps, self.window = factor, steps, window
    self.max_rollbacks = max_rollbacks
    self.history: list[tuple[int, float]] = []  # (step, loss) of steps kept, oldest first
    self.high: list[int] = []  # steps of the current run of high losses
    self.good: Kept | None = None
    self.candidate: Kept | None = None
    self.rollbacks = 0
    self.start_step: int | None = None  # the step of the state the run started from
    self.back_to: int | None = None  # the step the last rollback returned to
    self.finite = True  # whether the losses of the current run of high ones are all finite

  @classmethod
  def from_config(cls, tc: jconfig.TrainConfig) -> "SpikeGuard":
    return cls(tc.spike_factor, tc.spike_steps, tc.spike_window, tc.max_rollbacks)

  def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
    """Takes one step's loss; the reason for a rollback, or None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      self.high.append(step)
      self.finite = False
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
      self.finite = True
    return None

  @property
  def clear(self) -> bool:
    """No high loss is waiting to be confirmed or cleared: the current state may be kept."""
    return not self.high

  @property
  def good_step(self) -> int:
    """The step a rollback now returns to."""
    return self.good.step

  @property
  def nbytes(self) -> int:
    """Host memory the copies take (this process's shards, each once)."""
    return sum(k.copy.nbytes for k in (self.good, self.candidate) if k is not None)

  def start(self, step: int, state: dict, skipped: int = 0, beside: float = 0.0) -> None:
    """Copies the state the run starts from at `step`: where a rollback goes until a later state
    has been judged."""
    self.good = Kept(step, HostCopy(state), skipped, time.perf_counter(), beside)
    self.candidate = None
    self.start_step = step

  def keep(self, step: int, state: dict, skipped: int = 0, beside: float = 0.0) -> None:
    """At a log step whose losses were all good: the candidate (judged by those losses) becomes
    good, and `state`, the state after `step`, the new candidate."""
    if self.good is None:
      raise ValueError("SpikeGuard.keep before start: start(step, state) with the state the run "
                       "begins from first")
    if self.candidate is not None and self.candidate.step < step:
      self.good, self.candidate = self.candidate, None  # the old good's copy can go first
    self.candidate = Kept(step, HostCopy(state), skipped, time.perf_counter(), beside)

  def roll_back(self) -> Kept:
    """The good state's copy; forgets the candidate and the losses of the steps after it."""
    self.rollbacks += 1
    self.back_to = self.good.step
    self.finite = True
    self.high.clear()
    self.candidate = None
    self.history = [(s, l) for s, l in self.history if s <= self.good.step]
    return self.good

  def no_good_state(self, first: int) -> bool:
    """Whether a spike whose first high step is `first` shows that the good state is not good:
    right after a rollback to it, the first loss it gives (on other batches than before) is
    non-finite again, so rolling back to it once more would only repeat that."""
    return (not self.finite and self.back_to is not None and self.good is not None
            and self.back_to == self.good.step and first == self.good.step + 1)

  def should_stop(self, first: int) -> bool:
    """Whether a spike at `first` stops the run instead of rolling back."""
    return self.rollbacks >= self.max_rollbacks or self.no_good_state(first)

  def give_up(self, first: int, last: int, why: str, kept: str = "") -> FloatingPointError:
    """The error for a spike at steps first..last that is not rolled back (`should_stop`);
    `kept`: what the run's checkpoints hold, said after it."""
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    tail = f"; stopping without saving{f', {kept}' if kept else ''}"
    if self.no_good_state(first):
      g = self.good.step
      began = " (the state the run started from)" if g == self.start_step else ""
      return FloatingPointError(
          f"loss spike at {steps} ({why}) right after rolling back to step {g}: the state of "
          f"step {g}{began} gives a non-finite loss on other batches too, so the run holds no "
          f"good state to roll back to{tail}")
    return FloatingPointError(
        f"loss spike at {steps} ({why}) after {self.rollbacks} rollbacks, the most "
        f"train.max_rollbacks={self.max_rollbacks} allows{tail}")

  def watch(self, step: int, state: dict, metrics: dict) -> tuple[dict, int]:
    """For a loop of your own: judges the loss of `step` (metrics["loss"] and
    metrics["grad_norm"], as Trainer.step returns them; fetched from the devices here) and returns
    the state and step to go on from: (`state`, `step`), or after a spike the good state restored
    onto its devices and shardings and its step. Raises FloatingPointError past max_rollbacks."""
    if self.good is None:
      raise ValueError("SpikeGuard.watch before start: call start(step, state) with the state "
                       "your loop begins from")
    loss, grad_norm = (float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"])))
    why = self.judge(step, loss, grad_norm)
    if why is not None:
      if self.should_stop(self.high[0]):
        raise self.give_up(self.high[0], step, why)
      good = self.roll_back()
      return good.copy.restore(), good.step
    if self.clear:
      self.keep(step, state)
    return state, step
