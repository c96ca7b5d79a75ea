"""Sharded, asynchronous checkpoints of the train state with orbax, restorable onto any mesh.

A step directory `<directory>/<step>` holds two orbax items: `state` ({"step", "params", "opt"};
every host writes only its own shards) and `extra` (JSON: data position, config, the model's
origin...). orbax
writes a step into `<step>.orbax-checkpoint-tmp` and renames it once complete, so a save killed
halfway leaves only that tmp directory: orbax never lists it as a step, and the first save of the
next run deletes it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, RunError, resume_mismatch
from jaxpar.logs import quiet_absl
from jaxpar.models import precision
from jaxpar.parallel.rules import path_str

STATE, EXTRA = "state", "extra"

# extra["model"]: where the checkpoint's model came from, {"origin": "jaxpar", "kind": "gpt"} or
# {"origin": "user"} (from_nnx, from_linen). The config saved beside it describes jaxpar's model
# kind only; a checkpoint without the entry (older ones) was written by jaxpar's training of its
# own kinds.
JAXPAR, USER = "jaxpar", "user"


def model_origin(model) -> dict:
  """The extra["model"] entry of a checkpoint of `model` (a ModelDef)."""
  return {"origin": USER} if model.kind is None else {"origin": JAXPAR, "kind": model.kind}


def users_model(extra: dict) -> bool:
  """Whether a checkpoint's extra says its model is the user's own, not one of jaxpar's kinds."""
  return extra.get("model", {}).get("origin") == USER


