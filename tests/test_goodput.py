"""Goodput: loss spikes rolled back, the wall time split in the summary, a stalled step that ends
the job (the compiled step from the cache and the step store: test_step_store.py).

The subprocess runs use a tiny model and their own cache folder (never the session's, so no
other test's compiles decide a hit or a miss here).
"""
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import FAST_XLA
from output_fields import undocumented

from jaxpar import config
from jaxpar.parallel import watchdog
from jaxpar.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")
PLAN = str(ROOT / "scripts" / "plan.py")
FAST_COMPILE = FAST_XLA  # conftest's: compiled as the rest of the suite compiles
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=4", "data.source=synthetic",
        "train.log_every=1", "train.steps=3", "data.workers=0"]


def child_env():
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_", "PMI_", "JAX_COMPILATION_CACHE",
                              "JAX_PERSISTENT_CACHE"))}
  # No cache unless a test names one (train.compile_cache wins over the environment): never the
  # user's own, ~/.cache/jaxpar/xla, the default on the CPU too.
  env.update({"XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
              "JAXPAR_COMPILE_CACHE": "off"})
  return env


def run(args, timeout=180):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                        env=child_env(), cwd=ROOT)


def records(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


# -- loss spikes ------------------------------------------------------------------------------------

SPIKE = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
         "model.seq_len=16", "train.batch_size=8", "data.source=synthetic", "train.log_every=1",
         "train.lr=0.01", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "data.workers=0"]
BAD = (10, 11)  # data positions of the bad window: steps 11 and 12


def batch(i: int) -> np.ndarray:
  """Batch `i`: rows counting up through 32 tokens from their own offsets (quickly learnt), or
  at a bad position random high tokens the model has learnt never to expect."""
  if i < 0:
    return np.full((8, 17), 128 + i % 128, np.int32)
  rows = (np.arange(8)[:, None] * 5 + i * 3 + np.arange(17)[None, :]) % 32 + 64
  return rows.astype(np.int32)


class Scripted:
  """A loader that serves batch(ids[position]); its state is the position."""

  def __init__(self, ids):
    self.ids, self.position = list(ids), 0
    self.element_spec = {"tokens": ((8, 17), np.dtype(np.int32))}
    self.steps_per_epoch = len(self.ids)

  def next(self):
    self.position += 1
    return {"tokens": batch(self.ids[self.position - 1])}

  def state(self):
    return {"epoch": 0, "position": self.position}

  def restore(self, state):
    self.position = state["position"]

  def close(self):
    pass


def scripted_run(monkeypatch, workdir, ids, steps, *overrides, metrics=None):
  import jaxpar.data
  loader = Scripted(ids)
  monkeypatch.setattr(jaxpar.data, "make_loader", lambda *a, **k: loader)
  logged = []
  cfg = config.load(None, SPIKE + list(overrides))
  result = loop.run(cfg, (8, 1, 1), str(workdir), metrics, steps=steps, progress=False,
                    log=logged.append)
  return result, logged, loader


