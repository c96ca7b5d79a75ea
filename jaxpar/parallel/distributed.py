"""Many processes, one program: how they join (flags, env, clusters), bounded init, preflight.

`resolve` decides, without starting JAX, how many processes run and which one this is: explicit
flags, then `JAXPAR_*` environment variables, then JAX's own cluster detection (SLURM, Open MPI,
Kubernetes, Cloud TPU), else a single process. `initialize` joins the processes with a deadline
that ends in one sentence and a non-zero exit instead of a hang, and `preflight` stops every
process (exit 2) when they were not started with the same config, jaxpar version and mesh.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import warnings

from jaxpar import config as jconfig
from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel.watchdog import DEFAULT_HEARTBEAT_TIMEOUT, EXIT_FAILED, start_heartbeat
from jaxpar.version import __version__

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_INIT_TIMEOUT = "JAXPAR_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "JAXPAR_HEARTBEAT_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 300

# Launchers that say how many processes run and which one this is; with an explicit coordinator
# they fill in what the flags leave out (e.g. Open MPI 5, which JAX's own detection does not know).
# SLURM's come last: mpirun or mpiexec in a batch script hands every rank the batch step's
# SLURM_PROCID=0 beside its own rank.
_LAUNCHER_VARS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"),
                  ("SLURM_NTASKS", "SLURM_PROCID"))
_CLUSTER_NAMES = {"slurm": "SLURM", "ompi": "Open MPI", "gcetpu": "Cloud TPU",
                  "gketpu": "Cloud TPU", "K8sCluster": "Kubernetes"}


class DistributedError(RuntimeError):
  """The processes could not be joined or lost each other; the message is one sentence."""


class PreflightError(ConfigError):
  """The processes were started with different configs, versions or meshes (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """How this process joins the others; coordinator is None where the cluster tells JAX."""
  coordinator: str | None
  num_processes: int
  process_id: int
  source: str  # "flags", "environment", a cluster name, or "single process"
  init_timeout: float = DEFAULT_INIT_TIMEOUT
  heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT

  @property
  def multi(self) -> bool:
    return self.num_processes > 1


def add_flags(p: argparse.ArgumentParser) -> None:
  """--coordinator, --num-processes, --process-id and the two timeouts."""
  g = p.add_argument_group("multi-host (defaults: JAXPAR_* environment, then cluster detection)")
  g.add_argument("--coordinator", metavar="HOST:PORT",
                 help=f"address of process 0's coordinator (env {ENV_COORDINATOR})")
  g.add_argument("--num-processes", type=int, metavar="N",
                 help=f"number of processes (env {ENV_NUM_PROCESSES})")
  g.add_argument("--process-id", type=int, metavar="I",
                 help=f"this process, 0..N-1 (env {ENV_PROCESS_ID})")
  g.add_argument("--init-timeout", type=float, metavar="SECONDS",
                 help=f"give up joining after this long (env {ENV_INIT_TIMEOUT}, "
                      f"default {DEFAULT_INIT_TIMEOUT})")
  g.add_argument("--heartbeat-timeout", type=int, metavar="SECONDS",
                 help=f"JAX's coordination service aborts every process for one silent this long "
                      f"(from half of it on); train.peer_timeout names it first (env "
                      f"{ENV_HEARTBEAT_TIMEOUT}, default {DEFAULT_HEARTBEAT_TIMEOUT})")


def _int(name: str, text: str | None) -> int | None:
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ConfigError(f"{name}={text!r} is not an integer") from None


def _number(name: str, value, env: str, default: float, environ) -> float:
  if value is None:
    text = environ.get(env)
    if not text:
      return default
    try:
      value = float(text)
    except ValueError:
      raise ConfigError(f"{env}={text!r} is not a number of seconds") from None
  if value <= 0:
    raise ConfigError(f"{name}={value:g} must be a positive number of seconds")
  return value


def split_address(address: str) -> tuple[str, int]:
  """'host:port' or '[v6]:port' -> (host, port); anything else is a ConfigError naming it."""
  host, sep, port = address.rpartition(":")
  host = host.strip("[]")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"coordinator address {address!r} is not of the form HOST:PORT, "
                      f"e.g. 10.0.0.1:12345")
  return host, int(port)