def _manager(directory: str, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
  # Handlers are registered up front so a manager that has not saved yet can read metadata.
  handlers = {STATE: ocp.StandardCheckpointHandler(), EXTRA: ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def _reader(directory: str) -> ocp.CheckpointManager:
  """A manager that neither creates nor deletes anything, safe beside a run that is saving."""
  with quiet_absl():
    return _manager(directory, ocp.CheckpointManagerOptions(read_only=True, create=False))


def _tree(meta: Any) -> Any:
  """The plain tree of per-leaf metadata inside what an orbax `metadata()` call returned."""
  if hasattr(meta, "item_metadata"):  # a checkpointer's metadata is per step
    meta = meta.item_metadata
    if meta is None:  # orbax reports an unreadable array index as no metadata
      raise ValueError("the stored arrays' metadata cannot be read")
  return getattr(meta, "tree", meta)


def _leaves(tree: Any) -> dict[str, Any]:
  """'a/b/c' -> leaf, alike for a state tree and orbax's metadata of it (which lists its tuples)."""
  return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(_tree(tree))}


def _name(key: str) -> tuple[str, str]:
  """('parameter', 'layers/wq') for 'params/layers/wq'; ('state entry', key) otherwise."""
  if key.startswith("params/"):
    return "parameter", key[len("params/"):]
  return "state entry", key


def _shape(shape) -> str:
  return str(tuple(int(d) for d in shape))


def check_shapes(stored: Any, target: Any) -> None:
  """Raises ConfigError at the first leaf whose stored shape differs from the target's.

  Parameters are compared first, so the message names the parameter the config changed rather
  than an optimizer moment shaped like it.
  """
  have, want = _leaves(stored), _leaves(target)
  for key in sorted(want, key=lambda k: (not k.startswith("params/"), k)):
    what, name = _name(key)
    if key not in have:
      raise ConfigError(f"checkpoint has no {what} {name}, which the config makes with shape "
                        f"{_shape(want[key].shape)}")
    stored_shape = getattr(have[key], "shape", None)
    if stored_shape is not None and tuple(stored_shape) != tuple(want[key].shape):
      raise ConfigError(f"checkpoint {what} {name} has shape {_shape(stored_shape)} but the "
                        f"config makes {_shape(want[key].shape)}")
  unknown = sorted(set(have) - set(want), key=lambda k: (not k.startswith("params/"), k))
  if unknown:
    what, name = _name(unknown[0])
    raise ConfigError(f"checkpoint {what} {name} is not made by the config "
                      f"({len(unknown)} stored entries are not)")


class SaveError(RunError):
  """A checkpoint could not be written (a full disk, a folder made read-only): the run stops, and
  the last complete checkpoint stays what a new run resumes from."""


class _HeldErrors(logging.Filter):
  """orbax's background threads log a failed save's error, several times and with tracebacks,
  before the main thread learns of it; held back here while we save, since the SaveError that
  follows says it in one sentence. The first is kept for `Checkpointer.close`."""

  def __init__(self):
    super().__init__()
    self.first: str | None = None

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    self.first = self.first or record.getMessage()
    return False


def _os_reason(e: BaseException) -> str:
  """'No space left on device' from tensorstore's or the OS's text, else the first line."""
  text = str(e)
  m = re.search(r"([A-Za-z][^:\[\]]*) \[os_error_code=", text)
  if m:
    return m[1].strip()
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  return (text.strip().splitlines() or [type(e).__name__])[0][:160]


class Checkpointer:
  """Periodic async saves of the sharded train state under `directory`; restores onto any mesh.

  A save that fails (in the background) surfaces at the next save, wait or close as one SaveError
  naming the step and the last complete checkpoint; after it, wait and close only release.
  """

  def __init__(self, directory: str, keep: int, every: int, async_save: bool = True):
    self.directory, self.keep, self.every, self.async_save = directory, keep, every, async_save
    self._mgr: ocp.CheckpointManager | None = None
    self._writing = False
    self._in_flight: int | None = None  # the step of the last save started
    self._failed = False
    self._held = _HeldErrors()

  @contextlib.contextmanager
  def _writes(self, starting: int | None = None):
    """Turns a failed save surfacing inside the block into one SaveError: the one in flight if it
    is incomplete, else `starting` (the save the block starts)."""
    try:
      yield
    except Exception as e:
      on_disk = _steps_on_disk(self.directory)
      step = (self._in_flight if self._in_flight is not None and self._in_flight not in on_disk
              else starting)
      if step is None or self._failed:
        raise
      self._failed = True  # (the writer quieted the aborted I/O's late callbacks already)
      kept = [n for n in on_disk if n < step]
      raise SaveError(
          f"the checkpoint of step {step} could not be written in {self.directory} "
          f"({_os_reason(e)}); the run stops here, and "
          + (f"a run started again resumes from the last complete checkpoint (step {kept[-1]})"
             if kept else "no checkpoint is complete, so a run started again starts at step 0")
          ) from e

  def _writer(self) -> ocp.CheckpointManager:
    """The manager that saves, created by the first save (which is when the directory appears)."""
    if not self._writing:
      if self._mgr is not None:
        self._mgr.close()
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self.keep, create=True, enable_async_checkpointing=self.async_save,
          # Removes saves an earlier run was killed in; only a manager that saves here may,
          # since a reader could be beside a live run whose save is in flight.
          cleanup_tmp_directories=True)
      self._mgr, self._writing = _manager(self.directory, options), True
      logging.getLogger("absl").addFilter(self._held)
      _quiet_aborted_io()  # a failed write's late callbacks print before the main thread hears
    return self._mgr

  def _read(self) -> ocp.CheckpointManager | None:
    """A manager for reading (after any save of ours completes), or None while nothing is here."""
    if self._mgr is None:
      if not os.path.isdir(self.directory):
        return None
      self._mgr = _reader(self.directory)
    elif self._writing:
      self.wait()  # orbax lists a step as soon as its save starts
    else:
      self._mgr.reload()  # another process may have saved since
    return self._mgr

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step; tmp directories of unfinished saves don't count."""
    mgr = self._read()
    return None if mgr is None else mgr.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of all complete checkpoints, oldest first."""
    mgr = self._read()
    return [] if mgr is None else sorted(mgr.all_steps())

  def should_save(self, step: int, force: bool = False) -> bool:
    return force or (self.every > 0 and step % self.every == 0)

  def maybe_save(self, step: int, state: dict, extra: dict, force: bool = False) -> bool:
    """Starts saving `state` and `extra` as `step` when due; returns whether a save started.

    With async saves this returns once orbax has copied the shards off the devices, so the caller
    may donate `state` to the next step; orbax waits for the previous save before starting.
    """
    if not self.should_save(step, force):
      return False
    mgr = self._writer()
    if step in mgr.all_steps():  # e.g. the final forced save on a step `every` already saved
      return False
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                 EXTRA: ocp.args.JsonSave(extra)})
    with self._writes(starting=step):  # orbax first waits for the previous save
      started = bool(mgr.save(step, args=args, force=True))
    self._in_flight = step if started else self._in_flight
    with self._writes():  # a synchronous save fails here
      if not self.async_save:
        mgr.wait_until_finished()
    return started

  def _have(self, step: int) -> ocp.CheckpointManager:
    mgr = self._read()
    if mgr is None or step not in mgr.all_steps():
      raise FileNotFoundError(f"no complete checkpoint of step {step} in {self.directory}")
    return mgr

  def metadata(self, step: int) -> Any:
    """orbax's metadata of the stored state: per leaf its shape, dtype and saved sharding."""
    return self._have(step).item_metadata(step)[STATE]

  def restore(self, step: int, abstract_state: dict, shardings: dict,
              metadata: Any = None) -> tuple[dict, dict]:
    """(state, extra) of `step`, each leaf read straight into its shards under `shardings`
    (`metadata`: `self.metadata(step)` where the caller has read it already).

    `abstract_state` gives shapes and dtypes, `shardings` the new run's layout: any mesh, any ZeRO
    stage, optimizer state possibly in pinned host memory. orbax reads only the slices each
    device holds, whatever layout the checkpoint was saved from, so nothing is gathered.
    """
    mgr = self._have(step)
    check_shapes(mgr.item_metadata(step)[STATE] if metadata is None else metadata, abstract_state)
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target),
                                 EXTRA: ocp.args.JsonRestore()})
    out = mgr.restore(step, args=args)
    return out[STATE], out[EXTRA]

  def saving(self) -> bool:
    """Whether a save started here is still being written or committed."""
    return self._mgr is not None and self._mgr.is_saving_in_progress()

  def wait(self) -> None:
    """Blocks until the save in flight, if any, is complete on disk."""
    if self._mgr is not None and not self._failed:
      with self._writes():
        self._mgr.wait_until_finished()

  def close(self) -> None:
    """Waits for the save in flight, then releases orbax's threads."""
    if self._mgr is None:
      return
    try:
      self.wait()
    finally:
      with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext():
        self._mgr.close()
      self._mgr, self._writing = None, False
      if not self._failed:  # a failed save's threads may still log after close: keep them quiet
        logging.getLogger("absl").removeFilter(self._held)
      if self._held.first and not self._failed:  # held back, yet no save failed: say it
        print(f"note: orbax reported while saving: {self._held.first.splitlines()[0][:300]}",
              file=sys.stderr)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@contextlib.contextmanager
