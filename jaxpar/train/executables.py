"""Compiled training steps kept on disk, so that a restart loads its step without tracing it.

JAX's persistent cache (train.compile_cache) saves the XLA compile, but it finds its entry by the
lowered program: a restart still traces and lowers the whole step before the cache can answer,
0.5 s of gpt_medium's 0.8 s restart compile on a CPU, and more the larger the model. The step of
a jaxpar run is fixed before it is traced by what `fingerprint` hashes:

  jaxpar's own source files; the config's keys that enter the step (all but `EXCLUDED`); the
  state's and the batch's shapes, dtypes and shardings (memory kinds included); the devices (ids,
  kinds, processes) and the mesh; this process's index and the process count; the versions of
  Python and of every installed jax, jaxlib, plugin, flax, optax, numpy and ml_dtypes
  distribution; the backend's platform and its version; the host's CPU (model and instruction
  set flags: XLA:CPU compiles for the host it runs on); every JAX option's value but those of
  the cache and of logging; and the environment's XLA, JAX, TPU and LIBTPU variables but the
  cache's (and but XLA's simulated CPU device count, which plan.py and train.py may set
  differently for one mesh: the devices the step runs on are keyed themselves).

The serialized executable is kept under that key in <train.compile_cache>/jaxpar-steps/, and a
run with the same key loads it instead of tracing. A run that differs in any of these misses and
compiles its step past JAX's cache (`compile_fresh`: an executable JAX's cache loads cannot be
kept, see `save`), and keeps it; nothing needs clearing. The store is bounded
(train.compile_cache_max_gb): a load marks its entry used (its modification time), and a save
removes the least recently used entries until the rest fit. What no key can see is code changed
inside the running process (a jaxpar function replaced at run time): the store is used where
jaxpar's files run as they are on disk, by `jaxpar-train` and `jaxpar-plan`, or by a caller of
loop.run that asks for it.

A stored step is machine code this process runs, and unpickling its entry runs code too, so the
store is a trust boundary (cache_folder.py: what the folder is trusted for). Its folder is made
0700, held open and used only while it is this user's and no one else can write it. Each entry
opens with a fixed header outside the pickle: the format, the key, and an HMAC-SHA256 over both
and the payload under a per-user secret (cache_folder.secret, a 0600 file). An entry whose
header, key or MAC does not match (another user's, relabelled, damaged, cut short, of another
format) is a miss with a note, checked before a byte of it is unpickled or deserialized. A
folder shared by several hosts is trusted exactly among those that hold the same secret file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pickle
import platform
import re
import sys
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

import jaxpar
from jaxpar import config as jconfig
from jaxpar.train import cache_folder
from jaxpar.train.cache_folder import ENV_SECRET, note  # noqa: F401 (ENV_SECRET: the store's)

FOLDER = "jaxpar-steps"  # inside the compilation cache's folder
MAGIC = b"jaxpar step 2\n"  # an entry's first bytes; then the key (64 hex digits), the MAC
SUFFIX = ".pkl"
# Config keys that do not enter the traced step, left out of the key so that changing one still
# loads the stored step. Each is read only outside the step:
EXCLUDED = (
    # when the host fetches metrics, evaluates (its own program) and saves (loop.py, hooks.py)
    "train.log_every", "train.eval_every", "train.eval_steps",
    "checkpoint.every", "checkpoint.keep",
    # the loss-spike guard judges fetched losses on the host and restores a host copy (guard.py)
    "train.spike_factor", "train.spike_steps", "train.spike_window", "train.max_rollbacks",
    # the watchdog's limits (parallel/watchdog.py)
    "train.stall_timeout", "train.first_step_timeout", "train.peer_timeout",
    # where compiled programs are kept, and how many
    "train.compile_cache", "train.compile_cache_max_gb",
    # where the first weights come from: the state, not the step (its shapes are keyed)
    "model.init_from",
    # what the data pipeline reads and how; the step sees only the batch, whose shapes, dtypes
    # and shardings are keyed (an image dataset's shape reaches the CNN's parameters likewise)
    *(f"data.{f.name}" for f in dataclasses.fields(jconfig.DataConfig)),
)
# train.seed enters the step only through the key of a model that takes one (dropout: step.py);
# else it only seeds the initial state and the data order.
_SEED = "train.seed"
# JAX options and variables that only say where and whether programs are cached, or what is
# logged: neither changes the compiled program.
_QUIET_OPTIONS = ("jax_enable_compilation_cache", "jax_compilation_cache_",
                  "jax_persistent_cache_min_", "jax_raise_persistent_cache_errors",
                  "jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level",
                  "jax_debug_log_modules")
_QUIET_ENV = ("JAX_ENABLE_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_", "JAX_PERSISTENT_CACHE_MIN_",
              # where the processes meet (a new port each job on a cluster): the devices, the
              # process index and the count are keyed themselves
              "JAX_COORDINATOR_", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")
_CPUINFO = "/proc/cpuinfo"
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags",  # x86
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")  # Arm
_DISTRIBUTIONS = ("flax", "optax", "numpy", "ml_dtypes", "ml-dtypes")
_ENV_PREFIXES = ("XLA_", "JAX_", "TPU_", "LIBTPU")
# XLA's simulated CPU device count: plan.py and train.py may set it differently for one mesh
# (the devices the step runs on are keyed themselves)
_DEVICE_COUNT_FLAG = re.compile(r"\s*--xla_force_host_platform_device_count=\S*")
_source: str | None = None
_cpu: list[str] | None = None


def folder(say: Callable[[str], None] = note) -> cache_folder.Folder | None:
  """The store's folder inside JAX's compilation cache (cli.use_compile_cache), or None when the
  cache is off (`store_folder` says when else)."""
  if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
    return None
  return store_folder(jax.config.jax_compilation_cache_dir, say)


def store_folder(cache: str, say: Callable[[str], None] = note) -> cache_folder.Folder | None:
  """The store's folder inside the cache folder `cache`, made 0700 if missing and held open;
  None (with one note) when it cannot be made, is not trusted (cache_folder.open_folder) or the
  secret cannot be had (cache_folder.secret)."""
  where = cache_folder.open_folder(cache, FOLDER, say)
  if where is None:
    return None
  try:
    cache_folder.secret()
  except (OSError, ValueError) as e:
    say(f"no step store: {e}")
    return None
  return where


def _source_digest() -> str:
  """sha256 over the path and bytes of every .py file of the jaxpar package, once per process."""
  global _source
  if _source is None:
    root, h = os.path.dirname(os.path.abspath(jaxpar.__file__)), hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames.sort()
      for name in sorted(f for f in filenames if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
          h.update(f.read() + b"\0")
    _source = h.hexdigest()
  return _source


def _host_cpu() -> list[str]:
  """The host CPU's model and instruction-set flags (the first processor's lines of
  /proc/cpuinfo), or elsewhere what `platform` says of the machine and processor."""
  global _cpu
  if _cpu is None:
    try:
      with open(_CPUINFO) as f:
        first = f.read().split("\n\n")[0]
      lines = [line.split(":", 1) for line in first.splitlines() if ":" in line]
      _cpu = [f"{k.strip()}: {v.strip()}" for k, v in lines if k.strip() in _CPU_FIELDS]
    except OSError:
      _cpu = []
    if not _cpu:
      _cpu = [platform.system(), platform.machine(), platform.processor()]
  return _cpu


def _versions() -> dict[str, str]:
  out = {"python": sys.version}
  for d in importlib.metadata.distributions():
    name = (d.metadata["Name"] or "").lower()
    if name.startswith(("jax", "libtpu")) or name in _DISTRIBUTIONS:
      out[name] = d.version
  return out


def _leaves(tree: Any, shardings: Any) -> list[str]:
  """path, shape, dtype and sharding of each leaf of the abstract `tree`."""
  pairs = zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(shardings))
  return [f"{jax.tree_util.keystr(p)} {a.shape} {a.dtype} {s!r}" for (p, a), s in pairs]


def step_config(trainer) -> dict[str, Any]:
  """The config keys (section.name) of `trainer`'s run that enter its step: all but EXCLUDED,
  and train.seed only for a model that takes a key."""
  left = set(EXCLUDED) | (set() if trainer.model.takes_rng else {_SEED})
  return {f"{section}.{name}": value
          for section, values in dataclasses.asdict(trainer.cfg).items()
          for name, value in values.items() if f"{section}.{name}" not in left}


def fingerprint(trainer, batch_abstract: Any, batch_sharding: Any) -> str:
  """The key of `trainer`'s step for batches like `batch_abstract` (see the module's doc)."""
  mesh = trainer.mesh
  device = mesh.devices.flat[0]
  parts = {
      "what": "jaxpar train step 2",
      "source": _source_digest(),
      "config": json.dumps(step_config(trainer), sort_keys=True, default=repr),
      "state": _leaves(trainer.abstract_state, trainer.state_shardings),
      "batch": [str(jax.tree_util.tree_structure(batch_abstract)),
                *_leaves(batch_abstract, batch_sharding)],
      "mesh": [dict(mesh.shape), [(d.id, d.process_index, d.platform, d.device_kind)
                                  for d in mesh.devices.flat]],
      "process": [jax.process_index(), jax.process_count()],
      "versions": _versions(),
      "backend": [device.client.platform, device.client.platform_version],
      "cpu": _host_cpu(),
      "options": {k: repr(v) for k, v in sorted(jax.config.values.items())
                  if not k.startswith(_QUIET_OPTIONS)},
      "env": _env(),
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _env() -> dict[str, str]:
  """The environment's variables that may change the compiled program (see the module's doc)."""
  env = {k: v for k, v in sorted(os.environ.items())
         if k.startswith(_ENV_PREFIXES) and not k.startswith(_QUIET_ENV)}
  if "XLA_FLAGS" in env:
    # the flags as words: where the count was dropped, the spaces around it do not count
    env["XLA_FLAGS"] = " ".join(_DEVICE_COUNT_FLAG.sub("", env["XLA_FLAGS"]).split())
    if not env["XLA_FLAGS"]:
      del env["XLA_FLAGS"]
  return env


def stored(where: cache_folder.Folder, key: str) -> bool:
  """Whether an entry is kept under `key` (`load` says whether it loads)."""
  return where.exists(key + SUFFIX)


def load(where: cache_folder.Folder, key: str, args_abstract: Any, devices: list,
         say: Callable[[str], None] = note) -> jax.stages.Compiled | None:
  """The step stored under `key`, loaded onto `devices` (its mesh's, in the mesh's order), or
  None: none is stored, or what is there fails its check (cache_folder.unseal, one note), cannot
  be loaded or takes other arguments than `args_abstract` (a miss either way; a new entry
  replaces it). Nothing of an entry is unpickled before its MAC is checked."""
  path = os.path.join(where.path, key + SUFFIX)
  try:
    why = where.why_not()
    if why:
      say(cache_folder.refusal(where.path, why))
      return None
    blob = where.read(key + SUFFIX)
  except OSError as e:
    say(f"the stored step {path} cannot be read ({e.strerror}); the step is compiled")
    return None
  if blob is None:
    return None
  try:
    payload, why = cache_folder.unseal(MAGIC, key, blob)
  except (OSError, ValueError) as e:  # no secret: nothing is trusted
    payload, why = None, str(e)
  if why:
    say(f"the stored step {path} is not loaded: {why}; the step is compiled and stored anew")
    return None
  try:
    entry = pickle.loads(payload)
  except Exception:  # noqa: BLE001 (this user's, but from another version: a miss)
    return None
  if not isinstance(entry, dict):
    return None
  if entry.get("in_tree") != jax.tree_util.tree_structure((args_abstract, {})):
    return None
  try:
    compiled = serialize_executable.deserialize_and_load(
        entry["payload"], entry["in_tree"], entry["out_tree"],
        execution_devices=devices)
  except Exception:  # noqa: BLE001
    return None
  shapes = lambda tree: [(tuple(a.shape), a.dtype) for a in jax.tree_util.tree_leaves(tree)]
  if shapes(compiled.args_info) != shapes(args_abstract):
    return None
  where.touch(key + SUFFIX)  # used now: the last entry a bounded store gives up
  return compiled


def compile_fresh(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
  """`lowered` compiled by XLA, past JAX's persistent cache (neither read nor written), so that
  `save` can keep it. JAX decides once whether its cache is used and keeps that answer, and the
  option alone would only change the cache's key: its state is reset around the compile, with
  the cache off meanwhile. A compile in another thread meanwhile (a checkpoint's read) goes past
  the cache too."""
  was = jax.config.jax_enable_compilation_cache
  compilation_cache.reset_cache()
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    return lowered.compile()
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()  # the next compile looks again, and uses it as before


def save(where: cache_folder.Folder, key: str, compiled: jax.stages.Compiled,
         max_bytes: int = 0, say: Callable[[str], None] = note) -> bool:
  """Keeps `compiled` under `key`, behind its header and MAC; False (one note, and nothing
  written) where it cannot be serialized or the folder cannot be written (a full disk). The file
  appears whole or not at all (written aside, renamed), mode 0600. With `max_bytes` > 0 the least
  recently used other entries then go until the store fits (Folder.prune).

  `compiled` must come from XLA's compiler in this process (`compile_fresh`), not from JAX's
  persistent cache: on XLA:CPU (JAX 0.10.2) an executable loaded from that cache serializes
  without its kernels, and the copy loads but fails at its first run (`NOT_FOUND: Function
  multiply_add_fusion not found`).
  """
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    blob = pickle.dumps({"payload": payload, "in_tree": in_tree, "out_tree": out_tree},
                        protocol=pickle.HIGHEST_PROTOCOL)
  except Exception as e:  # noqa: BLE001 (e.g. a program with constants JAX cannot serialize)
    say(f"the step cannot be kept in the step store ({type(e).__name__}: {e}); the next run "
        f"compiles it again")
    return False
  try:
    why = where.why_not()
    if why:
      say(cache_folder.refusal(where.path, why))
      return False
    where.write(key + SUFFIX, cache_folder.seal(MAGIC, key, blob))
  except (OSError, ValueError) as e:
    say(f"the step could not be kept in the step store {where.path} "
        f"({getattr(e, 'strerror', None) or e}); the next run compiles it again")
    return False
  if max_bytes > 0:
    where.prune(max_bytes, MAGIC, SUFFIX, keep=key, say=say)
  return True
