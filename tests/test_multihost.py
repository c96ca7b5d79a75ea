"""Processes on loopback: one process's losses, shared checkpoints, one stop, clear failures.

The training runs are real processes joined by jax.distributed (gloo collectives on CPU). They
compile as the rest of the suite does (conftest.FAST_XLA) and share a persistent compilation
cache, which keeps the file fast on two cores; every comparison is between runs compiled alike.
"""
import contextlib
import io
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
from conftest import FAST_XLA

from jaxpar.commands import train as train_command
from jaxpar.config import ConfigError
from jaxpar.data import BatchIterator
from jaxpar.parallel import distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")
LAUNCH = str(ROOT / "scripts" / "launch_local.py")
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=8", "data.source=synthetic", "train.log_every=1",
        "parallel.zero_stage=3", "precision.param_dtype=float32", "precision.compute_dtype=float32",
        # A learning rate that does not depend on train.steps, which --steps sets per run.
        "train.warmup_steps=0", "train.min_lr_ratio=1.0"]
FAST_COMPILE = FAST_XLA  # conftest's: compiled as the rest of the suite compiles


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """The children's environment: no inherited devices, coordinator or cluster; the session's
  compilation cache (conftest.py)."""
  e = {k: v for k, v in os.environ.items()
       if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_", "PMI_", "KUBERNETES_"))}
  e.update({"XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
  return e


def run(args, env, timeout=240, extra_env=None):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                        env=dict(env, **(extra_env or {})), cwd=ROOT)


def train_args(workdir, metrics, steps, mesh="2x4x1"):
  return [TRAIN, "--mesh", mesh, "--steps", str(steps), "--workdir", str(workdir),
          "--metrics-file", str(metrics), "--no-progress", "--set", *TINY]


def one_process(workdir, metrics, steps, env, mesh="2x4x1"):
  r = run(train_args(workdir, metrics, steps, mesh), env,
          extra_env={"XLA_FLAGS": f"{FAST_COMPILE} --xla_force_host_platform_device_count=8"})
  assert r.returncode == 0, r.stdout + r.stderr
  return r


def straight_run(workdir, metrics, steps):
  """The losses to compare with: train.py's main in this process, on its 8 devices (conftest.py:
  the flags one_process's child gets, so the same program), without a Python and JAX start-up;
  no cluster variables, as for the children. Resumes stay in processes of their own (a resume
  takes the MFU peak from its checkpoint; this process may have measured one already)."""
  argv = train_args(workdir, metrics, steps)
  out, err = io.StringIO(), io.StringIO()
  cluster = [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "KUBERNETES_"))]
  with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), \
       contextlib.redirect_stderr(err):
    for k in cluster:
      del os.environ[k]
    code = train_command.main(argv[1:])
  assert code == 0, out.getvalue() + err.getvalue()
  return losses(metrics)


def two_processes(workdir, metrics, steps, env, mesh="2x4x1"):
  r = run([LAUNCH, "--processes", "2", "--", *train_args(workdir, metrics, steps, mesh)], env)
  assert r.returncode == 0, r.stdout + r.stderr
  return r


def records(metrics):
  lines = [json.loads(l) for l in pathlib.Path(metrics).read_text().splitlines()]
  return [l for l in lines if not l.get("final")], [l for l in lines if l.get("final")]


def losses(metrics):
  steps, _ = records(metrics)
  return {l["step"]: l["loss"] for l in steps}


class Runs:
  """The training runs the tests share, each started on first use."""
  # One process trains 7 steps straight (the reference); two processes train steps 1-3, one
  # process resumes their checkpoint for steps 4-5, and two processes resume that for 6-7.

  def __init__(self, tmp, env):
    self.tmp, self.env, self.done = tmp, env, {}

  def get(self, name):
    if name not in self.done:
      getattr(self, "_" + name)()
    return self.done[name]

  def _reference(self):
    self.done["reference"] = straight_run(self.tmp / "ref", self.tmp / "ref.jsonl", 7)

  def _two_first(self):
    m = self.tmp / "two_first.jsonl"
    r = two_processes(self.tmp / "chain", m, 3, self.env)
    self.done["two_first"] = (m, r)

  def _one_resume(self):
    self.get("two_first")
    m = self.tmp / "one_resume.jsonl"
    r = one_process(self.tmp / "chain", m, 5, self.env)
    self.done["one_resume"] = (m, r)

  def _two_resume(self):
    self.get("one_resume")
    m = self.tmp / "two_resume.jsonl"
    r = two_processes(self.tmp / "chain", m, 7, self.env)
    self.done["two_resume"] = (m, r)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env):
  return Runs(tmp_path_factory.mktemp("runs"), env)