def readable(directory: str, step: int, remedy: tuple[str, str]):
  """Reads of checkpoint `step` inside the block that fail (a step folder damaged by hand, or
  removed by a running job's rotation while it was read) become one ConfigError sentence naming
  the step and ending in `remedy`: (with a complete step before it, which {older} names; with
  none), each of which may use {path} (the step's folder)."""
  _quiet_aborted_io()  # before the read: a failed one's late callbacks may beat its exception
  try:
    yield
  except (ConfigError, RunError):
    raise
  except Exception as e:  # orbax and the file system raise many kinds; the user needs one line
    detail = (str(e).strip().splitlines() or [""])[0][:160]
    older = [n for n in _steps_on_disk(directory) if n < step]
    raise ConfigError(
        f"the checkpoint of step {step} in {directory} cannot be read ({type(e).__name__}: "
        f"{detail}): it is damaged, or was removed while being read; "
        + remedy[0 if older else 1].format(older=older[-1] if older else None,
                                           path=os.path.join(directory, str(step)))) from e


def _quiet_aborted_io() -> None:
  """A failed read or write closes orbax's event loop while tensorstore still finishes its other
  requests; each of them then reports 'Event loop is closed' as an unraisable error, a traceback
  around the user's one line. Installed before reading or writing; it drops those (and only
  those) from then on."""
  previous = sys.unraisablehook
  if getattr(previous, "quiets_aborted_io", False):
    return

  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
      previous(unraisable)

  hook.quiets_aborted_io = True
  sys.unraisablehook = hook


def _steps_on_disk(directory: str) -> list[int]:
  """The step folders' numbers (complete or not), ascending; no orbax involved."""
  try:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  except OSError:
    return []


def _step_dir(directory: str, step: int | None) -> str:
  """`directory`/<step>, for the latest complete step when `step` is None."""
  if step is None:
    mgr = _reader(directory)
    step = mgr.latest_step()
    mgr.close()
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {directory}")
  return os.path.join(os.path.abspath(directory), str(step))


def read_state(directory: str, step: int | None = None) -> dict:
  """The state of `step` (default: the latest) as full numpy arrays, read with plain orbax.

  Needs neither a mesh nor jaxpar: optimizer tuples come back as lists and namedtuples as dicts,
  the way orbax stores them.
  """
  path = os.path.join(_step_dir(directory, step), STATE)
  with ocp.PyTreeCheckpointer() as ckptr:
    with quiet_absl():
      meta = _tree(ckptr.metadata(path))
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def _state_reader() -> ocp.PyTreeCheckpointer:
  return ocp.PyTreeCheckpointer()


