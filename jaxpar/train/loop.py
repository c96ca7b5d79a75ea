"""The training run: config -> mesh -> model -> sharded state -> data -> steps, metrics, checkpoints.

Everything that can be checked without devices is checked before anything is written to the
workdir, so bad input leaves no trace. Metrics are fetched from the devices only on logging and
checkpoint steps; in between, steps are dispatched back to back. What runs beside the steps
(metrics, the spike guard, evaluation, checkpoints, the profiler, the stop agreement) is one
object each in hooks.py, called at a step.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import shutil
import threading
import time
from typing import Any

import jax

from jaxpar import config as jconfig
from jaxpar import data as jdata
from jaxpar.analysis import hlo
from jaxpar.analysis import profile as jprofile
from jaxpar.config import Config
from jaxpar.models import decoder, hf_weights, lora
from jaxpar.models.registry import build_model  # noqa: F401 (the model a run builds, by this name)
from jaxpar.parallel import distributed as jdistributed
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel.watchdog import Watchdog
from jaxpar.train import checkpoint as jckpt
from jaxpar.train import executables
from jaxpar.train import hooks
from jaxpar.train import metrics as jmetrics
from jaxpar.train import preemption
from jaxpar.train.step import Trainer

# A restart reads its checkpoint beside a compile that has run this long (a cache miss); a load
# from the cache is over sooner, and the read follows it.
_OVERLAP_AFTER_S = 0.5


@dataclasses.dataclass
class RunResult:
  """What a run returns to Python callers (tests, notebooks)."""
  steps: int  # total steps completed, including resumed ones
  losses: dict[int, float]  # step -> loss for every step run in this process
  state: Any
  trainer: Trainer
  summary: dict


def prepare(cfg: Config, mesh_shape: tuple[int, ...]) -> Trainer:
  """Checks every degree against the devices and builds the trainer (nothing is written)."""
  devices = jax.devices()
  jmesh.check(mesh_shape, cfg, len(devices))
  mesh = jmesh.make(mesh_shape, devices)
  return Trainer(cfg, mesh, build_model(cfg))


def _batch_abstract(element_spec: dict, process_count: int) -> dict:
  """The global batch from one process's {name: (shape, dtype)}: leading axis x process_count."""
  return {k: jax.ShapeDtypeStruct((shape[0] * process_count,) + tuple(shape[1:]), dtype)
          for k, (shape, dtype) in element_spec.items()}

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