def rel(a, b):
  return abs(a - b) / max(abs(b), 1e-12)


def test_two_processes_train_like_one(runs):
  ref = runs.get("reference")
  metrics, r = runs.get("two_first")
  got = losses(metrics)
  assert sorted(got) == [1, 2, 3]
  for step, loss in got.items():
    assert rel(loss, ref[step]) <= 1e-6, (step, loss, ref[step])
  steps, final = records(metrics)
  assert [l["step"] for l in steps] == [1, 2, 3] and len(final) == 1  # written once, by process 0
  assert "[0] steps: 3" in r.stdout and "[1] steps:" not in r.stdout


def test_checkpoints_move_between_one_and_two_processes(runs):
  ref = runs.get("reference")
  m1, r1 = runs.get("one_resume")  # written by two processes, resumed by one
  m2, r2 = runs.get("two_resume")  # written by one process, resumed by two
  assert "resuming from the checkpoint at step 3" in r1.stdout
  assert r2.stdout.count("resuming from the checkpoint at step 5") == 1  # process 0 only
  for metrics, steps in ((m1, [4, 5]), (m2, [6, 7])):
    got = losses(metrics)
    assert sorted(got) == steps
    for step in steps:
      assert rel(got[step], ref[step]) <= 1e-5, (step, got[step], ref[step])
  # MFU's per-device peak is the host's over all 8 devices on it, whichever process holds them:
  # measured once by the first run (two processes: the first measures, the second takes its
  # figure) and taken from the checkpoint by each resume, one process or two
  m0, r0 = runs.get("two_first")
  peaks = [re.findall(r"^(?:\[0\] )?MFU: [\d.]+% of ([\d.]+ [GMT]FLOP/s per device) \((.*)\)$",
                      r.stdout, re.M) for r in (r0, r1, r2)]
  assert all(len(p) == 1 for p in peaks) and len({p[0] for p in peaks}) == 1, peaks
  assert "divided among 8 devices of 2 processes on it" in peaks[0][0][1], peaks


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_reads_its_own_share_of_an_epoch(processes):
  windows = np.arange(64 * 5, dtype=np.uint8).reshape(64, 5) % 251
  windows[:, 0] = np.arange(64)  # the first token names the window
  whole = BatchIterator(windows, global_batch=8, seed=3, prefetch=0)
  parts = [BatchIterator(windows, 8, 3, process_index=i, process_count=processes, prefetch=0)
           for i in range(processes)]
  seen = [[] for _ in range(processes)]
  for _ in range(whole.steps_per_epoch):
    batches = [p.next() for p in parts]
    np.testing.assert_array_equal(np.concatenate(batches), whole.next())  # one global batch
    for i, b in enumerate(batches):
      seen[i].extend(b[:, 0].tolist())
  for i in range(processes):
    for j in range(i + 1, processes):
      assert not set(seen[i]) & set(seen[j])
  assert sorted(sum(seen, [])) == list(range(64))


