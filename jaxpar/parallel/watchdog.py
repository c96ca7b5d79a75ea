"""The stall watchdog: ends a process whose training loop makes no progress, naming the process
that stopped answering, and the heartbeat each process keeps in JAX's coordination service so that
the others can tell a stopped or dead process from a slow one.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time

from jaxpar.config import ConfigError

EXIT_FAILED = 1  # the processes could not be joined, or lost one another
# JAX's coordination service (jax.distributed.initialize's heartbeat_timeout_seconds, JAX's own
# default 100 s) declares a process dead once its last heartbeat is this old and aborts the others
# (SIGABRT, a C++ stack trace, exit 134). Its client beats every half of it (XLA's coordination
# service agent), so a process that stops is declared dead between a half and the whole of it
# after it stopped: from 50 s on at JAX's default, whatever the load. jaxpar raises it to 200 s,
# so a pause of tens of seconds (swap, a VM migration) outlasts no heartbeat and jaxpar's own
# watchdog, reading its own 1 s heartbeats, names a stopped process first.
DEFAULT_HEARTBEAT_TIMEOUT = 200
JAX_HEARTBEAT_TIMEOUT = 100  # jax.distributed.initialize's default, for processes it joined itself
PEER_SHARE = 0.3  # train.peer_timeout = 0: this share of the heartbeat timeout (60 s of 200 s)
PEER_SHARE_MAX = 0.4  # train.peer_timeout at most this share: 80% of JAX's earliest abort
STALL_SENTENCE = "stopped answering"  # launch_local.py reads the process named before it
_ALIVE = "jaxpar/alive/"  # key prefix in JAX's coordination service: one counter per process
_BEAT_S = 1.0  # how often each process's thread bumps its counter

_heartbeat: threading.Thread | None = None
_stop_beating = threading.Event()
_jax_heartbeat_s: float = JAX_HEARTBEAT_TIMEOUT  # what jax.distributed.initialize was given


def start_heartbeat(me: int, jax_heartbeat_s: float | None = None) -> None:
  """From now until JAX shuts the coordination service's client down, a thread bumps this
  process's counter in its store every second (once per process; no-op for one process). It
  beats whatever the main thread waits in, so a counter that stands still means a stopped or dead
  process, never one between its watched parts or past its loop (e.g. closing its checkpointer,
  or at JAX's shutdown barrier, while another still saves). `me`: this process's index;
  `jax_heartbeat_s`: the heartbeat timeout JAX was given (JAX's default where not said).

  JAX's exit handler shuts the client down; right after that the thread is stopped and joined
  (`_stop_after`), before Python finalizes: a daemon thread that comes back from the client's C++
  call while the interpreter finalizes aborts the process ("FATAL: exception not rethrown") after
  a run that finished well."""
  global _heartbeat, _jax_heartbeat_s
  from jax._src import distributed as jd  # the coordination service's key-value store
  if jax_heartbeat_s is not None:
    _jax_heartbeat_s = jax_heartbeat_s
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


def peer_timeout(tc, jax_heartbeat_s: float | None = None) -> float:
  """How long a peer's heartbeat must stand still before the wait ends for it:
  train.peer_timeout, or where 0 PEER_SHARE of JAX's heartbeat timeout (`jax_heartbeat_s`, by
  default the one this process joined with): 60 s of jaxpar's 200 s."""
  jax_s = _jax_heartbeat_s if jax_heartbeat_s is None else jax_heartbeat_s
  return getattr(tc, "peer_timeout", 0.0) or PEER_SHARE * jax_s


def check_peer_timeout(tc, jax_heartbeat_s: float) -> None:
  """ConfigError unless train.peer_timeout names a stopped process before JAX's coordination
  service can abort the others for it (from half of its heartbeat timeout on)."""
  most = PEER_SHARE_MAX * jax_heartbeat_s
  if tc.peer_timeout > most:
    raise ConfigError(
        f"train.peer_timeout={tc.peer_timeout:g} must be at most {most:g} s with a heartbeat "
        f"timeout of {jax_heartbeat_s:g} s (--heartbeat-timeout): JAX's coordination service "
        f"aborts every process for a silent one from {jax_heartbeat_s / 2:g} s on, and the "
        f"watchdog must name it first; lower train.peer_timeout (0: {PEER_SHARE * jax_heartbeat_s:g} s) "
        f"or raise --heartbeat-timeout")


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

  Whatever it waits in (a step's collectives, one of orbax's barriers in a save, an evaluation,
  the first step), the thread reads the others' counters every beat and the wait ends before
  its limit once a process's counter has stood still for train.peer_timeout (by default 0.3 of
  JAX's heartbeat timeout, 60 s of 200 s; at most 0.4 of it): a peer paused for less (swap, a
  VM migration) is waited for, and one stopped or dead is named before JAX's coordination
  service, which declares it dead from half its heartbeat timeout on, aborts everyone.
  """

  def __init__(self, tc, log_every: int):
    self.tc, self.log_every = tc, log_every
    self.step, self.what, self.t = 0, "starting", time.monotonic()
    self.first, self.slow = True, False
    self.longest = 0.0  # the longest wait between two calls after the first step
    self.peer_timeout = peer_timeout(tc)
    self.seen: dict[int, tuple[str | None, float]] = {}  # process -> (counter, when it moved)

  def at(self, step: int, what: str, slow: bool = False) -> None:
    """The loop moved on to `what` for `step`; `slow` (saves, evals): the first-step limit."""
    now = time.monotonic()
    if not self.first and not self.slow:
      self.longest = max(self.longest, now - self.t)
    self.step, self.what, self.slow, self.t = step, what, slow, now

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
    self.peer_timeout = peer_timeout(self.tc)  # the heartbeat timeout JAX was given is known now
    self.client = None
    if self.pc > 1:
      from jax._src import distributed as jd  # the coordination service's key-value store
      self.client = jd.global_state.client
      # initialize() started it; processes joined by the user's own jax.distributed.initialize
      # start it here
      start_heartbeat(self.pi)
    self._reader = None
    self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    # Out of any read of the coordination service before the process goes on to its end: a
    # daemon thread still inside that C++ call when Python finalizes aborts the process
    # ("FATAL: exception not rethrown").
    self._thread.join(timeout=5.0)
    if self._reader is not None:
      self._reader.join(timeout=5.0)

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

  def _read(self) -> None:
    """Reads the others' counters every beat into `seen` (process -> (counter, when it was
    first read at that value): a silence is never counted from before it was seen) and the time
    of the last read answered into `read_at`, until stopped or the store fails."""
    while True:
      try:
        counters = self._counters()
      except Exception:  # noqa: BLE001 (the coordinator is gone: the limit names it)
        return
      now = time.monotonic()
      for p in range(self.pc):
        value = counters.get(p)
        if p != self.pi and (p not in self.seen or self.seen[p][0] != value):
          self.seen[p] = (value, now)
      self.read_at = now
      if self._stop.wait(_BEAT_S):
        return

  def _still(self) -> str | None:
    """Who has not answered for train.peer_timeout: the processes whose counter stood still that
    long by the reads so far, or process 0, which runs the store, when no read has been answered
    that long; None if all answer."""
    now = time.monotonic()
    if self.pi != 0 and now - max(self.read_at, self.watch_t) >= self.peer_timeout:
      return "process 0, which runs the coordinator,"
    still = [p for p, (_, t) in sorted(self.seen.items())
             if p != self.pi and self.read_at - t >= self.peer_timeout]
    return ("process" + ("es " if len(still) > 1 else " ") + ", ".join(map(str, still))
            if still else None)

  def _watch(self) -> None:
    self.watch_t, self.read_at = time.monotonic(), -math.inf
    if self.client is not None:
      self._reader = threading.Thread(target=self._read, name="jaxpar-peers", daemon=True)
      self._reader.start()
    while not self._stop.wait(0.5):
      t = self.t
      waited, limit = time.monotonic() - t, self.limit()
      if waited > limit:
        self._fire(waited, limit, self._who())
      # A wait may take long, but not because a peer stopped: the others' counters are read
      # every beat (one read of the coordination service's store a second, whatever the loop
      # does, so a silence is timed from its start) and the wait stops once one has stood still
      # for train.peer_timeout, before JAX's coordination service gives up on it (in orbax's
      # barriers a signal does not reach Python, and the limit may lie past JAX's).
      who = self._still() if self.client is not None else None
      if who and self.t == t:
        self._fire(time.monotonic() - t, stall_limits(self.tc, self.longest)[1], who, silent=True)

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
    """Stacks, then one sentence, then exit 1. `silent`: ended before the limit, because `who`'s
    heartbeat stood still for train.peer_timeout."""
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
