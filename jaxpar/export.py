"""A trained checkpoint as one unsharded safetensors file plus a JSON of its model config.

Tensor names are parameter paths joined with '/' (`wte`, `layers/wq`, ...), in the checkpoint's
own layout: layers stacked on a leading axis in model order. Needs no mesh: the state is read
with plain orbax as whole numpy arrays.
"""
from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np

import jaxpar
from jaxpar import checkpoint
from jaxpar.config import ConfigError
from jaxpar.rules import path_str

SUFFIX = ".safetensors"


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


def config_path(out: str) -> str:
  """'dir/model.safetensors' -> 'dir/model.json'."""
  return out[:-len(SUFFIX)] + ".json"


def _new_file_mode() -> int:
  """The mode open() gives a new file: 0666 less the process umask."""
  mask = os.umask(0)  # reading the umask means setting it; put it straight back
  os.umask(mask)
  return 0o666 & ~mask


def write_safetensors(tensors: dict[str, np.ndarray], out: str, metadata: dict[str, str]) -> None:
  """Writes `out` atomically (a temporary file beside it, then a rename), mode 0666 & ~umask."""
  from safetensors.numpy import save_file
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
  os.close(fd)
  try:
    save_file(tensors, tmp, metadata=metadata)
    # mkstemp and safetensors both create owner-only files; an export is meant to be shared.
    os.chmod(tmp, _new_file_mode())
    os.replace(tmp, out)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def export(workdir: str, out: str, step: int | None = None) -> dict:
  """Writes `out` (.safetensors) and its config JSON; returns that JSON's content."""
  if not out.endswith(SUFFIX):
    raise ConfigError(f"--out {out} must end with {SUFFIX}")
  directory, step = checkpoint_step(workdir, step)
  tensors = param_tensors(checkpoint.read_state(directory, step)["params"])
  cfg = checkpoint.read_extra(directory, step).get("config", {})
  info = {"jaxpar_version": jaxpar.__version__, "step": step, "model": cfg.get("model", {}),
          "param_dtype": cfg.get("precision", {}).get("param_dtype"),
          "n_params": int(sum(x.size for x in tensors.values())), "n_tensors": len(tensors)}
  write_safetensors(tensors, out, {"format": "jaxpar", "jaxpar_version": jaxpar.__version__,
                                   "step": str(step)})
  with open(config_path(out), "w") as f:
    json.dump(info, f, indent=2)
    f.write("\n")
  return info