def test_a_lost_process_stops_the_launcher_and_the_relaunch_resumes(tmp_path, env):
  """Process 1 is killed while checkpoints are being written (one every step): process 0 says so
  at once and exits (it waited at orbax's barrier for the dead process until JAX's heartbeat
  timeout aborted it, or until the launcher killed it), and both processes, started again, resume
  from the newest complete checkpoint.

  Process 0 must notice by itself: from its broken connection to process 1 in a collective (about
  1.5 s here; the launcher stops a survivor with SIGTERM only when it still runs 1 s after the
  first failure, and says so), or, when process 1 died while process 0 waited for it at one of
  orbax's barriers in a save (where a signal does not reach Python), from process 1's heartbeat in
  the coordination service (train.peer_timeout=3 s here). It is given 20 s, a tenth of JAX's
  heartbeat timeout, far from the abort that timeout brings."""
  metrics, out_file, err_file = tmp_path / "m.jsonl", tmp_path / "out", tmp_path / "err"
  ckpts = tmp_path / "wd" / "checkpoints"
  args = train_args(tmp_path / "wd", metrics, 100000, mesh="2x1x1") + ["checkpoint.every=1",
                                                                       "train.peer_timeout=3"]
  complete = lambda: sorted(int(d.name) for d in ckpts.glob("*") if d.name.isdigit())
  with open(out_file, "w") as out, open(err_file, "w") as err:
    p = subprocess.Popen([sys.executable, LAUNCH, "--processes", "2", "--", *args], stdout=out,
                         stderr=err, env=env, cwd=ROOT)
  try:
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and p.poll() is None:  # once a save is complete
      if complete():
        break
      time.sleep(0.005)
    assert p.poll() is None, err_file.read_text()
    pid = re.search(r"process 1 as pid (\d+)", err_file.read_text())
    os.kill(int(pid[1]), signal.SIGKILL)
    limit, t0 = distributed.DEFAULT_HEARTBEAT_TIMEOUT / 10, time.monotonic()
    try:
      p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
      pass
    elapsed = time.monotonic() - t0
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  err = err_file.read_text()
  assert p.returncode == 128 + signal.SIGKILL and elapsed < limit, (elapsed, err)
  rank0 = [l for l in err.splitlines() if l.startswith("[0] ")]
  said = [l for l in err.splitlines() if l.startswith("[launcher] ") and " gloo made " not in l]
  assert rank0 and said[1].startswith("[launcher] started process 0 as pid"), err
  if "lost process 1" in rank0[-1]:
    # From its broken connection in a collective: at once, the launcher stopped nobody.
    assert len(said) == 3, err
    assert said[2] == ("[launcher] process 1 failed first (signal SIGKILL); process 0 ended with "
                       "exit code 1; exit code 137"), err
  else:
    # Killed while process 0 met it at one of orbax's barriers in a save (the coordination service
    # notices only at its heartbeat timeout): process 0's watchdog saw process 1's heartbeat stand
    # still, a few seconds in; the launcher's SIGTERM, 1 s in, could not reach it there.
    assert rank0[-1].startswith("[0] error: process 1 stopped answering: step "), err
    assert ("(its heartbeat stood still for train.peer_timeout=3 s while this process waited in: "
            in rank0[-1]), err
    assert len(said) == 4 and said[3].startswith("[launcher] process 1 stopped answering (step "), err
    assert said[3].endswith("process 0 ended with exit code 1; process 1 ended with signal "
                            "SIGKILL; exit code 137"), err
  start = complete()[-1]
  again = tmp_path / "again.jsonl"
  r = run([LAUNCH, "--processes", "2", "--", *train_args(tmp_path / "wd", again, start + 2,
                                                         mesh="2x1x1"), "checkpoint.every=1"], env)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"[0] resuming from the checkpoint at step {start} " in r.stdout + r.stderr
  assert sorted(losses(again)) == [start + 1, start + 2]


class Launch:
  """Two processes of a long run under the launcher, in the background, signalled one by one."""

  def __init__(self, tmp, name, workdir, env):
    self.metrics, self.out, self.err = (tmp / f"{name}.jsonl", tmp / f"{name}.out",
                                        tmp / f"{name}.err")
    with open(self.out, "w") as out, open(self.err, "w") as err:
      self.p = subprocess.Popen([sys.executable, LAUNCH, "--processes", "2", "--",
                                 *train_args(workdir, self.metrics, 100000)],
                                stdout=out, stderr=err, env=env, cwd=ROOT)

  def wait_rows(self, n, timeout=120):
    """Until the metrics file has `n` step rows, or the run has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and self.p.poll() is None:
      if self.metrics.exists() and len(self.metrics.read_text().splitlines()) >= n:
        return
      time.sleep(0.02)
    assert self.p.poll() is None, self.err.read_text()  # it ended before its steps

  def terminate(self, rank):
    """SIGTERM to process `rank` alone: the children run in their own sessions."""
    pid = re.search(rf"process {rank} as pid (\d+)", self.err.read_text())
    try:
      os.kill(int(pid[1]), signal.SIGTERM)
    except ProcessLookupError:  # it stopped already
      pass

  def finish(self):
    """{rank: (step saved, why)} from each process's last line, once all have exited 0."""
    try:
      self.p.wait(timeout=120)
    finally:
      if self.p.poll() is None:
        self.p.kill()
    out, err = self.out.read_text(), self.err.read_text()
    assert self.p.returncode == 0, out + err
    said = re.findall(r"^\[(\d)\] process \1 (received SIGTERM|stops at step \d+ because process "
                      r"\d received SIGTERM): saved a checkpoint at step (\d+); run again to "
                      r"resume$", out + err, re.M)
    assert len(said) == 2, out + err
    return {int(rank): (int(step), why) for rank, why, step in said}, out


