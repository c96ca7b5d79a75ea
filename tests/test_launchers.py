"""jaxpar under real cluster launchers: Open MPI's mpirun and a one-node SLURM cluster.

tests/test_multihost.py starts its processes with jaxpar's own launcher; here `mpirun` and
`srun`/`sbatch` start them, and each process learns its rank from the launcher's environment (JAX's
cluster detection, or with JAXPAR_COORDINATOR set, jaxpar's reading of OMPI_COMM_WORLD_*). Two
processes of one device each must give the losses of one process on both devices, bit for bit: the
same global layout compiles to the same partitioned program, and every cross-device reduction has
two operands, whose sum is the same in any order (gloo's or the in-process one). A second launch
resumes the checkpoint and continues with the losses of the uninterrupted run.

The launches follow BUILD.md's recipes, read from BUILD.md and changed only where one CPU machine
differs from the cluster the recipe is written for (one node, no GPUs, a test folder). The SLURM
cluster (munged, slurmctld, slurmd) runs as this test's own processes, on free ports with its
files in its own folder, and is stopped however the test ends. Every process a test starts
carries a tag in its environment; whatever still runs with it at the end is killed.

The tests skip, saying why, where the launchers are not installed (`.ci/run` installs them with
apt-get when it can) or, for SLURM, when not running as root.
"""
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from conftest import FAST_XLA

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")
BUILD_MD = ROOT / "BUILD.md"
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=8", "data.source=synthetic", "train.log_every=1",
        "parallel.zero_stage=3", "precision.param_dtype=float32", "precision.compute_dtype=float32",
        # A learning rate that does not depend on train.steps, which --steps sets per run.
        "train.warmup_steps=0", "train.min_lr_ratio=1.0"]
MESH = "2x1x1"  # one device per process: the data axis and ZeRO-3's gathers cross processes
FAST_COMPILE = FAST_XLA  # conftest's: compiled as the rest of the suite compiles
TAG = "JAXPAR_LAUNCHER_TEST_TAG"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def kill_tagged(tag: str) -> list[int]:
  """SIGKILL to every process that carries `tag` (the ones this test started); their ids."""
  mark, killed = f"{TAG}={tag}".encode(), []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if mark in f.read().split(b"\0"):
          os.kill(int(pid), signal.SIGKILL)
          killed.append(int(pid))
    except OSError:  # gone already, or not ours to read
      pass
  return killed


@pytest.fixture
def env():
  """The children's environment, tagged: no inherited cluster or coordinator, fast compiles, the
  session's compilation cache (conftest.py); a failed join ends in 60 s, not 300."""
  tag = uuid.uuid4().hex
  e = {k: v for k, v in os.environ.items()
       if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_", "PMI_", "PRTE_", "KUBERNETES_"))}
  e.update({"XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
            "JAXPAR_INIT_TIMEOUT": "60", TAG: tag})
  yield e
  kill_tagged(tag)


def run(argv, env, timeout=240, cwd=ROOT):
  """Runs `argv` in its own session; on a timeout the whole session is killed, not only argv[0]."""
  p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       cwd=cwd, start_new_session=True)
  try:
    out, _ = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    out, _ = p.communicate()
    pytest.fail(f"{argv[0]} ran past {timeout} s:\n{out}")
  return p.returncode, out


