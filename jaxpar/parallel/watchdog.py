"""The stall watchdog: ends a process whose training loop makes no progress, naming the process
that stopped answering, and the heartbeat each process keeps in JAX's coordination service so that
the others can tell a stopped or dead process from a slow one.
"""
from __future__ import annotations

import os
import sys
import threading
import time

EXIT_FAILED = 1  # the processes could not be joined, or lost one another
DEFAULT_HEARTBEAT_TIMEOUT = 100  # JAX's coordination service gives up on a silent process then
STALL_SENTENCE = "stopped answering"  # launch_local.py reads the process named before it
_ALIVE = "jaxpar/alive/"  # key prefix in JAX's coordination service: one counter per process
_BEAT_S = 1.0  # how often each process's thread bumps its counter
_PEERS_AFTER_S = 2.0  # a wait marked `peers` reads the others' counters from this long on, every beat
DEFAULT_PEER_TIMEOUT_S = 60.0  # train.peer_timeout = 0: below DEFAULT_HEARTBEAT_TIMEOUT


_heartbeat: threading.Thread | None = None
_stop_beating = threading.Event()


def start_heartbeat(me: int) -> None:
  """From now until JAX shuts the coordination service's client down, a thread bumps this
  process's counter in its store every second (once per process; no-op for one process). It
  beats whatever the main thread waits in, so a counter that stands still means a stopped or dead
  process, never one between its watched parts or past its loop (e.g. closing its checkpointer,
  or at JAX's shutdown barrier, while another still saves). `me`: this process's index.

  JAX's exit handler shuts the client down; right after that the thread is stopped and joined
  (`_stop_after`), before Python finalizes: a daemon thread that comes back from the client's C++
  call while the interpreter finalizes aborts the process ("FATAL: exception not rethrown") after
  a run that finished well."""
  global _heartbeat
  from jax._src import distributed as jd  # the coordination service's key-value store
  client = jd.global_state.client
  if _heartbeat is not None or client is None:
    return

  def beat():
    n = 0
    while not _stop_beating.is_set():
      n += 1
      try:
        client.key_value_set(f"{_ALIVE}{me}", str(n), allow_overwrite=True)
      except Exception:  # the coordinator is gone: the watchdog names it
        return
      _stop_beating.wait(_BEAT_S)

  _stop_beating.clear()
  _heartbeat = threading.Thread(target=beat, name="jaxpar-alive", daemon=True)
  _heartbeat.start()
  _stop_after(jd.global_state)


def _stop_after(state) -> None:
  """`state.shutdown` (JAX's distributed state, which its exit handler and
  jax.distributed.shutdown call) followed by stopping and joining the heartbeat."""
  shutdown = state.shutdown

  def shutdown_then_stop():
    try:
      shutdown()
    finally:
      stop_heartbeat()
  state.shutdown = shutdown_then_stop


def stop_heartbeat() -> None:
  """Stops the heartbeat thread and waits for it (at most a few beats: a call to a client that
  was shut down returns at once)."""
  global _heartbeat
  _stop_beating.set()
  if _heartbeat is not None:
    _heartbeat.join(timeout=5 * _BEAT_S)
    _heartbeat = None


def stall_limits(tc, measured_gap: float | None) -> tuple[float, float]:
  """(limit for the first step, which holds the compile and the first collectives; limit for
  later steps): train.first_step_timeout and train.stall_timeout, or where 0 their defaults,
  900 s and the larger of 60 s and 10x the longest wait between two steps seen so far."""
  first = tc.first_step_timeout or 900.0
  later = tc.stall_timeout or max(60.0, 10.0 * (measured_gap or 0.0))
  return first, later


def peer_timeout(tc) -> float:
  """How long a peer's heartbeat must stand still before a long wait ends early for it:
  train.peer_timeout, or DEFAULT_PEER_TIMEOUT_S where 0."""
  return getattr(tc, "peer_timeout", 0.0) or DEFAULT_PEER_TIMEOUT_S


