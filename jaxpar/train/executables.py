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
  cache's.

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
store is a trust boundary. Its folder (and the cache's, `untrusted`) is made 0700 and used only
while it is this user's and no one else can write it. Each entry opens with a fixed header
outside the pickle: the format, the key, and an HMAC-SHA256 over both and the payload under a
per-user secret (`secret`, a 0600 file). An entry whose header, key or MAC does not match
(another user's, relabelled, damaged, cut short, of another format) is a miss with a note,
checked before a byte of it is unpickled or deserialized. A folder shared by several hosts is
trusted exactly among those that hold the same secret file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib.metadata
import json
import os
import pickle
import platform
import secrets
import stat
import sys
import tempfile
import time
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

import jaxpar
from jaxpar import config as jconfig

FOLDER = "jaxpar-steps"  # inside the compilation cache's folder
ENV_SECRET = "JAXPAR_STEP_SECRET"  # the secret's file, instead of the user's config folder's
MAGIC = b"jaxpar step 2\n"  # an entry's first bytes; then the key (64 hex digits), the MAC
_MAC_BYTES = 32
_HEADER = len(MAGIC) + 64 + _MAC_BYTES
# Config keys that do not enter the traced step, left out of the key so that changing one still
# loads the stored step. Each is read only outside the step:
EXCLUDED = (
    # when the host fetches metrics, evaluates (its own program) and saves (loop.py, hooks.py)
    "train.log_every", "train.eval_every", "train.eval_steps",
    "checkpoint.every", "checkpoint.keep",
    # the loss-spike guard judges fetched losses on the host and restores a host copy (guard.py)
    "train.spike_factor", "train.spike_steps", "train.spike_window", "train.max_rollbacks",
    # the watchdog's limits (parallel/watchdog.py)
    "train.stall_timeout", "train.first_step_timeout",
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
_STALE_TMP_S = 86400.0  # a save takes seconds: a file written aside a day ago was left
_source: str | None = None
_cpu: list[str] | None = None
_secret: bytes | None = None


def note(text: str) -> None:
  """Says why the cache or the store is not used for something; the run goes on without it."""
  print(f"note: {text}", file=sys.stderr, flush=True)


def untrusted(path: str) -> str | None:
  """Why the folder `path` must not be read from or written to, or None: it is not this user's,
  or others (group or anyone) may write it, and so may plant a program there that this process
  would load and run."""
  st = os.stat(path)
  if not stat.S_ISDIR(st.st_mode):
    return "is not a folder"
  uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
  if st.st_uid != uid:
    return f"belongs to user id {st.st_uid}, not to this user ({uid})"
  if st.st_mode & 0o022:
    who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002))
                       if st.st_mode & bit)
    return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def remove_foreign(path: str) -> list[str]:
  """Removes the files directly in the folder `path` that are not this user's or that others
  may write (left from a time the folder was shared, or written under a loose umask): JAX runs
  its programs as it finds them, with no check of its own. Returns their names."""
  uid, gone = os.getuid() if hasattr(os, "getuid") else None, []
  for entry in os.scandir(path):
    try:
      st = entry.stat(follow_symlinks=False)
      if not stat.S_ISDIR(st.st_mode) and (st.st_mode & 0o022 or uid not in (None, st.st_uid)):
        os.remove(entry.path)
        gone.append(entry.name)
    except OSError:
      continue
  return gone


def refusal(path: str, why: str, unused: str = "no step store") -> str:
  """The note for a folder `untrusted` refuses."""
  return (f"the folder {path} {why}, so another user could plant programs there that this run "
          f"would execute: it is not used ({unused}). Make it yours and run `chmod go-w {path}`, "
          f"or set train.compile_cache to another folder")


def make_private(path: str) -> None:
  """Makes the folder `path` (and its parents) if missing, the folder itself mode 0700."""
  if not os.path.isdir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # whatever the umask


def folder(say: Callable[[str], None] = note) -> str | None:
  """The store's folder inside JAX's compilation cache (cli.use_compile_cache), or None when the
  cache is off (`store_folder` says when else)."""
  if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
    return None
  return store_folder(jax.config.jax_compilation_cache_dir, say)


def store_folder(cache: str, say: Callable[[str], None] = note) -> str | None:
  """The store's folder inside the cache folder `cache`, made 0700 if missing; None (with one
  note) when it cannot be made, is not trusted (`untrusted`) or the secret cannot be had
  (`secret`)."""
  where = os.path.join(cache, FOLDER)
  try:
    make_private(where)
    why = untrusted(where)
  except OSError as e:
    say(f"no step store: {where} cannot be made ({e.strerror})")
    return None
  if why:
    say(refusal(where, why))
    return None
  try:
    secret()
  except (OSError, ValueError) as e:
    say(f"no step store: {e}")
    return None
  return where


def secret_path(environ=None) -> str:
  """$JAXPAR_STEP_SECRET, else $XDG_CONFIG_HOME/jaxpar/step-secret (~/.config/jaxpar/...)."""
  environ = os.environ if environ is None else environ
  if environ.get(ENV_SECRET):
    return os.path.abspath(os.path.expanduser(environ[ENV_SECRET]))
  base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
  return os.path.join(base, "jaxpar", "step-secret")


