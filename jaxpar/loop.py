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
import signal
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxpar import config as jconfig
from jaxpar import distributed as jdistributed
from jaxpar import hlo
from jaxpar import mesh as jmesh
from jaxpar import metrics as jmetrics
from jaxpar import model as jmodel
from jaxpar import profile as jprofile
from jaxpar.config import Config, ConfigError
from jaxpar.step import Trainer


@dataclasses.dataclass
class RunResult:
  """What a run returns to Python callers (tests, notebooks)."""
  steps: int  # total steps completed, including resumed ones
  losses: dict[int, float]  # step -> loss for every step run in this process
  state: Any
  trainer: Trainer
  summary: dict


def build_model(cfg: Config) -> jmodel.ModelDef:
  """The ModelDef for `model.kind`."""
  if cfg.model.kind in jmesh.DECODERS:
    return jmodel.decoder(cfg)
  if cfg.model.kind == "cnn":
    from jaxpar.models import cnn
    return cnn.model_def(cfg)
  raise ConfigError(f"model.kind={cfg.model.kind!r} is not one of gpt, llama, cnn")


def prepare(cfg: Config, mesh_shape: tuple[int, int, int]) -> Trainer:
  """Checks every degree against the devices and builds the trainer (nothing is written)."""
  if cfg.parallel.virtual_stages > 1 and cfg.parallel.schedule != "circular":
    raise ConfigError("parallel.virtual_stages > 1 needs parallel.schedule=circular")
  devices = jax.devices()
  jmesh.check(mesh_shape, cfg, len(devices))
  mesh = jmesh.make(mesh_shape, devices)
  return Trainer(cfg, mesh, build_model(cfg))


class _StopFlag:
  """SIGTERM / SIGINT ask the loop to finish the current step, checkpoint and exit cleanly."""

  def __init__(self):
    self.requested: signal.Signals | None = None
    self._old = {}

  def __enter__(self):
    from jaxpar.cli import pending_interrupt  # a signal that reached startup but was lost there
    self.requested = pending_interrupt()
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    self.requested = signal.Signals(signum)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


class _StopVote:
  """Agrees across processes on when to stop: a signal may reach only some of them.

  After every step each process puts its requested signal (0: none) on its devices, and a jitted
  all-gather over `mesh` (one int32 per device) replicates everyone's. The result is read one step
  later: by then it has finished behind the previous step, so the host waits only for that step,
  with the next one already queued, and never for the step just dispatched. Every process reads
  the same exchange after the same step, so all stop there and save together. Checking every
  step costs one tiny collective beside the step's own, and acts on a signal within two steps.
  """

  def __init__(self, mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P
    self.owners = [d.process_index for d in mesh.devices.flat]  # process of each element
    self.sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))  # element i on devices.flat[i]
    self.gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    self.pending = None  # the exchange sent after the previous step

  def _send(self, value: int) -> jax.Array:
    mine = np.array([value], np.int32)
    return self.gather(jax.make_array_from_callback((len(self.owners),), self.sharding,
                                                    lambda _: mine))

  def __call__(self, local: signal.Signals | None) -> dict[int, signal.Signals]:
    """Sends `local`; returns {process: signal} of the processes that asked one exchange ago."""
    seen, self.pending = self.pending, self._send(int(local or 0))
    if seen is None:
      return {}
    return {p: signal.Signals(int(s)) for p, s in zip(self.owners, np.asarray(seen)) if s}

  def until_saved(self, saving) -> None:
    """Returns once no process has a save in flight (`saving()`: this process's).

    orbax would wait too, at a barrier of JAX's coordination service, which notices a dead process
    only after the heartbeat timeout (100 s by default) and then aborts this one with a C++ stack
    trace. This exchange is a collective: a dead process fails it at once, as a lost peer. Every
    process sees the same answers, so all make the same exchanges.
    """
    while np.asarray(self._send(int(saving()))).any():
      time.sleep(0.02)


