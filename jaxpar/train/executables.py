"""Compiled training steps kept on disk, so that a restart loads its step without tracing it.

JAX's persistent cache (train.compile_cache) saves the XLA compile, but it finds its entry by the
lowered program: a restart still traces and lowers the whole step before the cache can answer,
0.5 s of gpt_medium's 0.8 s restart compile on a CPU, and more the larger the model. The step of
a jaxpar run is fixed before it is traced by what `fingerprint` hashes:

  jaxpar's own source files; the run's config; the state's and the batch's shapes, dtypes and
  shardings (memory kinds included); the devices (ids, kinds, processes) and the mesh; this
  process's index and the process count; the versions of Python and of every installed jax,
  jaxlib, plugin, flax, optax, numpy and ml_dtypes distribution; the backend's platform and its
  version; every JAX option's value; and the environment's XLA, JAX, TPU and LIBTPU variables.

The serialized executable is kept under that key in <train.compile_cache>/jaxpar-steps/, and a
run with the same key loads it instead of tracing. A run that differs in any of these misses,
traces and compiles as before (JAX's own cache may still spare the compile), and keeps its own
entry; nothing needs clearing. The store is bounded (train.compile_cache_max_gb): a load marks its
entry used (its modification time), and a save removes the least recently used entries until
the rest fit. What no key can see is code changed inside the running process
(a jaxpar function replaced at run time): the store is used where jaxpar's files run as they are
on disk, by `jaxpar-train` (scripts/train.py), or by a caller of loop.run that asks for it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pickle
import stat
import sys
import tempfile
import time
from typing import Any

import jax
from jax.experimental import serialize_executable

import jaxpar

FOLDER = "jaxpar-steps"  # inside the compilation cache's folder
_DISTRIBUTIONS = ("flax", "optax", "numpy", "ml_dtypes", "ml-dtypes")
_ENV_PREFIXES = ("XLA_", "JAX_", "TPU_", "LIBTPU")
_STALE_TMP_S = 86400.0  # a save takes seconds: a file written aside a day ago was left
_source: str | None = None


def folder() -> str | None:
  """The store's folder inside JAX's compilation cache (cli.use_compile_cache), None when off."""
  if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
    return None
  return os.path.join(jax.config.jax_compilation_cache_dir, FOLDER)


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


def fingerprint(trainer, batch_abstract: Any, batch_sharding: Any) -> str:
  """The key of `trainer`'s step for batches like `batch_abstract` (see the module's doc)."""
  mesh = trainer.mesh
  device = mesh.devices.flat[0]
  parts = {
      "what": "jaxpar train step 1",
      "source": _source_digest(),
      "config": json.dumps(dataclasses.asdict(trainer.cfg), sort_keys=True, default=repr),
      "state": _leaves(trainer.abstract_state, trainer.state_shardings),
      "batch": [str(jax.tree_util.tree_structure(batch_abstract)),
                *_leaves(batch_abstract, batch_sharding)],
      "mesh": [dict(mesh.shape), [(d.id, d.process_index, d.platform, d.device_kind)
                                  for d in mesh.devices.flat]],
      "process": [jax.process_index(), jax.process_count()],
      "versions": _versions(),
      "backend": [device.client.platform, device.client.platform_version],
      "options": {k: repr(v) for k, v in sorted(jax.config.values.items())},
      "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(where: str, key: str) -> str:
  return os.path.join(where, f"{key}.pkl")


def stored(where: str, key: str) -> bool:
  """Whether an entry is kept under `key` (`load` says whether it loads)."""
  return os.path.isfile(_path(where, key))


def load(where: str, key: str, args_abstract: Any,
         devices: list) -> jax.stages.Compiled | None:
  """The step stored under `key`, loaded onto `devices` (its mesh's, in the mesh's order), or
  None: none is stored, or what is there cannot be loaded or takes other arguments than
  `args_abstract` (a miss either way; a new entry replaces it)."""
  try:
    with open(_path(where, key), "rb") as f:
      entry = pickle.load(f)
  except FileNotFoundError:
    return None
  except Exception:  # noqa: BLE001 (cut short, or from another version: a miss, not an error)
    return None
  if not isinstance(entry, dict) or entry.get("key") != key:
    return None
  if entry["in_tree"] != jax.tree_util.tree_structure((args_abstract, {})):
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
    os.utime(_path(where, key))  # used now: the last entry a bounded store gives up
  except OSError:
    pass  # a read-only store still loads
  return compiled


def save(where: str, key: str, compiled: jax.stages.Compiled, max_bytes: int = 0) -> bool:
  """Keeps `compiled` under `key`; False (and nothing written) where it cannot be serialized or
  the folder cannot be written. The file appears whole or not at all (written aside, renamed).
  With `max_bytes` > 0 the least recently used other entries then go until the store fits
  (`prune`).

  `compiled` must come from XLA's compiler in this process, not from JAX's persistent cache: on
  XLA:CPU (JAX 0.10.2) an executable loaded from that cache serializes without its kernels, and
  the copy loads but fails at its first run (`NOT_FOUND: Function multiply_add_fusion not found`).
  """
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    blob = pickle.dumps({"key": key, "payload": payload, "in_tree": in_tree,
                         "out_tree": out_tree}, protocol=pickle.HIGHEST_PROTOCOL)
  except Exception:  # noqa: BLE001 (e.g. a program with constants JAX cannot serialize)
    return False
  tmp = None
  try:
    os.makedirs(where, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{key}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
    os.chmod(tmp, 0o644)  # readable as JAX's own entries are, in a folder others may share
    os.replace(tmp, _path(where, key))
  except OSError:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
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