def losses(metrics) -> dict[int, float]:
  rows = [json.loads(l) for l in pathlib.Path(metrics).read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if not r.get("final")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process on both devices, 4 steps straight: {step: loss}."""
  tmp = tmp_path_factory.mktemp("reference")
  e = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_"))}
  e["XLA_FLAGS"] = f"{FAST_COMPILE} --xla_force_host_platform_device_count=2"
  rc, out = run([sys.executable, TRAIN, "--mesh", MESH, "--steps", "4", "--workdir",
                 str(tmp / "wd"), "--metrics-file", str(tmp / "m.jsonl"), "--no-progress",
                 "--set", *TINY], e)
  assert rc == 0, out
  got = losses(tmp / "m.jsonl")
  assert sorted(got) == [1, 2, 3, 4]
  return got


def recipe(section: str) -> str:
  """The first bash block under BUILD.md's `### section`, continued lines joined."""
  text = BUILD_MD.read_text()
  m = re.search(rf"^### {re.escape(section)}\n.*?```bash\n(.*?)```", text, re.M | re.S)
  assert m, f"BUILD.md has no bash block under '### {section}'"
  return m.group(1).replace("\\\n", " ")


def replace(text: str, old: str, new: str) -> str:
  """`text` with `old` replaced; the recipe must still hold `old` (else this test is outdated)."""
  assert old in text, f"BUILD.md's recipe no longer holds {old!r}; update {__file__}:\n{text}"
  return text.replace(old, new)


def check_losses(got: dict[int, float], ref: dict[int, float], steps: list[int], out: str):
  assert sorted(got) == steps, out
  for step in steps:  # bit for bit: see the module's docstring
    assert got[step] == ref[step], (step, got[step], ref[step], out)


# -- Open MPI --------------------------------------------------------------------------------------

def mpirun_base() -> list[str]:
  """mpirun and what one machine needs: root allows itself, two ranks may share fewer cores."""
  return ["mpirun", *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--oversubscribe"]


def open_mpi_4() -> bool:
  """Whether mpirun is Open MPI 4, whose variables JAX's cluster detection knows (not 5's)."""
  out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
  return re.search(r"\(Open MPI\) 4\.", out) is not None


@pytest.mark.skipif(not shutil.which("mpirun"),
                    reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin; "
                           ".ci/run installs it where it can)")
def test_mpirun_two_processes_train_like_one_and_resume(tmp_path, env, reference):
  # BUILD.md's recipe for two hosts, on this one: both processes here instead of one per host,
  # the coordinator on loopback, this test's model and folder.
  port = free_port()
  words = shlex.split(recipe("Open MPI"))
  assert words[0] == "mpirun" and "python" in words, words
  cut = words.index("python")
  options = " ".join(words[1:cut])
  options = replace(options, "--map-by ppr:1:node ", "")
  options = replace(options, "--hostfile hosts ", "")
  options = re.sub(r"JAXPAR_COORDINATOR=\S+", f"JAXPAR_COORDINATOR=127.0.0.1:{port}", options)
  options = shlex.split(options)

  # The recipe's options leave each process every core this one has (Open MPI 4 binds each of
  # two processes per host to one core unless told --bind-to none).
  rc, out = run([*mpirun_base(), *options, sys.executable, "-c",
                 "import os, sys; sys.stdout.write(f'cores={len(os.sched_getaffinity(0))}\\n')"],
                env, timeout=60)
  cores = len(os.sched_getaffinity(0))
  assert rc == 0 and re.findall(r"cores=(\d+)", out) == [str(cores)] * 2, (cores, out)

  # Steps 1-2 with JAX's own detection of Open MPI 4 (no JAXPAR_* variables); JAX_COORDINATOR_PORT
  # picks a free port instead of one derived from the job id, so parallel runs cannot collide.
  # Open MPI 5 needs JAXPAR_COORDINATOR, as BUILD.md says.
  wd, m1, m2 = tmp_path / "run", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
  train = [TRAIN, "--mesh", MESH, "--workdir", str(wd), "--no-progress"]
  join = ({"JAX_COORDINATOR_PORT": str(free_port())} if open_mpi_4() else
          {"JAXPAR_COORDINATOR": f"127.0.0.1:{free_port()}"})
  rc, out = run([*mpirun_base(), "--bind-to", "none", "--tag-output", "-np", "2",
                 sys.executable, *train, "--steps", "2", "--metrics-file", str(m1), "--set", *TINY],
                dict(env, **join))
  assert rc == 0, out
  check_losses(losses(m1), reference, [1, 2], out)
  # One run of two processes: process 0 alone reports (two single processes would both do).
  assert "[1,0]<stdout>:steps: 2" in out and "[1,1]<stdout>:steps:" not in out, out

  # Steps 3-4 by the recipe: JAXPAR_COORDINATOR set, the ranks read from OMPI_COMM_WORLD_*.
  command = replace(" ".join(words[cut + 1:]), "--mesh 4x4x1", f"--mesh {MESH}")
  command = replace(command, "/shared/run1", str(wd)).split()
  rc, out = run([*mpirun_base(), *options, sys.executable, *command, "--steps", "4",
                 "--metrics-file", str(m2), "--set", *TINY], env)
  assert rc == 0, out
  assert out.count("resuming from the checkpoint at step 2") == 1, out
  check_losses(losses(m2), reference, [3, 4], out)


# -- SLURM -----------------------------------------------------------------------------------------

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scancel")


def sbin(name: str) -> str | None:
  """`name` on PATH or in the system's sbin folders (munged and the daemons live there)."""
  return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def slurm_missing() -> str | None:
  """Why a one-node SLURM cannot run here, or None."""
  missing = [b for b in SLURM_BINARIES if not sbin(b)]
  if missing:
    return (f"SLURM is not installed ({', '.join(missing)} not found; apt-get install slurmctld "
            f"slurmd slurm-client munge; .ci/run installs them where it can)")
  if os.geteuid() != 0:
    return "a one-node SLURM cluster needs root here (slurmd starts the jobs' processes)"
  return None


class Slurm:
  """munged, slurmctld and slurmd for one node (this host, 2 CPUs), as this test's processes.

  Everything lives in one folder: munge's key and socket (slurm.conf's AuthInfo names it, so
  neither /run/munge nor the system's munged is touched), the controller's state, slurmd's spool,
  the logs; both SLURM daemons listen on free ports. `env` is what sbatch and srun need
  (SLURM_CONF)."""

  def __init__(self, env):
    # munged wants every folder above its socket searchable by all: pytest's tmp_path (0700) is not
    self.dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxpar-slurm-"))
    self.dir.chmod(0o755)
    self.env = dict(env, SLURM_CONF=str(self.dir / "slurm.conf"))
    self.procs: list[subprocess.Popen] = []
    key = self.dir / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    host = socket.gethostname()  # slurmd finds its own entry by the hostname
    d = self.dir
    (d / "slurm.conf").write_text(f"""\
ClusterName=jaxpartest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# sbatch --wait polls every 2 s only where this is at most 4 (else every 8 s, and longer)
MinJobAge=4
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

  def start(self):
    d = self.dir
    self._daemon("munged", "-F", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
                 f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed")
    self._wait(lambda: (d / "munge.sock").exists(), "munged's socket")
    self._daemon("slurmctld", "-D", "-i", "-f", f"{d}/slurm.conf")
    self._daemon("slurmd", "-D", "-f", f"{d}/slurm.conf")
    self._wait(lambda: self.cli("sinfo", "-h", "-o", "%t").stdout.strip() == "idle",
               "the node to be idle")
    return self

  def _daemon(self, name, *args):
    log = open(self.dir / f"{name}.log", "w")
    self.procs.append(subprocess.Popen([sbin(name), *args], stdout=log, stderr=log, env=self.env,
                                       start_new_session=True))
    log.close()

  def _wait(self, ready, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if ready():
        return
      if any(p.poll() is not None for p in self.procs):
        break
      time.sleep(0.2)
    pytest.fail(f"the one-node SLURM cluster did not come up (waiting for {what}):\n{self.logs()}")

  def cli(self, *args, timeout=30):
    return subprocess.run([sbin(args[0]), *args[1:]], capture_output=True, text=True,
                          env=self.env, timeout=timeout)

  def logs(self) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                     for p in sorted(self.dir.glob("*.log")))

  def stop(self):
    """Cancels what still runs, stops the daemons (SIGTERM, then SIGKILL), removes the folder."""
    try:
      if all(p.poll() is None for p in self.procs):
        self.cli("scancel", "--full", "--partition=test", "--user=root", timeout=10)
    except (OSError, subprocess.SubprocessError):
      pass
    for p in reversed(self.procs):  # slurmd, slurmctld, then munged, which they ask
      if p.poll() is None:
        p.terminate()
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
    shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def slurm(env):
  """A running one-node SLURM cluster; stopped, and whatever it started killed, however the test
  ends."""
  why = slurm_missing()
  if why:
    pytest.skip(why)
  cluster = Slurm(env)
  try:
    yield cluster.start()
  finally:
    cluster.stop()
    kill_tagged(env[TAG])  # job steps that outlived their daemons


def test_slurm_two_tasks_train_like_one_and_a_resubmission_resumes(tmp_path, slurm, reference):
  # BUILD.md's batch script, on one node with 2 tasks instead of 2 nodes with 1 task and 8 GPUs
  # each, this test's model and folder; submitted twice (a new job id each time), the second must
  # find the first's run folder and resume it.
  script = recipe("SLURM")
  script = replace(script, "#SBATCH --nodes=2", "#SBATCH --nodes=1")
  script = replace(script, "#SBATCH --ntasks-per-node=1", "#SBATCH --ntasks-per-node=2")
  script = replace(script, "#SBATCH --gpus-per-node=8\n", "")
  script = replace(script, "#SBATCH --cpus-per-task=32", "#SBATCH --cpus-per-task=1")
  script = replace(script, "/shared/runs", str(tmp_path / "runs"))
  script = replace(script, "python scripts/train.py", f"{sys.executable} {TRAIN}")
  script = replace(script, "--mesh 4x4x1 --config configs/NAME.yaml", f"--mesh {MESH}")
  script = replace(script, "--no-progress", '--no-progress "$@"')  # the test's steps and model
  (tmp_path / "job.sh").write_text(script)

  outs = []
  for steps in (2, 4):
    # JAX_COORDINATOR_PORT: a free port, not one derived from the job id, which a SLURM cluster
    # of a test run beside this one numbers alike.
    rc, out = run(["sbatch", "--wait", "job.sh", "--steps", str(steps), "--set", *TINY],
                  dict(slurm.env, JAX_COORDINATOR_PORT=str(free_port())), cwd=tmp_path)
    job = re.search(r"Submitted batch job (\d+)", out)
    logs = sorted(tmp_path.glob(f"*-{job[1]}.out")) if job else []
    out += "".join(p.read_text() for p in logs)
    assert rc == 0, out + slurm.logs()
    outs.append(out)
  first, second = outs

  runs = sorted((tmp_path / "runs").iterdir())
  assert len(runs) == 1, (runs, "the resubmission wrote a run folder of its own")
  got = losses(runs[0] / "metrics.jsonl")  # both jobs append to it
  check_losses(got, reference, [1, 2, 3, 4], first + second)
  # Two tasks of one run: task 0 alone reports (two single processes would both do), and the
  # second job resumed where the first stopped.
  assert re.findall(r"^(\d+): steps: ", first, re.M) == ["0"], first
  resumed = re.findall(r"^(\d+): resuming from the checkpoint at step 2 ", second, re.M)
  assert resumed == ["0"], second


@pytest.mark.skipif(not shutil.which("mpirun"), reason="Open MPI's mpirun is not installed")
def test_mpirun_in_a_slurm_batch_job_numbers_the_processes_by_open_mpi(tmp_path, slurm):
  # A batch script's environment (SLURM_NTASKS=2, SLURM_PROCID=0) reaches every rank mpirun
  # starts in it, beside Open MPI's own numbering: the ranks must come from Open MPI, with
  # JAXPAR_COORDINATOR set (jaxpar reads them) and without (JAX's detection).
  show = ("import os, sys; from jaxpar.parallel import distributed as d\n"
          "for e in (dict(os.environ, JAXPAR_COORDINATOR='127.0.0.1:1'), None):\n"
          "  s = d.resolve(None, e)\n"
          "  sys.stdout.write(f'spec {s.source} {s.process_id} of {s.num_processes}\\n')\n")
  mpirun = shlex.join([*mpirun_base(), "--bind-to", "none", "-np", "2"])
  (tmp_path / "job.sh").write_text(
      f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=job.out\nset -euo pipefail\n"
      f"{mpirun} {sys.executable} -c {shlex.quote(show)}\n")
  rc, out = run(["sbatch", "--wait", "job.sh"], slurm.env, cwd=tmp_path, timeout=120)
  out += (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
  assert rc == 0, out + slurm.logs()
  said = sorted(re.findall(r"^spec (.+)$", out, re.M))
  assert said == ["Open MPI 0 of 2", "Open MPI 1 of 2", "environment 0 of 2",
                  "environment 1 of 2"], out