class _Run:
  """One run's parts, set up in the order that leaves nothing on disk for bad input: the model
  and mesh, the resume point, the data, then the workdir, the state and the compiled step."""

  def __init__(self, cfg: Config, trainer: Trainer, workdir: str, start: int | None,
               metrics_file: str | None, progress: bool, log, profile_steps, split,
               step_store: bool = False):
    self.cfg, self.trainer, self.split, self.log = cfg, trainer, split, log
    self.is_main = jax.process_index() == 0
    pi, pc = jax.process_index(), jax.process_count()
    # Data before the workdir: a dataset that is missing or does not fit the model is bad input,
    # and what building it wrote under the workdir (<workdir>/data by default) goes again.
    with _undone_on_failure(workdir):
      if cfg.model.init_from and start is None:  # the folder's tensors, before anything is written
        hf_weights.check(cfg.model.init_from, cfg.model, lora.base_only(trainer.model.abstract))
      self.batches = jdata.make_loader(cfg, workdir, pi, pc)
      evals = (jdata.make_loader(cfg, workdir, pi, pc, split=cfg.data.eval_split, train=False)
               if cfg.train.eval_every else None)
    if cfg.data.tokenizer and cfg.model.kind != "cnn":  # which tokens the model learns
      own = cfg.model.init_from and (os.path.realpath(cfg.data.tokenizer)
                                     == os.path.realpath(cfg.model.init_from))
      log(f"tokenizer: {cfg.data.tokenizer}"
          + (" (the model.init_from folder's tokenizer.json)" if own else ""))
    for loader in (self.batches, evals):  # how packed records (data.source=jsonl) fill windows
      if getattr(loader, "summary", None):
        log(loader.summary)
    os.makedirs(workdir, exist_ok=True)
    self.ckpt = jckpt.Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.checkpoint.keep,
                                   every=cfg.checkpoint.every)
    abstract = _batch_abstract(self.batches.element_spec, pc)
    self.batch_sharding = trainer.batch_sharding(abstract)
    self.start = self.step = start or 0
    self.watchdog = Watchdog(cfg.train, cfg.train.log_every)
    skipped = self._state_and_step(start, abstract, step_store)
    self.peak, self.peak_source = jmetrics.peak_flops_per_device(self.earlier_peak)
    logger = jmetrics.MetricsLogger(workdir if self.is_main else None,
                                    metrics_file if self.is_main else None, cfg.train.steps,
                                    is_main=self.is_main, progress=progress and self.is_main)
    self.rate = hooks.Throughput(resumed=self.start > 0)
    self.report = hooks.Reporter(cfg, trainer, logger, self.rate, self.compile_info, self.peak,
                                 skipped, kept=lambda: hooks.kept(self.ckpt))
    self.rollbacks = hooks.Rollbacks(cfg, self.report, split, log) if self.report.guard else None
    if self.rollbacks:
      self.rollbacks.start(self.start, self.state)
    self.evaluation = hooks.Evaluation(cfg, trainer, evals, abstract, self.batch_sharding, split)
    self.profiling = hooks.Profiling(profile_steps, os.path.join(workdir, "profile"))
    self.stopped: dict = {}

  def _state_and_step(self, start: int | None, abstract: Any, step_store: bool) -> int:
    """Makes the state (new, or read from the checkpoint of `start`) and the compiled step
    (loaded from the step store, or traced and compiled), each while the other is under way where
    that gains time; returns the skipped steps the state's run counted."""
    trainer, restored, self.earlier_peak = self.trainer, None, None
    if start is None:
      # A new state is created asynchronously: waiting for it here keeps its computation out of
      # the compile's time (on CPU they share the cores, so the wait costs no wall time).
      self.state, _, skipped = self._initial_state(None)
      jax.block_until_ready(self.state)
    # The stored executable of this very step (executables.py), which needs no tracing.
    say = executables.note if self.is_main else (lambda text: None)  # once, not per process
    store = executables.folder(say) if step_store else None
    key = executables.fingerprint(trainer, abstract, self.batch_sharding) if store else None
    compiled = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      self.watchdog.at(self.start, "compiling the step", slow=True)
      try:
        with jmetrics.compile_watch(this_thread=True) as self.compile_info, self.watchdog:
          if start is not None and key and executables.stored(store, key):
            # Loading a stored step needs no tracing and leaves the GIL mostly free: the
            # checkpoint is read beside it.
            restored = pool.submit(self._initial_state, start)
          self.compiled = (executables.load(store, key, (trainer.abstract_state, abstract),
                                            list(trainer.mesh.devices.flat), say=say)
                           if key else None)
          stored = self.compiled is not None
          if not stored:
            lowered = trainer.lower(abstract)
          if start is not None and restored is None:
            # Else a resume reads its checkpoint (orbax's Python on that thread, tensorstore's
            # reads on its own) beside XLA's compile, which leaves the GIL free, not beside the
            # tracing, which holds it; and only once the compile has run for a while: a load from
            # JAX's cache takes a fraction of a second, and a read beside it would only slow it.
            restored = pool.submit(self._restore_after, compiled, start)
          if not stored:
            # A step the store lacks is compiled past JAX's cache, whose copy could not be kept
            self.compiled = executables.compile_fresh(lowered) if key else lowered.compile()
      finally:
        compiled.set()  # (a failed compile too: the read goes on, and its failure comes first)
        if restored is not None:  # its failure (one sentence) first: it is the run's to report
          self.state, _, skipped = restored.result()
    if key:
      self.compile_info["step_store"] = "hit" if stored else "miss"
      # The step was loaded (from the store), or compiled by XLA past JAX's cache, which then
      # looks up nothing: the step's miss, not the cache's absence.
      self.compile_info["compile_cache"] = "hit" if stored else "miss"
      if not stored:
        executables.save(store, key, self.compiled, jconfig.compile_cache_max_bytes(self.cfg),
                         say=say)
    return skipped

  def _restore_after(self, compiled: threading.Event, start: int) -> tuple[Any, int, int]:
    """The checkpoint of `start`, read once the compile is done or has run for 0.5 s."""
    compiled.wait(_OVERLAP_AFTER_S)
    return self._initial_state(start)

  def _initial_state(self, start: int | None) -> tuple[Any, int, int]:
    """(state, step, skipped steps): resumed, from a Hugging Face folder, or initialised."""
    cfg, trainer = self.cfg, self.trainer
    if start is not None:
      with jckpt.readable(self.ckpt.directory, start, jckpt.RESUME_REMEDY):
        state, extra = trainer.restore(self.ckpt, start)  # the loss scale's entry may differ
      self.batches.restore(extra["data"])
      self.earlier_peak = extra.get("peak_flops")  # the peak the run measured before
      self.log(f"resuming from the checkpoint at step {start} in {self.ckpt.directory}")
      return trainer.from_logical(state), start, int(extra.get("skipped_steps", 0))
    if cfg.model.init_from:  # a new run from a Hugging Face model folder's weights
      shardings = trainer.state_shardings["params"]
      params = hf_weights.load_params(cfg.model.init_from, cfg.model,
                                      lora.base_only(trainer.model.abstract),
                                      lora.base_only(shardings))
      params = lora.add_adapters(params, trainer.model, cfg.train, shardings, cfg.train.seed)
      self.log(f"initialised from the model folder {cfg.model.init_from}")
      return trainer.init_with(params), 0, 0
    return trainer.init(cfg.train.seed), 0, 0

  def _one_step(self) -> dict:
    """Reads the next batch and dispatches the next step (no wait for it)."""
    watchdog, n = self.watchdog, self.step + 1
    self.profiling.before(n, self.state, self.rate)
    watchdog.at(n, f"reading the batch of step {n}")
    with self.split.part("input_wait"):
      batch = hooks.global_batch(self.batches.next(), self.batch_sharding)
    watchdog.at(n, f"dispatching step {n}")
    self.state, metrics = self.compiled(self.state, batch)
    self.step = n
    self.profiling.after(n, self.state, self.rate)
    self.report.add(n, metrics)
    return metrics

  def _flush(self, save: bool, final: bool, stopping: bool, extra: dict | None) -> bool:
    """Logs the metrics so far; rolls back a loss spike; whether to save now."""
    step, watchdog = self.step, self.watchdog
    watchdog.at(step, f"fetching the metrics of steps up to {step} (waiting for them to finish)")
    spike = self.report.flush(step, extra)
    if watchdog.first:
      watchdog.first_step_done()
    if spike is not None:
      self.state, self.step = self.rollbacks.roll_back(*spike, step)
      return stopping  # a stop saves the restored state, whose data position is past the spike
    if self.rollbacks:
      return self.rollbacks.after_flush(step, self.state, save, final, watchdog)
    return save

  def train(self, checkpoints: hooks.Checkpointing, stopping: hooks.Stopping) -> None:
    """Steps until train.steps or a stop; the hooks at each step."""
    cfg, watchdog = self.cfg, self.watchdog
    while self.step < cfg.train.steps:
      metrics = self._one_step()
      asked = stopping.asked(self.step, watchdog)
      final = bool(asked) or self.step == cfg.train.steps
      save = final or checkpoints.due(self.step)
      extra = (self.evaluation(self.step, self.state, metrics, watchdog, self.rate)
               if self.evaluation.due(self.step) else None)
      if save or extra is not None or self.step % cfg.train.log_every == 0:
        save = self._flush(save, final, bool(asked), extra)
      if save:
        checkpoints.save(self.step, self.state, self.report.skipped, watchdog)
      if asked:
        self.stopped = asked
        break
    checkpoints.finish(self.step, watchdog)

  def summary(self) -> dict:
    cfg, report, n_dev = self.cfg, self.report, self.trainer.mesh.size
    eps, with_warmup = self.rate.rate(cfg.train.batch_size)
    measured = jmetrics.device_peak_memory_bytes()  # the allocator's own peak, where kept (GPU)
    losses, guard, state = report.losses, report.guard, self.state
    return {**self.profiling.summary(self.compiled, self.trainer), "steps": self.step,
            "parameters": sum(math.prod(leaf.shape)  # the model's, as it is trained, less the
                              for leaf in jax.tree.leaves(self.trainer.model.abstract))  # padding
                          - decoder.padding_params(self.trainer.model.abstract, cfg.model),
            "steps_this_run": self.step - self.start, "examples_per_sec": eps,
            **({"rate_includes_warmup": True} if with_warmup else {}),
            **({"tokens_per_sec": eps * report.tokens_per_step / cfg.train.batch_size}
               if report.tokens_per_step else {}),
            "mfu": report.flops_per_step * eps / cfg.train.batch_size / (self.peak * n_dev),
            "peak_flops_per_device": self.peak, "peak_flops_source": self.peak_source,
            # the one definition plan.py reports too (hlo.memory)
            "peak_memory_bytes": hlo.memory(self.compiled)["peak_bytes"],
            **({"allocator_peak_bytes": measured} if measured is not None else {}),
            **self.compile_info, "devices": n_dev,
            "first_loss": losses[min(losses)] if losses else None,
            "last_loss": losses[max(losses)] if losses else None,
            "interrupted": bool(self.stopped), "skipped_steps": report.skipped,
            **report.closing_figures(),
            **({"rollbacks": guard.rollbacks, "rollback_copy_bytes": guard.nbytes}
               if guard is not None else {}),
            **({"loss_scale": float(state["loss_scale"]["scale"])}
               if self.trainer.dynamic_scale else {}),
            **self.split.summary()}


