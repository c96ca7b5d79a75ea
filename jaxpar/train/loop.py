"""The training run: config -> mesh -> model -> sharded state -> data -> steps, metrics, checkpoints.

Everything that can be checked without devices is checked before anything is written to the
workdir, so bad input leaves no trace. Metrics are fetched from the devices only on logging and
checkpoint steps; in between, steps are dispatched back to back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

from jaxpar import config as jconfig
from jaxpar import data as jdata
from jaxpar.analysis import hlo
from jaxpar.analysis import profile as jprofile
from jaxpar.config import Config, ConfigError
from jaxpar.models import hf_weights
from jaxpar.models.registry import build_model
from jaxpar.parallel import distributed as jdistributed
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import checkpoint as jckpt
from jaxpar.train import metrics as jmetrics
from jaxpar.train import preemption
from jaxpar.train.step import Trainer


@dataclasses.dataclass
class RunResult:
  """What a run returns to Python callers (tests, notebooks)."""
  steps: int  # total steps completed, including resumed ones
  losses: dict[int, float]  # step -> loss for every step run in this process
  state: Any
  trainer: Trainer
  summary: dict


def prepare(cfg: Config, mesh_shape: tuple[int, int, int]) -> Trainer:
  """Checks every degree against the devices and builds the trainer (nothing is written)."""
  if cfg.parallel.virtual_stages > 1 and cfg.parallel.schedule != "circular":
    raise ConfigError("parallel.virtual_stages > 1 needs parallel.schedule=circular")
  devices = jax.devices()
  jmesh.check(mesh_shape, cfg, len(devices))
  mesh = jmesh.make(mesh_shape, devices)
  return Trainer(cfg, mesh, build_model(cfg))


def _index_key(index: tuple) -> tuple:
  """A shard's index (a tuple of slices, unhashable before Python 3.12) as a dict key."""
  return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


class _HostCopy:
  """This process's shards of a train state, copied to host memory; each distinct shard once
  (a replicated leaf is one copy, not one per device)."""

  def __init__(self, state: dict):
    leaves, self.treedef = jax.tree_util.tree_flatten(state)
    self.leaves, self.nbytes = [], 0
    for x in leaves:
      shards = {}
      for s in x.addressable_shards:
        key = _index_key(s.index)
        if key not in shards:  # a copy: the step donates the device buffers it would view
          shards[key] = np.array(s.data, copy=True)
          self.nbytes += shards[key].nbytes
      self.leaves.append((x.shape, x.sharding, shards))

  def restore(self) -> dict:
    """The state again, on the devices and with the shardings it had."""
    from jax.sharding import SingleDeviceSharding
    out = []
    for shape, sharding, shards in self.leaves:
      kind = getattr(sharding, "memory_kind", None)  # an offloaded optimizer stays in host memory
      parts = [jax.device_put(shards[_index_key(index)], SingleDeviceSharding(d, memory_kind=kind))
               for d, index in sharding.addressable_devices_indices_map(shape).items()]
      out.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    return jax.tree_util.tree_unflatten(self.treedef, out)