def test_sigterm_to_some_processes_stops_all_at_one_step(runs, tmp_path, env):
  workdir = tmp_path / "wd"
  # Process 1 alone receives SIGTERM: process 0, which writes metrics, must stop with it.
  first = Launch(tmp_path, "first", workdir, env)
  first.wait_rows(1)
  first.terminate(1)
  said, _ = first.finish()
  n = said[1][0]
  assert said == {1: (n, "received SIGTERM"),
                  0: (n, f"stops at step {n} because process 1 received SIGTERM")}
  steps, final = records(first.metrics)
  assert steps[-1]["step"] == n and final[0]["interrupted"] and final[0]["steps"] == n
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == [n]

  # Both receive SIGTERM, at different steps: they stop together where the first one asked.
  second = Launch(tmp_path, "second", workdir, env)
  second.wait_rows(1)
  second.terminate(0)
  second.wait_rows(2)
  second.terminate(1)
  said, out = second.finish()
  m = said[0][0]
  assert said[0] == (m, "received SIGTERM") and said[1][0] == m > n, said
  assert out.count(f"resuming from the checkpoint at step {n}") == 1

  # Stopped, resumed and stopped again, the losses are those of one straight run.
  ref = runs.get("reference")  # 7 steps
  if m > max(ref):
    ref = straight_run(tmp_path / "straight", tmp_path / "straight.jsonl", m)
  got = {**losses(first.metrics), **losses(second.metrics)}
  assert sorted(got) == list(range(1, m + 1))
  for step, loss in got.items():
    assert rel(loss, ref[step]) <= 1e-5, (step, loss, ref[step])


def test_processes_with_different_configs_stop_before_training(tmp_path, env):
  port = free_port()
  procs = []
  for rank, lr in ((0, "0.001"), (1, "0.002")):
    e = dict(env, XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=1",
             JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_NUM_PROCESSES="2",
             JAXPAR_PROCESS_ID=str(rank))
    args = [sys.executable, TRAIN, "--mesh", "2x1x1", "--workdir", str(tmp_path / "wd"),
            "--no-progress", "--set", *TINY, f"train.lr={lr}"]
    procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=e, cwd=ROOT))
  results = [p.communicate(timeout=120) for p in procs]
  for rank, (p, (out, err)) in enumerate(zip(procs, results)):
    assert p.returncode == 2, err
    line = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "preflight: process 1 started with a different train.lr" in line[0]
    assert f"process {rank} has train.lr={'0.001' if rank == 0 else '0.002'}" in line[0]
  assert not (tmp_path / "wd").exists()


def test_a_missing_coordinator_is_one_sentence_within_the_timeout(tmp_path, env):
  port = free_port()
  t0 = time.monotonic()
  r = run([TRAIN, "--mesh", "2x1x1", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
           "--process-id", "1", "--init-timeout", "3", "--workdir", str(tmp_path / "wd")], env,
          timeout=60)
  assert r.returncode == 1 and time.monotonic() - t0 < 30
  assert r.stderr.strip() == (f"error: process 1 of 2 could not join the coordinator at "
                              f"127.0.0.1:{port} after 3 s: nothing answers at that address (is "
                              f"process 0 running, is the address right and the port open "
                              f"between the hosts?)")


def test_launcher_stops_the_others_when_one_fails(tmp_path, env):
  child = tmp_path / "child.py"
  child.write_text(
      "import os, sys, time\n"
      "rank = os.environ['JAXPAR_PROCESS_ID']\n"
      "print('hello', rank, os.environ['JAXPAR_NUM_PROCESSES'], os.environ['XLA_FLAGS'])\n"
      "sys.exit(3) if rank == '1' else time.sleep(60)\n")
  t0 = time.monotonic()
  r = run([LAUNCH, "--processes", "2", "--devices-per-process", "3", "--", str(child)], env,
          timeout=60)
  assert r.returncode == 3 and time.monotonic() - t0 < 20
  for rank in (0, 1):
    assert f"[{rank}] hello {rank} 2 {FAST_COMPILE} --xla_force_host_platform_device_count=3" \
        in r.stdout.splitlines()
  assert "[launcher] process 1 failed first (exit code 3)" in r.stderr
  assert "process 0 ended with signal SIGTERM; exit code 3" in r.stderr


def test_gloos_connection_lines_are_one_line_of_the_launcher(tmp_path, env):
  """gloo prints a line for every connection it makes (about 30 in a two-process run with a few
  devices each): the launcher leaves those that found every peer out and says how many in one
  line at the end; one that found fewer peers than expected is passed on."""
  child = tmp_path / "child.py"
  line = "[Gloo] Rank {r} is connected to {n} peer ranks. Expected number of connected peer ranks is : 1"
  child.write_text(
      "import os\n"
      "rank = os.environ['JAXPAR_PROCESS_ID']\n"
      f"for _ in range(15): print({line!r}.format(r=rank, n=1), flush=True)\n"
      "print('hello', rank)\n"
      f"if rank == '1': print({line!r}.format(r=rank, n=0))\n")
  r = run([LAUNCH, "--processes", "2", "--", str(child)], env, timeout=60)
  assert r.returncode == 0, r.stderr
  assert sorted(r.stdout.splitlines()) == ["[0] hello 0", "[1] " + line.format(r=1, n=0),
                                           "[1] hello 1"], r.stdout
  said = [l for l in r.stderr.splitlines() if "gloo made" in l]
  assert said == ["[launcher] gloo made 30 connections between the processes, each to all the "
                  "peers it expected (its lines are left out)"], r.stderr


