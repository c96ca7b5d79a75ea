"""A trained checkpoint as one unsharded safetensors file plus a JSON of its model config (for a
model of the user's own, its parameter list: see `model_entry`).

Tensor names are parameter paths joined with '/' (`wte`, `layers/wq`, ...), in the checkpoint's
own layout: layers stacked on a leading axis in model order. Needs no mesh: the state is read
with plain orbax as whole numpy arrays.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from jaxpar.config import ConfigError, RunError
from jaxpar.parallel.rules import path_str
from jaxpar.train import checkpoint
from jaxpar.version import __version__

SUFFIX = ".safetensors"


# What export and generate say when the step they read cannot be read (checkpoint.readable).
STEP_REMEDY = ("retry, or pass --step {older} for the step before",
               "retry (no step before it is complete)")

# What a full disk, a file size limit or a read-only file system say when an output is written.
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)


@contextlib.contextmanager
def writes(path: str):
  """An output that cannot be written for want of space becomes one RunError sentence (exit 1);
  whoever writes it removes what was half-written."""
  try:
    yield
  except OSError as e:
    if e.errno not in _FULL:
      raise
    raise RunError(f"could not write {path} ({e.strerror}); nothing of it is left") from e


def checkpoint_step(workdir: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoint directory, step): `step` or the latest complete one; ConfigError if absent."""
  directory = os.path.join(workdir, "checkpoints")
  with checkpoint.Checkpointer(directory, keep=1, every=0) as ckpt:
    steps = ckpt.all_steps()
  if not steps:
    raise ConfigError(f"workdir {workdir} holds no complete checkpoint (looked in {directory})")
  if step is None:
    return directory, steps[-1]
  if step not in steps:
    raise ConfigError(f"workdir {workdir} has no checkpoint of step {step}; it has steps "
                      f"{', '.join(map(str, steps))}")
  return directory, step


def param_tensors(params) -> dict[str, np.ndarray]:
  """Nested parameters -> {'a/b': array} (contiguous, as safetensors writes them)."""
  return {path_str(p): np.ascontiguousarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(params)}


# safetensors' names for numpy dtypes (its format's header spells dtypes this way)
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
              "bool": "BOOL"}


def _header(shapes: dict[str, tuple[tuple[int, ...], Any]], metadata: dict[str, str]) -> bytes:
  """The safetensors header for tensors written in `shapes`' order, back to back."""
  head: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, (shape, dtype) in shapes.items():
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    head[name] = {"dtype": _ST_DTYPES[np.dtype(dtype).name], "shape": [int(d) for d in shape],
                  "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(head, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  return len(text).to_bytes(8, "little") + text
def config_path(out: str) -> str:
  """'dir/model.safetensors' -> 'dir/model.json'."""
  return out[:-len(SUFFIX)] + ".json"


def _new_file_mode() -> int:
  """The mode open() gives a new file: 0666 less the process umask."""
  mask = os.umask(0)  # reading the umask means setting it; put it straight back
  os.umask(mask)
  return 0o666 & ~mask


BIG_TENSOR = 16 << 20  # bytes from which a written tensor is freed by a full collection


def write_safetensors(shapes: dict[str, tuple[tuple[int, ...], Any]],
                      read: Callable[[str], np.ndarray], out: str,
                      metadata: dict[str, str]) -> None:
  """Writes `out` tensor by tensor: `read(name)` is called once per name of `shapes` ({name:
  (shape, dtype)}), in order, and its array is written and dropped before the next is read, so
  the host holds one tensor at a time. Atomic (a temporary file beside it, then a rename), with
  mode 0666 & ~umask."""
  parent = os.path.dirname(os.path.abspath(out))
  with writes(out):
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
  try:
    with writes(out), os.fdopen(fd, "wb") as f:  # reads fail otherwise than for want of space
      f.write(_header(shapes, metadata))
      for name, (shape, dtype) in shapes.items():
        x = np.asarray(read(name))
        x = x if x.flags.c_contiguous else np.ascontiguousarray(x)  # (which makes 0-d arrays 1-d)
        if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
          raise ValueError(f"tensor {name} read as {x.dtype}{list(x.shape)}, stored as "
                           f"{np.dtype(dtype)}{list(shape)}")
        if x.dtype.byteorder == ">":  # safetensors is little-endian
          x = x.byteswap().view(x.dtype.newbyteorder("<"))
        f.write(x.reshape(-1).view(np.uint8).data)  # the array's own bytes, not a copy
        # orbax leaves the array it read in a finished asyncio future inside a reference cycle;
        # collect it now, or the tensors pile up until Python's next collection. A full
        # collection walks the whole heap (about a second in a large process): it is kept for
        # tensors whose size matters, the young generations suffice for the rest.
        big = x.nbytes >= BIG_TENSOR
        del x
        gc.collect() if big else gc.collect(1)
    # mkstemp creates owner-only files; an export is meant to be shared.
    os.chmod(tmp, _new_file_mode())
    os.replace(tmp, out)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


# What the JSON says of a model that jaxpar did not build (checkpoint.USER).
USERS_OWN = ("a model of the user's own (jaxpar.from_nnx / from_linen): jaxpar cannot rebuild it; "
             "build it with its own code and load these tensors by name")


def model_entry(extra: dict, shapes: dict[str, tuple[tuple[int, ...], Any]]) -> dict:
  """The JSON's "model": for one of jaxpar's kinds, the stored config's model section (what
  rebuilds it; also for checkpoints that predate the origin record, which only jaxpar's kinds
  wrote); for a user's own model, that it is one and its parameters' names, shapes and dtypes,
  since the stored config's model section describes jaxpar's default model, not this one."""
  if not checkpoint.users_model(extra):
    return extra.get("config", {}).get("model", {})
  return {"origin": checkpoint.USER, "description": USERS_OWN,
          "params": {name: {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name}
                     for name, (shape, dtype) in shapes.items()}}


def export(workdir: str, out: str, step: int | None = None) -> dict:
  """Writes `out` (.safetensors) and its config JSON; returns that JSON's content."""
  if not out.endswith(SUFFIX):
    raise ConfigError(f"--out {out} must end with {SUFFIX}")
  directory, step = checkpoint_step(workdir, step)
  with checkpoint.readable(directory, step, STEP_REMEDY):
    # Shapes from the checkpoint's metadata; then one parameter read, written and dropped at a
    # time.
    shapes = {name: (tuple(m.shape), m.dtype)
              for name, m in sorted(checkpoint.stored_params(directory, step).items())}
    extra = checkpoint.read_extra(directory, step)
    cfg = extra.get("config", {})
    info = {"jaxpar_version": __version__, "step": step, "model": model_entry(extra, shapes),
            "param_dtype": cfg.get("precision", {}).get("param_dtype"),
            "n_params": int(sum(np.prod(shape) for shape, _ in shapes.values())),
            "n_tensors": len(shapes)}
    write_safetensors(shapes, lambda name: checkpoint.read_param(directory, step, name), out,
                      {"format": "jaxpar", "jaxpar_version": __version__,
                       "step": str(step)})
  try:
    with writes(config_path(out)), open(config_path(out), "w") as f:
      json.dump(info, f, indent=2)
      f.write("\n")
  except BaseException:
    for path in (out, config_path(out)):  # both or neither
      if os.path.exists(path):
        os.remove(path)
    raise
  return info