def _say_stopped(asked: dict[int, signal.Signals], own: signal.Signals | None, step: int,
                 log) -> None:
  """Says why this process stopped at `step`: through `log`, or to stderr where that is None.

  Every process says it, not only the main one that logs: the signal may have reached any of them.
  """
  saved = f"saved a checkpoint at step {step}; run again to resume"
  pi = jax.process_index()
  if jax.process_count() == 1:
    text = f"received {asked[pi].name}: {saved}"
  elif own is not None:
    text = f"process {pi} received {own.name}: {saved}"
  else:
    first = min(asked)
    text = (f"process {pi} stops at step {step} because process {first} received "
            f"{asked[first].name}: {saved}")
  if log is None:
    print(text, file=sys.stderr, flush=True)
  else:
    log(text)


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
  from jaxpar import checkpoint as jckpt
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
  if steps is not None:
    cfg = jconfig.override(cfg, train={"steps": steps})
  cfg = jconfig.absolute_paths(cfg)  # saved with the checkpoints: see resume_mismatch
  total = cfg.train.steps
  if profile_steps:
    jprofile.check_window(profile_steps, total)
  trainer = prepare(cfg, mesh_shape)
  is_main = jax.process_index() == 0

  from jaxpar import checkpoint as jckpt
  from jaxpar.data import make_loader
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
    batches = make_loader(cfg, workdir, pi, pc)
    evals = (make_loader(cfg, workdir, pi, pc, split=cfg.data.eval_split, train=False)
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
    from jaxpar.interop import hf
    state, start = trainer.init_with(hf.load_params(
        cfg.model.init_from, cfg.model, trainer.model.abstract, trainer.state_shardings["params"])), 0
    log(f"initialised from the model folder {cfg.model.init_from}")
  else:
    state, start = trainer.init(cfg.train.seed), 0

  with jmetrics.compile_watch() as compile_info:
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

  def flush(now_step: int, extra: dict | None = None) -> None:
    """Fetches pending metrics (one host sync), checks them, logs the newest."""
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
                          **(extra or {}), **(compile_info if not logged else {})})
    logged.append(now_step)
    pending.clear()
    interval_t, interval_steps = time.perf_counter(), 0

  # One process needs no agreement: it stops after the step its own signal lands in.
  vote = _StopVote(trainer.mesh) if pc > 1 else None
  window = jprofile.Window(profile_steps, os.path.join(workdir, "profile")) if profile_steps else None
  with _StopFlag() as stop, jax.set_mesh(trainer.mesh):
    try:
      while step < total:
        if window:  # the profiler's own start and stop are not step time
          interval_t += window.before(step + 1, state)
        state, m = compiled(state, _global_batch(batches.next(), batch_sharding))
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
          asked = vote(stop.requested)
        stopping = bool(asked)
        save_now = stopping or step == total or (
            cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
        eval_now = evals is not None and step % cfg.train.eval_every == 0
        extra = None
        if eval_now:
          jax.block_until_ready(m)  # the steps so far count as training time, the eval does not
          t_eval = time.perf_counter()
          extra = evaluate(state["params"])  # the step's own sharded path and layer order
          interval_t += time.perf_counter() - t_eval
        if step % cfg.train.log_every == 0 or save_now or eval_now:
          flush(step, extra)
        if save_now:
          if vote is not None:
            vote.until_saved(ckpt.saving)  # orbax starts a save by waiting for the previous one
          ckpt.maybe_save(step, trainer.to_logical(state), {"data": batches.state(), "config": jconfig.to_dict(cfg),
                                                        "skipped_steps": skipped[0]},
                          force=True)
        if stopping:
          stopped = asked
          break
      if vote is not None:
        vote.until_saved(ckpt.saving)
    except Exception as e:
      peer_lost = jdistributed.lost_peer(e) is not None
      raise
    finally:
      if window:
        window.stop()
      try:
        if not peer_lost:  # a save in flight waits at a barrier for the dead process: leave it
          ckpt.close()     # incomplete, so the last complete checkpoint is the one resumed
      finally:             # (close waits for the save in flight; a failed one is a SaveError)
        batches.close()
        if evals is not None:
          evals.close()

  if stopped:
    _say_stopped(stopped, stop.requested, step, log if is_main else None)
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
             **({"loss_scale": float(state["loss_scale"]["scale"])} if trainer.dynamic_scale else {})}
  text = logger.final(summary)
  if is_main:
    log(text)
  return RunResult(steps=step, losses=losses, state=state, trainer=trainer, summary=summary)