class _SpikeGuard:
  """train.spike_factor > 0: judges each step's loss and keeps the state to roll back to.

  A loss is high when it is above spike_factor x the median of the last spike_window losses
  (judged once 5 are known); spike_steps high losses in a row, or one non-finite loss or gradient
  norm, call for a rollback. The state is copied to host memory at every log step whose losses
  were all good (none high, none pending), since losses are fetched only there: a rollback returns
  to the last such step and drops every batch trained since, the spike's and those between.
  """

  def __init__(self, tc: jconfig.TrainConfig):
    self.factor, self.steps, self.window = tc.spike_factor, tc.spike_steps, tc.spike_window
    self.history: list[tuple[int, float]] = []  # (step, loss) of steps kept, oldest first
    self.high: list[int] = []  # steps of the current run of high losses
    self.copy: _HostCopy | None = None
    self.good_step = 0  # the step `copy` holds
    self.good_t = 0.0  # perf_counter when it was taken
    self.rollbacks = 0

  def judge(self, step: int, loss: float, grad_norm: float) -> str | None:
    """Takes one step's loss; the reason for a rollback, or None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      self.high.append(step)
      return f"loss {loss} and gradient norm {grad_norm}"
    recent = [l for _, l in self.history[-self.window:]]
    median = float(np.median(recent)) if len(recent) >= min(5, self.window) else math.inf
    self.history.append((step, loss))
    if loss > self.factor * median:
      self.high.append(step)
      if len(self.high) >= self.steps:
        return (f"loss {loss:.4g} > {self.factor:g} x running median {median:.4g} for "
                f"{len(self.high)} step{'s' if len(self.high) > 1 else ''}")
    else:
      self.high.clear()
    return None

  @property
  def clear(self) -> bool:
    """No high loss is waiting to be confirmed or cleared: the current state may be kept."""
    return not self.high

  def keep(self, step: int, state: dict, skipped: int) -> None:
    """Copies `state`, the state after `step`, whose losses were all good."""
    self.copy, self.good_step, self.good_t = _HostCopy(state), step, time.perf_counter()
    self.skipped = skipped  # steps whose update was dropped, up to this one

  def roll_back(self) -> dict:
    """The kept state; forgets the losses of the steps rolled back."""
    self.rollbacks += 1
    self.high.clear()
    self.history = [(s, l) for s, l in self.history if s <= self.good_step]
    return self.copy.restore()


def _global_batch(local: dict, shardings: dict) -> dict:
  """This process's rows of every batch leaf -> global arrays split over `data`."""
  return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in local.items()}


def _batch_abstract(element_spec: dict, process_count: int) -> dict:
  """The global batch from one process's {name: (shape, dtype)}: leading axis x process_count."""
  return {k: jax.ShapeDtypeStruct((shape[0] * process_count,) + tuple(shape[1:]), dtype)
          for k, (shape, dtype) in element_spec.items()}


# What a run whose newest checkpoint cannot be read is told (checkpoint.readable).
RESUME_REMEDY = ("move {path} away to resume from the step before ({older})",
                 "move {path} away to start again from step 0 (no step before it is complete)")


def resumable(cfg: Config, ckpt_dir: str) -> int | None:
  """The step of the newest complete checkpoint in `ckpt_dir`, or None.

  Raises ConfigError, before anything is built or written, when that checkpoint trained something
  else (another model, data or global batch): resuming it would silently continue the wrong run.
  """
  with jckpt.Checkpointer(ckpt_dir, keep=1, every=0) as reader:
    step = reader.latest_step()
  if step is None:
    return None
  with jckpt.readable(ckpt_dir, step, RESUME_REMEDY):
    stored = jckpt.read_extra(ckpt_dir, step).get("config", {})
  changed = jconfig.resume_mismatch(stored, cfg)
  if changed:
    raise ConfigError(f"the checkpoint at step {step} in {ckpt_dir} trained a different run "
                      f"({', '.join(changed)}); use another --workdir, or the same settings to resume")
  return step


def _tree(directory: str) -> set[str]:
  """Every path below `directory` (empty if it does not exist)."""
  return {os.path.join(d, n) for d, dirs, files in os.walk(directory) for n in dirs + files}


@contextlib.contextmanager
def _undone_on_failure(workdir: str):
  """If the block raises, what it created under `workdir` is removed (the workdir too, if it did
  not exist before): bad input leaves nothing on disk."""
  existed = os.path.isdir(workdir)
  before = _tree(workdir) if existed else set()
  try:
    yield
  except BaseException:
    if not existed:
      shutil.rmtree(workdir, ignore_errors=True)
    else:
      for path in sorted(_tree(workdir) - before, key=len, reverse=True):  # deepest first
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
          os.remove(path)
    raise