def test_a_loss_spike_rolls_back_and_trains_as_if_its_batches_were_never_there(tmp_path,
                                                                                monkeypatch):
  # Steps 11 and 12 train on the bad window. Step 11's loss, high, was computed with the state
  # after step 10, which no good loss has judged: the guard goes back to step 9 and skips the
  # batches of steps 10-12, the window's and the one before it.
  ids = [i if i not in BAD else -i for i in range(40)]
  guard = ["train.spike_factor=1.5", "train.spike_steps=2", "train.spike_window=4"]
  m = tmp_path / "m.jsonl"
  got, logged, loader = scripted_run(monkeypatch, tmp_path / "spiked", ids, 16, *guard,
                                     metrics=str(m))
  line = [l for l in logged if l.startswith("loss spike")]
  assert line == [l for l in line if "steps 11-12" in l and "rolled back to step 9 and skipped "
                  "the batches of steps 10-12 (rollback 1 of at most 3)" in l] and len(line) == 1, logged
  assert got.summary["rollbacks"] == 1 and got.summary["rollback_copy_bytes"] > 0
  assert got.summary["time_s"]["rollback"] > 0  # three steps thrown away, a restore, the copies
  assert loader.position == 19  # 16 steps trained, 3 batches skipped
  from jaxpar.train import checkpoint
  assert checkpoint.read_extra(str(tmp_path / "spiked" / "checkpoints"), 16)["data"] == {
      "epoch": 0, "position": 19}  # a resume goes on after the window, not through it
  # Every step that ran has its row, once per run of it; the one that called the rollback is
  # marked, and the steps after the good one appear again as they are trained again.
  rows = [r for r in records(m) if not r.get("final")]
  assert [(r["step"], r.get("spike")) for r in rows] == (
      [(s, None) for s in range(1, 12)] + [(12, 1)] + [(s, None) for s in range(10, 17)])

  clean = [i for i in ids if i >= 0 and i != 9]
  ref, _, _ = scripted_run(monkeypatch, tmp_path / "clean", clean, 16)
  assert sorted(got.losses) == sorted(ref.losses) == list(range(1, 17))
  for step in ref.losses:
    assert abs(got.losses[step] - ref.losses[step]) <= 1e-6 * abs(ref.losses[step]), step
  for a, b in zip(jax.tree_util.tree_leaves(got.state["params"]),
                  jax.tree_util.tree_leaves(ref.state["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def poison_update_of_step(monkeypatch, n: int) -> None:
  """Step `n`'s update multiplies every parameter by 50 after the step: its own loss (computed
  before the update) is normal, the next one is not."""
  from jaxpar.train import step as jstep
  lower = jstep.Trainer.lower

  class Poisoned:
    def __init__(self, compiled):
      self.compiled, self.calls = compiled, 0

    def __call__(self, state, batch):
      state, metrics = self.compiled(state, batch)
      self.calls += 1
      if self.calls == n:
        state = {**state, "params": jax.tree_util.tree_map(lambda p: p * 50, state["params"])}
      return state, metrics

    def __getattr__(self, name):
      return getattr(self.compiled, name)

  class Lowered:
    def __init__(self, lowered):
      self.lowered = lowered

    def compile(self):
      return Poisoned(self.lowered.compile())

  monkeypatch.setattr(jstep.Trainer, "lower", lambda self, *a: Lowered(lower(self, *a)))


def test_an_update_that_harms_the_state_while_its_own_loss_is_normal_is_rolled_back(tmp_path,
                                                                                  monkeypatch):
  # Update 8 harms the state, but step 8's loss is computed before it and looks normal; step 9's
  # is far too high. A guard that had kept the state after step 8 (its losses were all good)
  # would return to the harm and spike again until max_rollbacks stops the run.
  poison_update_of_step(monkeypatch, 8)
  ids = list(range(40))
  got, logged, loader = scripted_run(monkeypatch, tmp_path / "wd", ids, 16,
                                     "train.spike_factor=1.5", "train.spike_steps=1",
                                     "train.spike_window=4", "train.max_rollbacks=1")
  line = [l for l in logged if l.startswith("loss spike")]
  assert len(line) == 1 and "loss spike at step 9 " in line[0] and (
      "rolled back to step 7 and skipped the batches of steps 8-9" in line[0]), logged
  assert got.summary["rollbacks"] == 1 and loader.position == 18
  assert all(np.isfinite(v) for v in got.losses.values()) and got.steps == 16
  assert max(got.losses[s] for s in range(9, 17)) < 2 * got.losses[7]


def test_spikes_beyond_max_rollbacks_stop_the_run_in_one_sentence(tmp_path, monkeypatch):
  ids = [i if i not in BAD else -i for i in range(40)]
  with pytest.raises(FloatingPointError, match=r"^loss spike at steps 11-12 \(loss .* after 0 "
                     r"rollbacks, the most train.max_rollbacks=0 allows; stopping without saving"):
    scripted_run(monkeypatch, tmp_path / "wd", ids, 16, "train.spike_factor=1.5",
                 "train.spike_steps=2", "train.spike_window=4", "train.max_rollbacks=0")


# -- goodput ----------------------------------------------------------------------------------------

def test_the_summary_splits_the_wall_time_and_reports_goodput(tmp_path):
  cfg = config.load(None, SPIKE + ["train.eval_every=2", "train.eval_steps=1", "checkpoint.every=2",
                                   "train.spike_factor=3"])  # the guard's fields in the summary
  metrics = tmp_path / "m.jsonl"
  logged = []
  result = loop.run(cfg, (8, 1, 1), str(tmp_path / "wd"), str(metrics), steps=4, progress=False,
                    log=logged.append)
  s = result.summary
  parts = s["time_s"]
  assert set(parts) == {"startup", "compile", "steps", "input_wait", "checkpoint", "eval",
                        "rollback"}
  assert all(v >= 0 for v in parts.values()), parts
  assert parts["steps"] > 0 and parts["eval"] > 0 and parts["checkpoint"] > 0
  assert parts["compile"] == s["compile_s"] and s["compile_cache"] in ("hit", "miss")
  # Every part is timed on its own; only the summary's own arithmetic is outside them.
  assert abs(sum(parts.values()) - s["wall_s"]) <= 0.05 * s["wall_s"] + 0.2, (parts, s["wall_s"])
  assert s["goodput"] == pytest.approx(parts["steps"] / s["wall_s"])
  final = records(metrics)[-1]
  assert final["final"] and final["time_s"] == pytest.approx(parts) and final["goodput"] == s["goodput"]
  line = [l for l in logged[-1].splitlines() if l.startswith("time: wall ")]
  assert len(line) == 1 and f"compile {parts['compile']:.3g} (cache {s['compile_cache']})" in line[0]
  assert line[0].endswith(f"goodput {100 * s['goodput']:.1f}%")
  # docs/output.md names every field and line this run (eval, spike guard, goodput) writes
  assert undocumented(records(metrics), logged[-1]) == []
  # The last evaluation's figures (after step 4), as the metrics row of step 4 has them
  row = [r for r in records(metrics) if r.get("step") == 4 and not r.get("final")][-1]
  assert s["eval_step"] == 4 and s["eval_loss"] == row["eval_loss"] == final["eval_loss"]
  assert f"eval: loss {row['eval_loss']:.4g} (after step 4)" in logged[-1].splitlines(), logged[-1]


# -- a stalled step ---------------------------------------------------------------------------------

HANG = """
import runpy, sys, threading
import jaxpar.data
real = jaxpar.data.make_loader

def make_loader(*args, **kwargs):
  loader, calls = real(*args, **kwargs), [0]
  next_batch = loader.next
  def next():
    calls[0] += 1
    if calls[0] == 3:  # the batch of step 3 never comes
      threading.Event().wait()
    return next_batch()
  loader.next = next
  return loader

jaxpar.data.make_loader = make_loader
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_single_process_whose_step_hangs_dumps_its_stacks_and_exits_in_one_sentence(tmp_path):
  r = run(["-c", HANG, TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd"),
           "--no-progress", "--set", *TINY, "train.steps=10", "train.stall_timeout=2"])
  assert r.returncode == 1, r.stderr
  err = r.stderr.strip().splitlines()
  assert "process 0 of 1 made no progress for" in r.stderr
  assert "at step 3, waiting in: reading the batch of step 3" in r.stderr
  assert "in next" in r.stderr  # the stack of the main thread, down to the loader
  assert err[-1].startswith("error: step 3 made no progress for "), err[-1]
  assert "(the watchdog's limit of 2 s), waiting in: reading the batch of step 3" in err[-1]


LAUNCH = str(ROOT / "scripts" / "launch_local.py")


def test_a_stopped_peer_is_named_by_the_others_and_the_launcher_and_the_run_resumes(tmp_path):
  import signal
  metrics, out_file, err_file = tmp_path / "m.jsonl", tmp_path / "out", tmp_path / "err"
  cmd = [sys.executable, LAUNCH, "--processes", "2", "--", TRAIN, "--mesh", "2x1x1",
         "--workdir", str(tmp_path / "wd"), "--metrics-file", str(metrics), "--no-progress",
         "--set", *TINY, "train.steps=12", "checkpoint.every=2", "train.stall_timeout=6",
         "train.peer_timeout=4", "train.warmup_steps=0"]
  with open(out_file, "w") as out, open(err_file, "w") as err:
    p = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=ROOT)
  try:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
      complete = [d for d in (tmp_path / "wd" / "checkpoints").glob("*") if d.name.isdigit()]
      if complete and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
        break  # stopped mid-run, with a checkpoint to resume
      time.sleep(0.01)
    assert p.poll() is None, err_file.read_text()
    pid = re.search(r"process 1 as pid (\d+)", err_file.read_text())
    os.kill(int(pid[1]), signal.SIGSTOP)
    t0 = time.monotonic()
    p.wait(timeout=120)
    elapsed = time.monotonic() - t0
  finally:
    if p.poll() is None:
      p.kill()
  err = err_file.read_text()
  # The limit (6 s), the probe of who still answers (3 s), and start-up noise on a busy machine.
  assert p.returncode == 1 and elapsed < 40, (elapsed, err)
  assert "[0] jaxpar watchdog: process 0 of 2 made no progress for" in err
  rank0 = [l for l in err.splitlines() if l.startswith("[0] error:")]
  # (stopped for train.peer_timeout=4 s, it is named sooner than the limit, in its own words)
  assert len(rank0) == 1 and "error: process 1 stopped answering: " in rank0[0], err
  launcher = [l for l in err.splitlines() if l.startswith("[launcher] process 1 stopped answering")]
  assert len(launcher) == 1 and "said process 0" in launcher[0], err
  assert "process 1 ended with signal SIGKILL" in launcher[0], err

  r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert re.search(r"\[0\] resuming from the checkpoint at step \d+ ", r.stdout), r.stdout
  assert "[0] steps: 12" in r.stdout


def test_the_new_keys_are_checked_and_the_watchdog_limits_default_as_documented():
  for bad, message in (("train.spike_factor=0.5", "must be 0 .* or above 1"),
                       ("train.spike_steps=0", "must be positive"),
                       ("train.stall_timeout=-1", "must not be negative"),
                       ("train.peer_timeout=-1", "must not be negative")):
    with pytest.raises(config.ConfigError, match=message):
      config.load(None, [bad])
  tc = config.load(None, []).train
  assert tc.spike_factor == 0  # the guard is off unless asked for
  assert watchdog.stall_limits(tc, None) == (900.0, 60.0)
  assert watchdog.stall_limits(tc, 9.0) == (900.0, 90.0)
  # JAX declares a silent process dead from half its heartbeat timeout on (its client beats
  # every half of it): the default names it well before, and more than 0.4 of it is refused.
  assert watchdog.DEFAULT_HEARTBEAT_TIMEOUT == 200
  assert watchdog.peer_timeout(tc, 200) == 60.0 < 200 / 2
  assert watchdog.peer_timeout(tc, 100) == 30.0 and watchdog.peer_timeout(tc, 20) == 6.0
  watchdog.check_peer_timeout(config.load(None, ["train.peer_timeout=80"]).train, 200)
  with pytest.raises(config.ConfigError, match=r"train\.peer_timeout=60 must be at most 40 s with a "
                     r"heartbeat timeout of 100 s \(--heartbeat-timeout\): JAX's coordination "
                     r"service aborts every process for a silent one from 50 s on"):
    watchdog.check_peer_timeout(config.load(None, ["train.peer_timeout=60"]).train, 100)
  tc = config.load(None, ["train.stall_timeout=5", "train.first_step_timeout=50"]).train
  assert watchdog.stall_limits(tc, 9.0) == (50.0, 5.0)


class _Store:
  """The coordination service's key-value store as the watchdog reads it: process 0's counter
  moves at every read; process 1's moves too, except from `still_from` s after the store is made
  for `still_for` s (forever: inf)."""

  def __init__(self, still_from: float = 0.0, still_for: float = 0.0):
    self.t0, self.still = time.monotonic(), (still_from, still_from + still_for)
    self.n, self.frozen = 0, None

  def key_value_dir_get(self, prefix):
    self.n += 1
    t = time.monotonic() - self.t0
    if self.still[0] <= t < self.still[1]:
      self.frozen = self.n if self.frozen is None else self.frozen
      mine = self.frozen
    else:
      self.frozen, mine = None, self.n
    return [(f"{prefix}0", str(self.n)), (f"{prefix}1", str(mine))]


def watched(monkeypatch, store, overrides, slow=True, watch_s=1.5, first=False):
  """Runs a watchdog of process 0 of 2 over `store` for `watch_s` seconds in a wait marked as
  given (beats of 0.05 s, the peers' counters read at each); the exit codes it took."""
  monkeypatch.setattr(watchdog, "_BEAT_S", 0.05)
  exits = []

  def exit_(code):
    exits.append(code)
    raise SystemExit(code)
  monkeypatch.setattr(watchdog.os, "_exit", exit_)
  dog = watchdog.Watchdog(config.load(None, overrides).train, 1)
  dog.pi, dog.pc, dog.client, dog._stop = 0, 2, store, threading.Event()
  if not first:
    dog.first_step_done()
  dog.at(7, "saving the checkpoint of step 7" if slow else "dispatching step 7", slow=slow)
  threading.Timer(watch_s, dog._stop.set).start()
  try:
    dog._watch()  # returns when stopped
  except SystemExit:
    pass
  return exits


@pytest.mark.parametrize("still_for, slow, ends", [
    (math.inf, True, True),  # a dead peer, in a save: named after peer_timeout
    (0.0, True, False),  # every peer beats
    (math.inf, False, True),  # between steps too, though the limit (600 s here) is far
    (0.5, True, False)])  # a pause shorter than peer_timeout is waited out
def test_a_peer_silent_during_a_save_ends_the_process_only_after_the_peer_timeout(
    monkeypatch, capfd, still_for, slow, ends):
  """A save meets the other processes at orbax's barriers, where a dead peer is noticed only by
  the coordination service, which aborts everyone for it from half its heartbeat timeout on; a
  step's collectives may wait past that too when the steady limit is long. The watchdog reads
  the others' heartbeat counters every beat (0.05 s here) and a wait ends once one has stood
  still for train.peer_timeout (0.8 s here), naming it; a live peer or a peer paused for less
  is waited for."""
  t0 = time.monotonic()
  exits = watched(monkeypatch, _Store(0.0, still_for),
                  ["train.stall_timeout=600", "train.peer_timeout=0.8"], slow=slow, watch_s=2.5)
  if not ends:
    assert exits == []
    return
  assert exits == [1] and 0.8 < time.monotonic() - t0 < 2.5
  err = capfd.readouterr().err.strip().splitlines()
  what = "saving the checkpoint of step 7" if slow else "dispatching step 7"
  assert re.match(r"error: process 1 stopped answering: step 7 made no progress for \d+ s \(its "
                  r"heartbeat stood still for train\.peer_timeout=0\.8 s while this process waited "
                  rf"in: {what}\); stopping", err[-1]), err[-1]


def test_the_heartbeat_beats_through_jaxs_shutdown_and_is_joined_after_it(monkeypatch):
  """The heartbeat thread beats while JAX's exit handler shuts the client down (a finished
  process waiting at the shutdown barrier still beats), and is stopped and joined as soon as
  that returns: left running, a daemon thread coming back from the client's C++ call while
  Python finalizes aborts a run that finished well ("FATAL: exception not rethrown", once in a
  suite's two-process runs)."""
  from jax._src import distributed as jd

  class Client:
    def __init__(self):
      self.beats, self.down = [], False

    def key_value_set(self, key, value, allow_overwrite):
      if self.down:
        raise RuntimeError("shut down")
      self.beats.append((key, value))

  class State:  # jax._src.distributed.State's two members the heartbeat uses
    def __init__(self, client):
      self.client, self.beats_during_shutdown = client, None

    def shutdown(self):
      before = len(self.client.beats)
      time.sleep(0.3)  # the shutdown barrier: the others are still finishing
      self.beats_during_shutdown = len(self.client.beats) - before
      self.client.down, self.client = True, None

  client = Client()
  state = State(client)
  monkeypatch.setattr(jd, "global_state", state)
  monkeypatch.setattr(watchdog, "_BEAT_S", 0.05)
  monkeypatch.setattr(watchdog, "_heartbeat", None)
  watchdog.start_heartbeat(3)
  thread = watchdog._heartbeat
  time.sleep(0.2)
  assert thread.is_alive() and client.beats[0] == ("jaxpar/alive/3", "1")
  jd.global_state.shutdown()  # what jax.distributed.shutdown and JAX's exit handler call
  assert state.beats_during_shutdown >= 3
  assert not thread.is_alive() and watchdog._heartbeat is None


def test_saves_and_evaluations_wait_the_first_step_limit_and_steps_the_steady_one(monkeypatch):
  # A slow wait (a save, an evaluation) of 1 s is within the first-step limit (900 s) though past
  # train.stall_timeout=0.5; the same wait between steps is not.
  alive = _Store()
  assert watched(monkeypatch, alive, ["train.stall_timeout=0.5"], slow=True,
                 watch_s=1.2) == []
  assert watched(monkeypatch, alive, ["train.stall_timeout=0.5"], slow=False,
                 watch_s=1.2) == [1]
  assert watched(monkeypatch, alive, ["train.stall_timeout=5", "train.first_step_timeout=0.5"],
                 slow=True, watch_s=1.2) == [1]


HEARTBEAT_S = 30  # JAX's heartbeat timeout in the pause tests: 0.15 of jaxpar's 200 s


@pytest.mark.parametrize("pause_s, survives", [(4.5, True), (13.5, False)])
def test_a_pause_of_a_process_during_saves_is_waited_out_or_named_before_jax_aborts(
    tmp_path, pause_s, survives):
  """Two processes save every step, on a machine kept busy by two spinning processes beside
  them from the pause on; process 1 is stopped (SIGSTOP) once steps are logged, for `pause_s`. JAX's
  heartbeat timeout is 30 s here (JAXPAR_HEARTBEAT_TIMEOUT), 0.15 of jaxpar's default, so
  train.peer_timeout is 9 s, and JAX's coordination service may abort everyone from 15 s into a
  pause on: 4.5 s is 30 s and 13.5 s is 90 s at the defaults. A 4.5 s pause is waited out and the
  run finishes. Through a longer one, process 0 names process 1 in one sentence and exits 1
  (never JAX's abort, exit 134) before 15 s, and the launcher kills process 1, still stopped."""
  import signal
  metrics, out_file, err_file = tmp_path / "m.jsonl", tmp_path / "out", tmp_path / "err"
  cmd = [sys.executable, LAUNCH, "--processes", "2", "--", TRAIN, "--mesh", "2x1x1",
         "--workdir", str(tmp_path / "wd"), "--metrics-file", str(metrics), "--no-progress",
         "--set", *TINY, "train.steps=8", "checkpoint.every=1", "train.stall_timeout=120"]
  env = {**child_env(), "JAXPAR_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)}
  with open(out_file, "w") as out, open(err_file, "w") as err:
    p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
  busy = []
  try:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
        break
      time.sleep(0.01)
    assert p.poll() is None, err_file.read_text()
    pid = int(re.search(r"process 1 as pid (\d+)", err_file.read_text())[1])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    os.kill(pid, signal.SIGSTOP)
    t0, named = time.monotonic(), None
    # a long pause lasts until the job ends (continued, process 1 would meet no coordinator)
    while p.poll() is None and time.monotonic() - t0 < (pause_s if survives else 2 * HEARTBEAT_S):
      if named is None and "[0] error: " in err_file.read_text():
        named = time.monotonic() - t0
      time.sleep(0.05)
    stopped_for = time.monotonic() - t0
    if p.poll() is None:
      os.kill(pid, signal.SIGCONT)
    p.wait(timeout=180)
  finally:
    for q in busy:
      q.kill()
    if p.poll() is None:
      p.kill()
  err = err_file.read_text()
  assert "detected fatal errors" not in err and "heartbeat timeout" not in err, err
  if survives:
    assert p.returncode == 0 and stopped_for >= pause_s, err
    rows = records(metrics)
    assert rows[-1]["final"] and rows[-1]["steps"] == 8
    return
  # named before JAX could abort (from 15 s into the pause on), and the job ended
  assert p.returncode == 1 and named is not None and named < HEARTBEAT_S / 2, (
      p.returncode, named, stopped_for, err)
  rank0 = [l for l in err.splitlines() if l.startswith("[0] error:")]
  assert len(rank0) == 1 and re.match(
      r"\[0\] error: process 1 stopped answering: step \d+ made no progress for \d+ s \(its "
      r"heartbeat stood still for train\.peer_timeout=9 s while this process waited in: ",
      rank0[0]), err
  assert "process 1 ended with signal SIGKILL" in err, err


def test_a_peak_measured_for_the_same_devices_is_taken_and_another_is_measured(monkeypatch):
  from jaxpar.analysis import devices
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})
  peak, source = devices.peak_flops_per_device()
  record = devices.peak_record(peak * 3, source)
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})
  assert devices.peak_flops_per_device(record) == (peak * 3, source)
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})
  elsewhere = {**record, "for": record["for"][:2] + [record["for"][2] + 1] + record["for"][3:]}
  assert devices.peak_flops_per_device(elsewhere)[0] != peak * 3