def _detect_cluster() -> tuple[str, int, int, str | None] | None:
  """(name, process count, process id, coordinator or None) of the cluster JAX finds, else None."""
  try:
    from jax._src import clusters
    envs = [c for c in clusters.ClusterEnv._cluster_types if not c.opt_in_only_method]
  except (ImportError, AttributeError):  # the private module moved: explicit flags still work
    return None
  for env in envs:
    try:
      with warnings.catch_warnings():  # a pod without the kubernetes package is not a cluster
        warnings.simplefilter("ignore")
        present = env.is_env_present()
    except Exception:
      present = False
    if not present:
      continue
    name = _CLUSTER_NAMES.get(env.name or env.__name__, env.name or env.__name__)
    try:
      count, index = int(env.get_process_count()), int(env.get_process_id())
    except Exception as e:  # e.g. a pod that is not part of an indexed Job
      print(f"jaxpar: found {name} but not the number of processes ({e}); running as a single "
            f"process (set {ENV_COORDINATOR} and {ENV_NUM_PROCESSES} to join several)",
            file=sys.stderr)
      return None
    coordinator = None
    if env.name in ("slurm", "ompi"):  # read from the environment alone; others ask a service
      try:
        coordinator = env.get_coordinator_address(
            timeout_secs=None, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
      except Exception:  # JAX will report it in initialize()
        pass
    return name, count, index, coordinator
  return None


def resolve(args=None, environ=None) -> Spec:
  """How this process joins the others; never starts JAX's backend. Bad values are ConfigErrors."""
  environ = os.environ if environ is None else environ
  get = lambda name: getattr(args, name, None) if args is not None else None
  coordinator = get("coordinator") or environ.get(ENV_COORDINATOR) or None
  num = get("num_processes")
  if num is None:
    num = _int(ENV_NUM_PROCESSES, environ.get(ENV_NUM_PROCESSES))
  pid = get("process_id")
  if pid is None:
    pid = _int(ENV_PROCESS_ID, environ.get(ENV_PROCESS_ID))
  from_flags = any(get(n) is not None for n in ("coordinator", "num_processes", "process_id"))
  timeouts = {
      "init_timeout": _number("--init-timeout", get("init_timeout"), ENV_INIT_TIMEOUT,
                              DEFAULT_INIT_TIMEOUT, environ),
      "heartbeat_timeout": int(_number("--heartbeat-timeout", get("heartbeat_timeout"),
                                       ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, environ))}

  if coordinator is None and num is None and pid is None:
    found = _detect_cluster()
    if found is None or found[1] == 1:
      return Spec(None, 1, 0, "single process", **timeouts)
    name, count, index, address = found
    return Spec(address, count, index, name, **timeouts)

  if num is not None and num < 1:
    raise ConfigError(f"--num-processes={num} must be at least 1")
  if num == 1 and pid in (None, 0):
    return Spec(None, 1, 0, "single process", **timeouts)
  if coordinator is None:
    raise ConfigError(f"--num-processes={num} and --process-id={pid} need the coordinator's "
                      f"address too: pass --coordinator HOST:PORT or set {ENV_COORDINATOR}")
  split_address(coordinator)
  for size_var, rank_var in _LAUNCHER_VARS:  # a launcher may number the processes for us
    if num is None and pid is None and size_var in environ and rank_var in environ:
      num, pid = _int(size_var, environ[size_var]), _int(rank_var, environ[rank_var])
  if pid is None and "JOB_COMPLETION_INDEX" in environ:  # a Kubernetes indexed Job
    pid = _int("JOB_COMPLETION_INDEX", environ["JOB_COMPLETION_INDEX"])
  if num is None:
    raise ConfigError(f"--coordinator={coordinator} needs the number of processes too: pass "
                      f"--num-processes N or set {ENV_NUM_PROCESSES}")
  if pid is None:
    raise ConfigError(f"--coordinator={coordinator} needs this process's number too: pass "
                      f"--process-id I or set {ENV_PROCESS_ID}")
  if not 0 <= pid < num:
    raise ConfigError(f"--process-id={pid} must be in 0..{num - 1} for --num-processes={num}")
  return Spec(coordinator, num, pid, "flags" if from_flags else "environment", **timeouts)


def _who(spec: Spec) -> str:
  return f"process {spec.process_id} of {spec.num_processes}"


def _reachable(address: str) -> bool:
  """Whether something accepts TCP connections at `address` (within 3 s)."""
  try:
    host, port = split_address(address)
    with socket.create_connection((host, port), timeout=3):
      return True
  except (OSError, ConfigError):
    return False


def _init_failure(spec: Spec, waited: float) -> str:
  """The one sentence for a process that could not join within the deadline."""
  address = spec.coordinator or "the address the cluster gave"
  head = f"{_who(spec)} could not join the coordinator at {address} after {waited:.0f} s"
  n = spec.num_processes
  if spec.process_id == 0:
    others = "process 1" if n == 2 else f"processes 1..{n - 1}"
    return (f"{head}: not all {n} processes joined (start {others} with --coordinator "
            f"{address} --num-processes {n} and each its own --process-id, or raise "
            f"--init-timeout if some start late)")
  if spec.coordinator is None:
    return (f"{head}: not all {n} processes joined (check that every task of the job started, "
            f"or raise --init-timeout if some start late)")
  if not _reachable(spec.coordinator):
    return (f"{head}: nothing answers at that address (is process 0 running, is the address "
            f"right and the port open between the hosts?)")
  return (f"{head}: the coordinator answers but not all {n} processes joined (do all use the "
          f"same --num-processes, and is every --process-id started once?)")


def initialize(spec: Spec) -> None:
  """Joins the processes of `spec` (no-op for one process); must run before JAX's backend starts."""
  if not spec.multi:
    return
  import jax
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across hosts
  # JAX's own timeout ends the process with an abort and a stack trace; this watchdog (connecting
  # releases the GIL) prints one sentence and exits first.
  done = threading.Event()
  t0 = time.monotonic()

  def watchdog():
    if done.wait(spec.init_timeout):
      return
    print(f"error: {_init_failure(spec, time.monotonic() - t0)}", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)

  threading.Thread(target=watchdog, name="jaxpar-init-watchdog", daemon=True).start()
  try:
    jax.distributed.initialize(
        spec.coordinator, spec.num_processes, spec.process_id,
        initialization_timeout=int(spec.init_timeout) * 2 + 30,  # the watchdog's deadline wins
        heartbeat_timeout_seconds=spec.heartbeat_timeout,
        # A process that finished waits this long for the others at exit, then gives up.
        shutdown_timeout_seconds=max(spec.heartbeat_timeout, 30))
  except Exception as e:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise DistributedError(f"{_who(spec)} could not join the coordinator at "
                           f"{spec.coordinator or 'the address the cluster gave'} after "
                           f"{time.monotonic() - t0:.0f} s: {first}") from e
  finally:
    done.set()
  start_heartbeat(spec.process_id, spec.heartbeat_timeout)



def is_main() -> bool:
  """Whether this is process 0, the one that logs and writes metrics."""
  import jax
  return jax.process_index() == 0


# -- preflight -------------------------------------------------------------------------------------

def _flat(tree, prefix: str = "") -> dict[str, str]:
  """{'train': {'lr': 1e-3}} -> {'train.lr': '0.001'} (values as canonical JSON)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=str)
  return out


def fingerprint(cfg, mesh_shape: tuple[int, ...]) -> dict[str, str]:
  """Everything that must be equal on every process, name -> text."""
  import jax
  out = {"jaxpar version": __version__, "jax version": jax.__version__,
         "mesh": f"{jmesh.spec_str(mesh_shape)} over {jax.device_count()} devices"}
  out.update(_flat(jconfig.to_dict(cfg)))
  return out


def _hash(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def _differ(rows, names: list[str]) -> tuple[list[int], list[str]]:
  """(processes whose row differs from process 0's, names of the columns that differ)."""
  bad = [p for p in range(1, len(rows)) if (rows[p] != rows[0]).any()]
  cols = [names[c] for c in range(len(names)) if any(rows[p][c] != rows[0][c] for p in bad)]
  return bad, cols


def preflight(cfg, mesh_shape: tuple[int, ...]) -> None:
  """Raises PreflightError on every process unless all run the same config, version and mesh."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  # Processes all-gather a few hashes; when they differ, a second all-gather of one hash per config
  # key names what differs. Every process sees the same hashes, so all take the same branch.
  mine = fingerprint(cfg, mesh_shape)
  config_keys = sorted(k for k in mine if "." in k)
  head = ["jaxpar version", "jax version", "mesh", "config keys", "config"]
  summary = [mine[head[0]], mine[head[1]], mine[head[2]], "\n".join(config_keys),
             "\n".join(f"{k}={mine[k]}" for k in config_keys)]
  rows = np.asarray(multihost_utils.process_allgather(
      np.array([_hash(t) for t in summary], np.uint32)))
  bad, what = _differ(rows, head)
  if not bad:
    _check_data_layout(mesh_shape)
    return
  if what == ["config"]:  # same keys everywhere: a second exchange names the keys that differ
    rows = np.asarray(multihost_utils.process_allgather(
        np.array([_hash(mine[k]) for k in config_keys], np.uint32)))
    bad, what = _differ(rows, config_keys)
  names = ", ".join(map(str, bad))
  here = "; ".join(f"{w}={mine[w]}" if w in mine else w for w in what[:4])
  raise PreflightError(
      f"preflight: process{'es' if len(bad) > 1 else ''} {names} started with a different "
      f"{', '.join(what[:4])}{' ...' if len(what) > 4 else ''} than process 0 (process "
      f"{jax.process_index()} has {here}); every process must run the same config, jaxpar "
      f"version and mesh, so all of them stop before the first step")


def _check_data_layout(mesh_shape: tuple[int, ...]) -> None:
  """ConfigError unless process i's devices are exactly data-axis block i of the mesh."""
  # The loader gives process i rows [i*B/P, (i+1)*B/P) of every global batch.
  import jax
  import numpy as np
  d, n, procs = mesh_shape[0], int(np.prod(mesh_shape)), jax.process_count()
  if n != jax.device_count():
    return  # mesh.check says this, in its own words
  shape = jmesh.spec_str(mesh_shape)
  if d % procs:
    raise ConfigError(f"mesh {shape} over {procs} processes: data={d} must be a multiple of the "
                      f"number of processes, since each process reads its own share of every "
                      f"batch")
  devices = jmesh.make(mesh_shape, jax.devices()).devices
  per = d // procs
  for p in range(procs):
    rows = sorted({i for i in range(d) for dev in devices[i].flat if dev.process_index == p})
    if rows != list(range(p * per, (p + 1) * per)):
      raise ConfigError(f"mesh {shape} over {procs} processes: process {p} holds data rows "
                        f"{rows}, not the block {p * per}..{(p + 1) * per - 1} its loader reads")


# -- a lost peer -----------------------------------------------------------------------------------

# How a collective reports that the process at the other end is gone (gloo on CPU; the coordination
# service's own words once heartbeats stop).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "socket closed", "stopped sending heartbeats", "heartbeat timeout")


def lost_peer(e: BaseException) -> str | None:
  """The one sentence for an error that means another process died, else None."""
  import jax
  if jax.process_count() == 1:
    return None
  text = str(e)
  if not any(s in text.lower() for s in _PEER_LOST):
    return None
  detail = re.sub(r"\[[^\]]*\.cc:\d+\]\s*", "", text.strip().splitlines()[0])
  detail = re.sub(r"^[A-Z_]+: ", "", detail)
  me, n = jax.process_index(), jax.process_count()
  who = f"process {1 - me}" if n == 2 else "another process"
  return (f"process {me} of {n} lost {who} during training ({detail}); stopping now, the last "
          f"complete checkpoint is kept: restart all processes to resume")


def exit_if_peer_lost(e: BaseException) -> None:
  """Prints the sentence and ends this process at once when `e` means a peer died."""
  message = lost_peer(e)
  if message is None:
    return
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  # A normal exit would first wait at JAX's shutdown barrier for the dead process, then abort.
  os._exit(EXIT_FAILED)