class Watchdog:
  """Ends the process when the training loop makes no progress for longer than its limit.

  The loop calls `at(step, what)` whenever it moves on (to the next batch, step, collective,
  metrics fetch, save). A thread checks that the last call is not older than the limit: the
  first-step limit until `first_step_done()` and for saves and evaluations, else the steady one.
  Past it, this process writes what it waits in and every thread's Python stack (faulthandler)
  to stderr, then one sentence naming the processes that stopped answering, and exits 1.

  Which processes stopped answering: each process's own thread bumps a counter in JAX's
  coordination service every second, whatever its main thread waits in; a process whose counter
  does not move while this one watches (3 s) is stopped or gone. A process blocked in the same
  collective as this one still counts, so only the culprit is named. With one process there is
  nobody else to blame and the sentence says where the step waits.

  A wait marked `peers` (a checkpoint's save: orbax meets the other processes at barriers of the
  coordination service, which notices a dead process only at its heartbeat timeout) reads the
  others' counters from 2 s into it, as does any wait past the steady limit (a long evaluation,
  the first step), and ends before the limit once a process's counter has stood still for
  train.peer_timeout (60 s by default): a peer paused for less (swap, a VM migration) is waited
  for, and one dead is named before the coordination service aborts everyone.
  """

  def __init__(self, tc, log_every: int):
    self.tc, self.log_every = tc, log_every
    self.step, self.what, self.t = 0, "starting", time.monotonic()
    self.first, self.slow, self.peers = True, False, False
    self.longest = 0.0  # the longest wait between two calls after the first step
    self.peer_timeout = peer_timeout(tc)
    self.seen: dict[int, tuple[str | None, float]] = {}  # process -> (counter, when it moved)

  def at(self, step: int, what: str, slow: bool = False, peers: bool = False) -> None:
    """The loop moved on to `what` for `step`; `slow` (saves, evals): the first-step limit;
    `peers`: a wait on the other processes outside the step's collectives (see the class)."""
    now = time.monotonic()
    if not self.first and not self.slow:
      self.longest = max(self.longest, now - self.t)
    self.step, self.what, self.slow, self.peers, self.t = step, what, slow, peers, now

  def first_step_done(self) -> None:
    self.first = False
    self.t = time.monotonic()

  def limit(self) -> float:
    first, later = stall_limits(self.tc, self.longest)
    return first if self.first or self.slow else later

  def __enter__(self):
    """Starts watching (again): the compile is watched, and then the loop."""
    import jax
    self._stop = threading.Event()
    self.t = time.monotonic()
    self.pi, self.pc = jax.process_index(), jax.process_count()
    self.client = None
    if self.pc > 1:
      from jax._src import distributed as jd  # the coordination service's key-value store
      self.client = jd.global_state.client
      # initialize() started it; processes joined by the user's own jax.distributed.initialize
      # start it here
      start_heartbeat(self.pi)
    self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    # Out of any read of the coordination service before the process goes on to its end: a
    # daemon thread still inside that C++ call when Python finalizes aborts the process
    # ("FATAL: exception not rethrown").
    self._thread.join(timeout=5.0)

  def _counters(self) -> dict[int, str]:
    return {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(_ALIVE)}

  def _silent(self) -> list[int] | None:
    """Processes whose counter did not move over 3 beats; None if the store did not answer."""
    result: list = []

    def probe():
      before = self._counters()
      time.sleep(3 * _BEAT_S)
      after = self._counters()
      result.append(sorted(p for p in range(self.pc)
                           if p != self.pi and before.get(p) == after.get(p)))

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(6 * _BEAT_S)
    return result[0] if result else None

  def _still(self) -> list[int] | None:
    """Processes whose counter has not moved for train.peer_timeout, by this and earlier reads
    (a counter first read, or moved since the last read, moved now: a silence is never counted
    from before it was seen); None if the store did not answer."""
    try:
      counters = self._counters()
    except Exception:  # noqa: BLE001 (the coordinator is gone: the limit names it)
      return None
    now, still = time.monotonic(), []
    for p in range(self.pc):
      if p == self.pi:
        continue
      value = counters.get(p)
      last = self.seen.get(p)
      if last is None or last[0] != value:
        self.seen[p] = (value, now)
      elif now - last[1] >= self.peer_timeout:
        still.append(p)
    return still

  def _watch(self) -> None:
    probed = 0.0  # when the others' counters were last read during a long wait
    while not self._stop.wait(0.5):
      t = self.t
      waited, limit = time.monotonic() - t, self.limit()
      if waited > limit:
        self._fire(waited, limit, self._who())
      # A save, an evaluation or the first step may take long, but not because a peer stopped:
      # past the steady limit (a wait on the peers: past 2 s), read the others' counters every
      # beat and stop once one has stood still for train.peer_timeout.
      later = stall_limits(self.tc, self.longest)[1]
      early = self.peers and waited > _PEERS_AFTER_S
      if (self.client is not None and (early or waited > later)
          and time.monotonic() - probed >= _BEAT_S):
        probed = time.monotonic()
        still = self._still()
        if still and self.t == t:
          who = "process" + ("es " if len(still) > 1 else " ") + ", ".join(map(str, still))
          self._fire(time.monotonic() - t, later, who, silent=True)

  def _who(self) -> str | None:
    """'process 1' (or 'processes 1, 3') that stopped answering; None if all answer or alone."""
    if self.client is None:
      return None
    silent = self._silent()
    if silent is None:
      return "process 0, which runs the coordinator," if self.pi != 0 else None
    if silent:
      return "process" + ("es " if len(silent) > 1 else " ") + ", ".join(map(str, silent))
    return None

  def _fire(self, waited: float, limit: float, who: str | None, silent: bool = False) -> None:
    """Stacks, then one sentence, then exit 1. `silent`: ended before the limit, because `who`
    stopped answering during a wait on the peers."""
    import faulthandler
    step, what = self.step, self.what
    sys.stdout.flush()
    print(f"jaxpar watchdog: process {self.pi} of {self.pc} made no progress for {waited:.0f} s "
          f"at step {step}, waiting in: {what}; Python stacks of its threads follow",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    limit_text = f"the watchdog's limit of {limit:.0f} s"
    if who and silent:
      text = (f"{who} {STALL_SENTENCE}: step {step} made no progress for {waited:.0f} s (its "
              f"heartbeat stood still for train.peer_timeout={self.peer_timeout:g} s while this "
              f"process waited in: {what}); stopping, the last complete checkpoint is kept: "
              f"restart all processes to resume")
    elif who:
      text = (f"{who} {STALL_SENTENCE}: step {step} made no progress for {waited:.0f} s "
              f"({limit_text}); stopping, the last complete checkpoint is kept: restart all "
              f"processes to resume")
    elif self.pc > 1:
      text = (f"step {step} made no progress for {waited:.0f} s ({limit_text}) while every "
              f"process still answers, waiting in: {what}; stopping, the last complete "
              f"checkpoint is kept")
    else:
      text = (f"step {step} made no progress for {waited:.0f} s ({limit_text}), waiting in: "
              f"{what}; stopping, the last complete checkpoint is kept (the stacks above show "
              f"where it hangs)")
    print(f"error: {text}", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)