def run(cfg: Config, mesh_shape: tuple[int, ...], workdir: str, metrics_file: str | None = None,
        steps: int | None = None, progress: bool = True, log=print,
        profile_steps: tuple[int, int] | None = None, step_store: bool = False) -> RunResult:
  """Trains `cfg` on `mesh_shape` for `steps` total steps (default train.steps) in `workdir`;
  `profile_steps` (A, B) traces steps A..B into <workdir>/profile (analysis/profile.py).
  `step_store` loads a step compiled by an earlier run of the same key without tracing it
  (executables.py; only where jaxpar's code runs unchanged, as in `jaxpar-train`)."""
  split = jmetrics.TimeSplit()
  if steps is not None:
    cfg = jconfig.override(cfg, train={"steps": steps})
  cfg = jconfig.absolute_paths(cfg)  # saved with the checkpoints: see resume_mismatch
  if profile_steps:
    jprofile.check_window(profile_steps, cfg.train.steps)
  trainer = prepare(cfg, mesh_shape)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  start = jckpt.resumable(cfg, ckpt_dir)
  if start is not None and start >= cfg.train.steps:
    log(f"nothing to train: the checkpoint in {ckpt_dir} is at step {start} and --steps is "
        f"{cfg.train.steps}")
    return RunResult(steps=start, losses={}, state=None, trainer=trainer,
                     summary={"steps": start, "steps_this_run": 0, "nothing_to_train": True})
  r = _Run(cfg, trainer, workdir, start, metrics_file, progress, log, profile_steps, split,
           step_store)
  loop_t0 = time.perf_counter()
  split.seconds["compile"] = r.compile_info["compile_s"]
  split.seconds["startup"] = loop_t0 - split.t0 - r.compile_info["compile_s"]
  peer_lost = False
  with preemption.StopFlag() as stop, jax.set_mesh(trainer.mesh), r.watchdog:
    stopping = hooks.Stopping(stop, trainer.mesh, jax.process_count())
    checkpoints = hooks.Checkpointing(cfg, r.ckpt, trainer, r.batches, stopping.vote, split,
                                      jmetrics.peak_record(r.peak, r.peak_source))
    try:
      r.train(checkpoints, stopping)
    except Exception as e:
      peer_lost = jdistributed.lost_peer(e) is not None
      raise
    finally:
      r.profiling.close()
      try:
        checkpoints.close(r.step, peer_lost, r.watchdog)
      finally:
        r.batches.close()
        r.evaluation.close()
  split.seconds["steps"] = time.perf_counter() - loop_t0 - split.beside_steps()
  if r.stopped:
    preemption.say_stopped(r.stopped, stop.requested, r.step, log if r.is_main else None)
  summary = r.summary()
  text = r.report.logger.final(summary)
  if r.is_main:
    log(text)
  return RunResult(steps=r.step, losses=r.report.losses, state=r.state, trainer=trainer,
                   summary=summary)
