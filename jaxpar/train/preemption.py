"""Stopping on request: SIGTERM / SIGINT end a run after a step, with a checkpoint, and every
process of a multi-process run stops at the same step (`StopVote`). The commands' signal latch
(`Interrupted`, raised before the training loop takes the signals over) lives here too, so the
loop can ask for a signal that reached startup but was lost there.
"""
from __future__ import annotations

import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Interrupted(BaseException):
  """SIGINT or SIGTERM before the training loop took them over (it stops after a step, saving)."""

  def __init__(self, sig: signal.Signals):
    super().__init__(sig)
    self.signal = sig


_pending: list[signal.Signals] = []  # signals raised as Interrupted, in case one was swallowed


def pending_interrupt() -> signal.Signals | None:
  """A signal guard's handler took but whose Interrupted may have been lost: Python drops an
  exception raised while it runs a garbage-collection callback, so the loop asks here too."""
  return _pending[-1] if _pending else None


def _interrupt(signum, frame):
  """The commands' handler before the training loop (commands/cli.py's guard)."""
  _pending.append(signal.Signals(signum))
  raise Interrupted(signal.Signals(signum))


def forget_interrupts() -> None:
  _pending.clear()


class StopFlag:
  """SIGTERM / SIGINT ask the loop to finish the current step, checkpoint and exit cleanly."""

  def __init__(self):
    self.requested: signal.Signals | None = None
    self._old = {}

  def __enter__(self):
    self.requested = pending_interrupt()  # a signal that reached startup but was lost there
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    self.requested = signal.Signals(signum)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


class StopVote:
  """Agrees across processes on when to stop: a signal may reach only some of them.

  After every step each process puts its requested signal (0: none) on its devices, and a jitted
  all-gather over `mesh` (one int32 per device) replicates everyone's. The result is read one step
  later: by then it has finished behind the previous step, so the host waits only for that step,
  with the next one already queued, and never for the step just dispatched. Every process reads
  the same exchange after the same step, so all stop there and save together. Checking every
  step costs one tiny collective beside the step's own, and acts on a signal within two steps.
  """

  def __init__(self, mesh):
    self.owners = [d.process_index for d in mesh.devices.flat]  # process of each element
    self.sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))  # element i on devices.flat[i]
    self.gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    self.pending = None  # the exchange sent after the previous step

  def _send(self, value: int) -> jax.Array:
    mine = np.array([value], np.int32)
    return self.gather(jax.make_array_from_callback((len(self.owners),), self.sharding,
                                                    lambda _: mine))

  def __call__(self, local: signal.Signals | None) -> dict[int, signal.Signals]:
    """Sends `local`; returns {process: signal} of the processes that asked one exchange ago."""
    seen, self.pending = self.pending, self._send(int(local or 0))
    if seen is None:
      return {}
    return {p: signal.Signals(int(s)) for p, s in zip(self.owners, np.asarray(seen)) if s}

  def until_saved(self, saving) -> None:
    """Returns once no process has a save in flight (`saving()`: this process's).

    orbax would wait too, at a barrier of JAX's coordination service, which notices a dead process
    only from half its heartbeat timeout on (200 s by default) and then aborts this one with a C++
    stack trace. This exchange is a collective: a dead process fails it at once, as a lost peer. Every
    process sees the same answers, so all make the same exchanges.
    """
    while np.asarray(self._send(int(saving()))).any():
      time.sleep(0.02)


def say_stopped(asked: dict[int, signal.Signals], own: signal.Signals | None, step: int,
                 log) -> None:
  """Says why this process stopped at `step`: through `log`, or to stderr where that is None.

  Every process says it, not only the main one that logs: the signal may have reached any of them.
  """
  saved = f"saved a checkpoint at step {step}; run again to resume"
  pi = jax.process_index()
  if jax.process_count() == 1:
    text = f"received {asked[pi].name}: {saved}"
  elif own is not None:
    text = f"process {pi} received {own.name}: {saved}"
  else:
    first = min(asked)
    text = (f"process {pi} stops at step {step} because process {first} received "
            f"{asked[first].name}: {saved}")
  if log is None:
    print(text, file=sys.stderr, flush=True)
  else:
    log(text)