def stored_params(directory: str, step: int) -> dict[str, Any]:
  """'a/b' -> orbax's metadata (shape, dtype) of every stored parameter; nothing is read."""
  with _state_reader() as reader, quiet_absl():
    tree = _tree(reader.metadata(os.path.join(_step_dir(directory, step), STATE)))
  return _leaves(tree["params"])


def _read_params(directory: str, step: int, item: Any, restore_args: Any) -> Any:
  """The parameters named by `item` (a subtree of the stored params), and nothing else."""
  with _state_reader() as reader:
    out = reader.restore(os.path.join(_step_dir(directory, step), STATE),
                         args=ocp.args.PyTreeRestore(item={"params": item},
                                                     restore_args={"params": restore_args},
                                                     partial_restore=True))
  return out["params"]


def restore_params(directory: str, step: int, abstract_params: Any, shardings: Any) -> Any:
  """Only the parameters of `step`, each read straight into its shards (no optimizer state)."""
  with quiet_absl():
    check_shapes({"params": _tree(_state_reader().metadata(
        os.path.join(_step_dir(directory, step), STATE)))["params"]}, {"params": abstract_params})
  target = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, shardings)
  return _read_params(directory, step, target, ocp.checkpoint_utils.construct_restore_args(target))


def read_param(directory: str, step: int, name: str) -> np.ndarray:
  """One stored parameter ('layers/wq') of `step` as a whole numpy array."""
  item: dict = {}
  node = item
  *parents, leaf = name.split("/")
  for key in parents:
    node = node.setdefault(key, {})
  node[leaf] = 0
  args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  out = _read_params(directory, step, item, args)
  for key in name.split("/"):
    out = out[key]
  return out


def read_extra(directory: str, step: int | None = None) -> dict:
  """The JSON saved beside the state of `step` (default: the latest), read with plain orbax."""
  path = os.path.join(_step_dir(directory, step), EXTRA)
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
    return ckptr.restore(path, args=ocp.args.JsonRestore())


def restore_state(ckpt: Checkpointer, step: int, layout) -> tuple[dict, dict]:
  """(state, extra) of checkpoint `step` onto `layout` (train/layout.py's StateLayout).

  Whether a dynamic loss scale is saved follows the run that saved it, not this one: a
  checkpoint without one (a static scale) starts it at precision.initial_scale, and one with it
  resumed under a static scale drops it.
  """
  meta = ckpt.metadata(step)
  stored = "loss_scale" in getattr(meta, "tree", meta)  # orbax's metadata of the state tree
  abstract, shardings = dict(layout.abstract_state), dict(layout.state_shardings)
  if stored and not layout.dynamic_scale:
    abstract["loss_scale"] = precision.scale_abstract()
    shardings["loss_scale"] = {k: NamedSharding(layout.mesh, P()) for k in abstract["loss_scale"]}
  elif layout.dynamic_scale and not stored:
    del abstract["loss_scale"], shardings["loss_scale"]
  state, extra = ckpt.restore(step, abstract, shardings, meta)
  if layout.dynamic_scale and not stored:
    state["loss_scale"] = jax.device_put(precision.init_scale(layout.cfg.precision),
                                         layout.state_shardings["loss_scale"])
  elif stored and not layout.dynamic_scale:
    del state["loss_scale"]
  return state, extra


# What a run whose newest checkpoint cannot be read is told (`readable`).
RESUME_REMEDY = ("move {path} away to resume from the step before ({older})",
                 "move {path} away to start again from step 0 (no step before it is complete)")


def resumable(cfg, ckpt_dir: str) -> int | None:
  """The step of the newest complete checkpoint in `ckpt_dir`, or None.

  Raises ConfigError, before anything is built or written, when that checkpoint trained something
  else (another model, data or global batch): resuming it would silently continue the wrong run.
  """
  with Checkpointer(ckpt_dir, keep=1, every=0) as reader:
    step = reader.latest_step()
  if step is None:
    return None
  with readable(ckpt_dir, step, RESUME_REMEDY):
    stored = read_extra(ckpt_dir, step).get("config", {})
  changed = resume_mismatch(stored, cfg)
  if changed:
    raise ConfigError(f"the checkpoint at step {step} in {ckpt_dir} trained a different run "
                      f"({', '.join(changed)}); use another --workdir, or the same settings to resume")
  return step