def run(cfg: Config, mesh_shape: tuple[int, int, int], workdir: str, metrics_file: str | None = None,
        steps: int | None = None, progress: bool = True, log=print,
        profile_steps: tuple[int, int] | None = None) -> RunResult:
  """Trains `cfg` on `mesh_shape` for `steps` total steps (default train.steps) in `workdir`;
  `profile_steps` (A, B) traces steps A..B into <workdir>/profile (jaxpar/profile.py)."""
  split = jmetrics.TimeSplit()
  if steps is not None:
    cfg = jconfig.override(cfg, train={"steps": steps})
  cfg = jconfig.absolute_paths(cfg)  # saved with the checkpoints: see resume_mismatch
  total = cfg.train.steps
  if profile_steps:
    jprofile.check_window(profile_steps, total)
  trainer = prepare(cfg, mesh_shape)
  is_main = jax.process_index() == 0

  ckpt_dir = os.path.join(workdir, "checkpoints")
  start = resumable(cfg, ckpt_dir)
  if start is not None and start >= total:
    log(f"nothing to train: the checkpoint in {ckpt_dir} is at step {start} and --steps is {total}")
    return RunResult(steps=start, losses={}, state=None, trainer=trainer,
                     summary={"steps": start, "steps_this_run": 0, "nothing_to_train": True})
  # Data before the workdir: a dataset that is missing or does not fit the model is bad input,
  # and what building it wrote under the workdir (<workdir>/data by default) goes again.
  pi, pc = jax.process_index(), jax.process_count()
  with _undone_on_failure(workdir):
    batches = jdata.make_loader(cfg, workdir, pi, pc)
    evals = (jdata.make_loader(cfg, workdir, pi, pc, split=cfg.data.eval_split, train=False)
             if cfg.train.eval_every else None)
  os.makedirs(workdir, exist_ok=True)
  ckpt = jckpt.Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, every=cfg.checkpoint.every)
  batch_abstract = _batch_abstract(batches.element_spec, pc)
  batch_sharding = trainer.batch_sharding(batch_abstract)

  skipped = [0]  # steps whose update was dropped (train.skip_nonfinite, dynamic loss scaling)
  if start is not None:
    with jckpt.readable(ckpt_dir, start, RESUME_REMEDY):
      state, extra = trainer.restore(ckpt, start)  # the loss scale's entry may differ
    state = trainer.from_logical(state)
    batches.restore(extra["data"])
    skipped[0] = int(extra.get("skipped_steps", 0))
    log(f"resuming from the checkpoint at step {start} in {ckpt.directory}")
  elif cfg.model.init_from:  # a new run from a Hugging Face model folder's weights
    state, start = trainer.init_with(hf_weights.load_params(
        cfg.model.init_from, cfg.model, trainer.model.abstract, trainer.state_shardings["params"])), 0
    log(f"initialised from the model folder {cfg.model.init_from}")
  else:
    state, start = trainer.init(cfg.train.seed), 0

  # The state is created asynchronously: waiting for it here keeps its computation out of the
  # compile's time (on CPU they share the cores, so the wait costs no wall time there).
  jax.block_until_ready(state)
  watchdog = jdistributed.Watchdog(cfg.train, cfg.train.log_every)
  watchdog.at(start, "compiling the step", slow=True)
  with jmetrics.compile_watch() as compile_info, watchdog:
    compiled = trainer.lower(batch_abstract).compile()
  peak, peak_source = jmetrics.peak_flops_per_device()
  n_dev = trainer.mesh.size
  # 0 for models that are not sequence models: they report examples/s only
  tokens_per_step = cfg.train.batch_size * trainer.model.tokens_per_example
  flops_per_step = trainer.model.flops_per_example * cfg.train.batch_size

  logger = jmetrics.MetricsLogger(workdir if is_main else None, metrics_file if is_main else None,
                                  total, is_main=is_main, progress=progress and is_main)
  losses: dict[int, float] = {}
  logged: list[int] = []  # steps whose metrics were written
  pending: list[tuple[int, dict]] = []  # device metrics not yet fetched
  interval_t, interval_steps = time.perf_counter(), 0
  timed_s, timed_steps = 0.0, 0
  warm_s, warm_steps = 0.0, 0  # a fresh run's first interval: the rate's fallback (see below)
  step = start
  stopped = None
  peer_lost = False
  eval_step = None

  def evaluate(params) -> dict:
    """Mean loss and metrics over the first train.eval_steps batches of data.eval_split."""
    nonlocal eval_step
    if eval_step is None:
      eval_step = trainer.eval_jitted(batch_abstract)
    evals.restore({"epoch": 0, "position": 0})  # the same batches every time, so evals compare
    n = min(cfg.train.eval_steps or evals.steps_per_epoch, evals.steps_per_epoch)
    outs = jax.device_get([eval_step(params, _global_batch(evals.next(), batch_sharding))
                           for _ in range(n)])
    evals.close()
    return {f"eval_{k}": float(np.mean([o[k] for o in outs])) for k in outs[0]}

  def flush(now_step: int, extra: dict | None = None) -> tuple[int, int, str] | None:
    """Fetches pending metrics (one host sync), checks them, logs the newest; with the spike
    guard, returns (first, last, why) of the steps that call for a rollback instead of logging."""
    nonlocal interval_t, interval_steps, timed_s, timed_steps, warm_s, warm_steps
    fetched = jax.device_get([m for _, m in pending])
    for (s, _), m in zip(pending, fetched):
      losses[s] = float(m["loss"])
      skipped[0] += int(m.get("skipped", 0))
      # The gradient norm too: a finite loss with an overflowed gradient still makes the updated
      # state NaN, and this step may be the one about to be saved.
      grad_norm = float(m["grad_norm"])
      if trainer.dynamic_scale and m["skipped"] and float(m["loss_scale"]) <= cfg.precision.min_scale:
        raise FloatingPointError(f"gradients overflow at step {s} with the loss scale at its minimum "
                                 f"{float(m['loss_scale'])}; stopping without saving")
      if guard is not None and not cfg.train.skip_nonfinite and not trainer.dynamic_scale:
        why = guard.judge(s, losses[s], grad_norm)
        if why is not None:  # the steps after this one are rolled back with it, unjudged
          pending.clear()
          return guard.high[0], s, why
        continue
      if (not (math.isfinite(losses[s]) and math.isfinite(grad_norm)) and not cfg.train.skip_nonfinite
          and not trainer.dynamic_scale):  # dynamic scaling skips an overflow and backs off
        raise FloatingPointError(f"loss is {losses[s]} and gradient norm {grad_norm} at step {s}; "
                                 f"stopping without saving (the last good checkpoint is kept)")
    elapsed = time.perf_counter() - interval_t
    step_time = elapsed / max(interval_steps, 1)
    if start > 0 or now_step > interval_steps:  # the first interval includes warm-up
      timed_s, timed_steps = timed_s + elapsed, timed_steps + interval_steps
    else:
      warm_s, warm_steps = elapsed, interval_steps
    m = {k: float(v) for k, v in fetched[-1].items()}
    row = {"loss": m.pop("loss"), "learning_rate": m.pop("learning_rate"),
           "grad_norm": m.pop("grad_norm"), "step_time_s": step_time,
           "examples_per_sec": cfg.train.batch_size / step_time}
    if tokens_per_step:
      row["tokens_per_sec"] = tokens_per_step / step_time
    # The first row says how the step was compiled (a cache hit or miss, and how long it took).
    logger.log(now_step, {**row, "mfu": flops_per_step / step_time / (peak * n_dev), **m,
                          **(extra or {}), **(compile_info if not logged else {}),
                          **({"rollbacks": guard.rollbacks} if guard is not None else {})})
    logged.append(now_step)
    pending.clear()
    interval_t, interval_steps = time.perf_counter(), 0
    return None

  guard = _SpikeGuard(cfg.train) if cfg.train.spike_factor else None
  save_owed = False  # a save put off while a high loss was being judged
  good_beside = 0.0  # split.beside_steps() when the guard's copy was taken

  def roll_back(first: int, last: int, why: str, now: int) -> tuple[Any, int]:
    """The state and step to go on from after the spike at steps first..last, found at `now`."""
    nonlocal interval_t, interval_steps
    good = guard.good_step
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    if guard.rollbacks >= cfg.train.max_rollbacks:
      raise FloatingPointError(
          f"loss spike at {steps} ({why}) after {guard.rollbacks} rollbacks, the most "
          f"train.max_rollbacks={cfg.train.max_rollbacks} allows; stopping without saving (the "
          f"last good checkpoint is kept)")
    with split.part("rollback"):
      restored = guard.roll_back()
    for s in [s for s in losses if s > good]:
      del losses[s]
    skipped[0] = guard.skipped
    log(f"loss spike at {steps} ({why}): rolled back to step {good} and skipped the batches of "
        f"steps {good + 1}-{now} (rollback {guard.rollbacks} of at most "
        f"{cfg.train.max_rollbacks})")
    t = time.perf_counter()
    # The steps since the copy: their wall time less what the loop spent beside them meanwhile.
    split.seconds["rollback"] += (t - guard.good_t) - (split.beside_steps() - good_beside)
    keep_good(t)
    interval_t, interval_steps = t, 0
    return restored, good

  def keep_good(t: float) -> None:
    """Marks `t` as the time the guard's copy was last good (for the time a rollback loses)."""
    nonlocal good_beside
    guard.good_t, good_beside = t, split.beside_steps()

  if guard is not None:
    with split.part("rollback"):
      guard.keep(start, state, skipped[0])
    keep_good(time.perf_counter())

  # One process needs no agreement: it stops after the step its own signal lands in.
  vote = preemption.StopVote(trainer.mesh) if pc > 1 else None
  window = jprofile.Window(profile_steps, os.path.join(workdir, "profile")) if profile_steps else None
  loop_t0 = time.perf_counter()
  split.seconds["compile"] = compile_info["compile_s"]
  split.seconds["startup"] = loop_t0 - split.t0 - compile_info["compile_s"]
  with preemption.StopFlag() as stop, jax.set_mesh(trainer.mesh), watchdog:
    try:
      while step < total:
        if window:  # the profiler's own start and stop are not step time
          interval_t += window.before(step + 1, state)
        watchdog.at(step + 1, f"reading the batch of step {step + 1}")
        with split.part("input_wait"):
          batch = _global_batch(batches.next(), batch_sharding)
        watchdog.at(step + 1, f"dispatching step {step + 1}")
        state, m = compiled(state, batch)
        step += 1
        if window:
          interval_t += window.after(step, state)
        interval_steps += 1
        pending.append((step, m))
        # Read once: a signal landing later in this iteration must not skip the save below yet
        # still break out; it is handled after the next step (the one after that with several
        # processes, see _StopVote). {process: signal} of those that asked.
        if vote is None:
          asked = {pi: stop.requested} if stop.requested else {}
        else:
          watchdog.at(step, f"the stop-signal exchange after step {step} (a collective of every "
                            f"process, behind step {step - 1})")
          asked = vote(stop.requested)
        stopping = bool(asked)
        save_now = stopping or step == total or (
            cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
        eval_now = evals is not None and step % cfg.train.eval_every == 0
        extra = None
        if eval_now:
          watchdog.at(step, f"waiting for step {step} to finish before evaluating")
          jax.block_until_ready(m)  # the steps so far count as training time, the eval does not
          watchdog.at(step, f"evaluating after step {step}", slow=True)
          t_eval = time.perf_counter()
          with split.part("eval"):
            extra = evaluate(state["params"])  # the step's own sharded path and layer order
          interval_t += time.perf_counter() - t_eval
        flushed = step % cfg.train.log_every == 0 or save_now or eval_now
        if flushed:
          watchdog.at(step, f"fetching the metrics of steps up to {step} (waiting for them to "
                            f"finish)")
        spike = flush(step, extra) if flushed else None
        if flushed and watchdog.first:
          watchdog.first_step_done()
        if spike is not None:
          state, step = roll_back(*spike, step)
          save_now = stopping  # the restored state, whose data position is past the spike
        elif guard is not None and flushed:
          # A state with a high loss not yet judged is not saved: a rollback would return to a
          # step before it, and the checkpoint of this step would then hold the spike's update.
          if guard.clear:
            watchdog.at(step, f"copying the state of step {step} to host memory (loss-spike "
                              f"guard)", slow=True)
            with split.part("rollback"):
              guard.keep(step, state, skipped[0])
            keep_good(time.perf_counter())
            save_now, save_owed = save_now or save_owed, False
          elif save_now and not (stopping or step == total):
            save_now, save_owed = False, True
        if save_now:
          watchdog.at(step, f"saving the checkpoint of step {step}", slow=True)
          with split.part("checkpoint"):
            if vote is not None:
              vote.until_saved(ckpt.saving)  # orbax starts a save by waiting for the previous one
            ckpt.maybe_save(step, trainer.to_logical(state), {"data": batches.state(), "config": jconfig.to_dict(cfg),
                                                          "skipped_steps": skipped[0]},
                            force=True)
        if stopping:
          stopped = asked
          break
      watchdog.at(step, "waiting for the last checkpoint to be written", slow=True)
      if vote is not None:
        with split.part("checkpoint"):
          vote.until_saved(ckpt.saving)
    except Exception as e:
      peer_lost = jdistributed.lost_peer(e) is not None
      raise
    finally:
      if window:
        window.stop()
      try:
        if not peer_lost:  # a save in flight waits at a barrier for the dead process: leave it
          watchdog.at(step, "closing the checkpointer (a save may be in flight)", slow=True)
          with split.part("checkpoint"):  # incomplete, so the last complete checkpoint is the
            ckpt.close()                  # one resumed
      finally:             # (close waits for the save in flight; a failed one is a SaveError)
        batches.close()
        if evals is not None:
          evals.close()

  split.seconds["steps"] = time.perf_counter() - loop_t0 - split.beside_steps()
  if stopped:
    preemption.say_stopped(stopped, stop.requested, step, log if is_main else None)
  # A run no longer than its first log interval has no steady-state interval: its rate is then
  # over every step, the first one's warm-up included, and the summary says so.
  with_warmup = not timed_s and warm_s > 0
  secs, n = (warm_s, warm_steps) if with_warmup else (timed_s, timed_steps)
  eps = cfg.train.batch_size * n / secs if secs else 0.0
  measured = jmetrics.device_peak_memory_bytes()  # the allocator's own peak, where kept (GPU)
  profiled = window.summary(compiled, trainer) if window else {}
  summary = {**profiled, "steps": step, "steps_this_run": step - start, "examples_per_sec": eps,
             **({"rate_includes_warmup": True} if with_warmup else {}),
             **({"tokens_per_sec": eps * tokens_per_step / cfg.train.batch_size}
                if tokens_per_step else {}),
             "mfu": flops_per_step * eps / cfg.train.batch_size / (peak * n_dev),
             "peak_flops_per_device": peak, "peak_flops_source": peak_source,
             # the one definition plan.py reports too (hlo.memory)
             "peak_memory_bytes": hlo.memory(compiled)["peak_bytes"],
             **({"allocator_peak_bytes": measured} if measured is not None else {}),
             **compile_info, "devices": n_dev,
             "first_loss": losses[min(losses)] if losses else None,
             "last_loss": losses[max(losses)] if losses else None,
             "interrupted": bool(stopped), "skipped_steps": skipped[0],
             **({"rollbacks": guard.rollbacks, "rollback_copy_bytes": guard.copy.nbytes}
                if guard is not None else {}),
             **({"loss_scale": float(state["loss_scale"]["scale"])} if trainer.dynamic_scale else {}),
             **split.summary()}
  text = logger.final(summary)
  if is_main:
    log(text)
  return RunResult(steps=step, losses=losses, state=state, trainer=trainer, summary=summary)