def test_the_failure_reported_first_is_the_earliest_not_the_lowest_rank(tmp_path, env):
  # Process 1 fails; process 0 sees it (a file here, a broken connection in training) and exits
  # a few milliseconds later, well within the launcher's polling interval.
  child = tmp_path / "child.py"
  gone = tmp_path / "gone"
  child.write_text(
      "import os, sys, time\n"
      f"gone = {str(gone)!r}\n"
      "if os.environ['JAXPAR_PROCESS_ID'] == '1':\n"
      "  time.sleep(1.0)\n"
      "  open(gone, 'w').close()\n"
      "  os._exit(3)\n"
      "while not os.path.exists(gone):\n"
      "  time.sleep(0.001)\n"
      "time.sleep(0.005)\n"
      "sys.exit(1)\n")
  for _ in range(3):
    gone.unlink(missing_ok=True)
    r = run([LAUNCH, "--processes", "2", "--", str(child)], env, timeout=60)
    assert r.returncode == 3, r.stderr
    assert "[launcher] process 1 failed first (exit code 3); process 0 ended with exit code 1" \
        in r.stderr, r.stderr


def test_resolve_flags_environment_and_launchers(monkeypatch):
  monkeypatch.setattr(distributed, "_detect_cluster", lambda: None)
  assert distributed.resolve(None, {}).num_processes == 1
  env = {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "4", "JAXPAR_PROCESS_ID": "3"}
  s = distributed.resolve(None, env)
  assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("h:1", 4, 3, "environment")

  class Args:
    coordinator, num_processes, process_id = "x:2", None, 1
    init_timeout, heartbeat_timeout = 5, None
  s = distributed.resolve(Args, env)  # flags win over the environment, field by field
  assert (s.coordinator, s.num_processes, s.process_id, s.init_timeout) == ("x:2", 4, 1, 5)
  s = distributed.resolve(None, {"JAXPAR_COORDINATOR": "h:1", "OMPI_COMM_WORLD_SIZE": "8",
                                 "OMPI_COMM_WORLD_RANK": "5"})
  assert (s.num_processes, s.process_id) == (8, 5)
  for bad, message in (({"JAXPAR_COORDINATOR": "nohost"}, "is not of the form HOST:PORT"),
                       ({"JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0"},
                        "need the coordinator"),
                       ({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2"}, "--process-id"),
                       ({**env, "JAXPAR_PROCESS_ID": "4"}, "must be in 0..3"),
                       ({**env, "JAXPAR_INIT_TIMEOUT": "soon"}, "is not a number of seconds")):
    with pytest.raises(ConfigError, match=message):
      distributed.resolve(None, bad)


@pytest.mark.parametrize("args,message", [
    ([], "the following arguments are required: --processes"),
    (["--processes", "abc", "--", "x.py"], "argument --processes: invalid int value: 'abc'"),
    (["--processes", "2", "--grace", "-1", "--", "x.py"], "--grace=-1.0 must be a number of seconds"),
    (["--processes", "2", "--port", "99999", "--", "x.py"], "--port=99999 is not a TCP port"),
])
def test_launcher_bad_arguments_are_one_line_and_exit_2(env, args, message):
  r = run([LAUNCH, *args], env, timeout=60)
  assert r.returncode == 2 and r.stderr.startswith(f"error: {message}"), r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_interrupted_launch_exits_128_plus_the_signal(tmp_path, env):
  # The processes stop cleanly when told (as train.py saves and exits 0); the launch still
  # reports that it was interrupted, as a shell would.
  child = tmp_path / "child.py"
  child.write_text(
      "import signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
      "print('ready', flush=True)\n"
      "time.sleep(60)\n")
  proc = subprocess.Popen([sys.executable, LAUNCH, "--processes", "2", "--", str(child)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  seen = 0
  while seen < 2:
    seen += "ready" in proc.stdout.readline()
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGINT, err
  assert "[launcher] received SIGINT: stopping all processes" in err