def secret() -> bytes:
  """This user's key for the stores' MACs (`secret_path`): made once (32 random bytes, mode 0600,
  in a 0700 folder), then read. Raises ValueError with a sentence where the file is not this
  user's, others may read or write it, or it is too short: a key others know proves nothing."""
  global _secret
  if _secret is not None:
    return _secret
  path = secret_path()
  if not os.path.exists(path):
    make_private(os.path.dirname(path))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".step-secret.")  # 0600
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
      try:
        os.link(tmp, path)  # whole or absent; a process making it at the same time wins alike
      except FileExistsError:
        pass
    finally:
      os.remove(tmp)
  with open(path, "rb") as f:
    st = os.fstat(f.fileno())
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid or st.st_mode & 0o077:
      raise ValueError(f"the step store's secret {path} must be this user's alone "
                       f"(`chmod 600 {path}`; it is mode {stat.S_IMODE(st.st_mode):o}, user id "
                       f"{st.st_uid})")
    key = f.read()
  if len(key) < 16:
    raise ValueError(f"the step store's secret {path} holds {len(key)} bytes; it needs at least "
                     f"16 (remove it, and one is made)")
  _secret = key
  return key


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
      "env": {k: v for k, v in sorted(os.environ.items())
              if k.startswith(_ENV_PREFIXES) and not k.startswith(_QUIET_ENV)},
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(where: str, key: str) -> str:
  return os.path.join(where, f"{key}.pkl")


def _mac(key: str, payload: bytes) -> bytes:
  return hmac.new(secret(), MAGIC + key.encode() + payload, hashlib.sha256).digest()


def _checked(blob: bytes, key: str) -> str | None:
  """Why the entry `blob` is not what this user's jaxpar stored under `key`, or None."""
  if len(blob) < _HEADER or not blob.startswith(MAGIC):
    return "it is not an entry of this jaxpar (another format, or cut short)"
  at = len(MAGIC)
  if blob[at:at + 64] != key.encode():
    return "it is labelled with another key"
  mac = blob[at + 64:_HEADER]
  if not hmac.compare_digest(mac, _mac(key, blob[_HEADER:])):
    return ("its MAC does not match (damaged, cut short, or written without this user's secret "
            f"{secret_path()})")
  return None


def stored(where: str, key: str) -> bool:
  """Whether an entry is kept under `key` (`load` says whether it loads)."""
  return os.path.isfile(_path(where, key))


def load(where: str, key: str, args_abstract: Any, devices: list,
         say: Callable[[str], None] = note) -> jax.stages.Compiled | None:
  """The step stored under `key`, loaded onto `devices` (its mesh's, in the mesh's order), or
  None: none is stored, or what is there fails its check (`_checked`, one note), cannot be
  loaded or takes other arguments than `args_abstract` (a miss either way; a new entry replaces
  it). Nothing of an entry is unpickled before its MAC is checked."""
  path = _path(where, key)
  try:
    why = untrusted(where)
    if why:
      say(refusal(where, why))
      return None
    with open(path, "rb") as f:
      blob = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:
    say(f"the stored step {path} cannot be read ({e.strerror}); the step is compiled")
    return None
  try:
    why = _checked(blob, key)
  except (OSError, ValueError) as e:  # no secret: nothing is trusted
    why = str(e)
  if why:
    say(f"the stored step {path} is not loaded: {why}; the step is compiled and stored anew")
    return None
  try:
    entry = pickle.loads(blob[_HEADER:])
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
  try:
    os.utime(path)  # used now: the last entry a bounded store gives up
  except OSError:
    pass  # a read-only store still loads
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


def save(where: str, key: str, compiled: jax.stages.Compiled, max_bytes: int = 0,
         say: Callable[[str], None] = note) -> bool:
  """Keeps `compiled` under `key`, behind its header and MAC; False (one note, and nothing
  written) where it cannot be serialized or the folder cannot be written (a full disk). The file
  appears whole or not at all (written aside, renamed), mode 0600. With `max_bytes` > 0 the least
  recently used other entries then go until the store fits (`prune`).

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
  tmp = None
  try:
    make_private(where)
    why = untrusted(where)
    if why:
      say(refusal(where, why))
      return False
    header = MAGIC + key.encode() + _mac(key, blob)
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{key}.", suffix=".tmp")  # mode 0600
    with os.fdopen(fd, "wb") as f:
      f.write(header)
      f.write(blob)
    os.replace(tmp, _path(where, key))
  except (OSError, ValueError) as e:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    say(f"the step could not be kept in the step store {where} "
        f"({getattr(e, 'strerror', None) or e}); the next run compiles it again")
    return False
  if max_bytes > 0:
    prune(where, max_bytes, keep=key)
  return True


def prune(where: str, max_bytes: int, keep: str | None = None, suffix: str = ".pkl",
          beside: tuple[str, ...] = ()) -> list[str]:
  """Removes the least recently used entries of the folder `where` (files named <key><suffix>;
  used last at the later of their modification and access times) until those left take at most
  `max_bytes`; the entry `keep` stays even if it alone is larger. Files <key><b> for each b in
  `beside` go with their entry. Returns the keys removed. An entry another process removes
  first, or one that cannot be removed, is passed by. A save's file written aside (.*.tmp) and
  left by a process killed before its rename goes after a day.
  """
  entries, now = [], time.time()
  for name in os.listdir(where):
    path = os.path.join(where, name)
    try:
      st = os.stat(path)
      if name.startswith(".") and name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
        os.remove(path)
    except OSError:
      continue
    if name.endswith(suffix) and not name.startswith(".") and stat.S_ISREG(st.st_mode):
      entries.append((max(st.st_mtime, st.st_atime), name[:-len(suffix)], st.st_size))
  total, removed = sum(size for _, _, size in entries), []
  for _, key, size in sorted(entries):
    if total <= max_bytes:
      break
    if key == keep:
      continue
    try:
      os.remove(os.path.join(where, key + suffix))
    except FileNotFoundError:  # another process pruning beside this one took it: gone all the same
      total -= size
      continue
    except OSError:
      continue
    for b in beside:
      try:
        os.remove(os.path.join(where, key + b))
      except OSError:
        pass
    total -= size
    removed.append(key)
  return removed
