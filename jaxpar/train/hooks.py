"""What the training loop does beside the steps, one object each, called at a step: the step rate
(`Throughput`), metrics fetched and logged at log steps (`Reporter`, with the loss-spike guard),
evaluation, checkpointing, the profiler window and the stop agreement between processes.

Each says what it waits on to the stall watchdog before it waits, and charges its time to its part
of the run's time split (metrics.TimeSplit), so goodput stays the share of wall time in steps.
"""
from __future__ import annotations

import math
import signal
import time
from typing import Any

import jax
import numpy as np

from jaxpar import config as jconfig
from jaxpar.analysis import profile as jprofile
from jaxpar.parallel.watchdog import Watchdog
from jaxpar.train import checkpoint as jckpt
from jaxpar.train import metrics as jmetrics
from jaxpar.train import preemption
from jaxpar.train.guard import SpikeGuard


def global_batch(local: dict, shardings: dict) -> dict:
  """This process's rows of every batch leaf -> global arrays split over `data`."""
  return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in local.items()}


class Throughput:
  """The steps since the last log and their wall time, and the rate over the run.

  The rate is over every interval but a fresh run's first (its first step's warm-up); a run no
  longer than that interval has no other, and its rate then includes the warm-up (`rate`).
  """

  def __init__(self, resumed: bool):
    self.resumed = resumed
    self.timed_s, self.timed_steps = 0.0, 0
    self.warm_s, self.warm_steps = 0.0, 0
    self.restart()

  def restart(self, t: float | None = None) -> None:
    self.t, self.steps = time.perf_counter() if t is None else t, 0

  def exclude(self, seconds: float) -> None:
    """`seconds` of the current interval were not steps (profiler start/stop, an evaluation)."""
    self.t += seconds

  def close(self, now_step: int) -> float:
    """Ends the interval at `now_step`; its mean step time."""
    elapsed = time.perf_counter() - self.t
    if self.resumed or now_step > self.steps:
      self.timed_s, self.timed_steps = self.timed_s + elapsed, self.timed_steps + self.steps
    else:
      self.warm_s, self.warm_steps = elapsed, self.steps
    return elapsed / max(self.steps, 1)

  def rate(self, batch_size: int) -> tuple[float, bool]:
    """(examples/s over the run, whether that includes the first step's warm-up)."""
    with_warmup = not self.timed_s and self.warm_s > 0
    secs, n = (self.warm_s, self.warm_steps) if with_warmup else (self.timed_s, self.timed_steps)
    return (batch_size * n / secs if secs else 0.0), with_warmup


class Reporter:
  """Device metrics, fetched only at log steps (one host sync): checked, judged by the spike
  guard, and the newest logged."""

  def __init__(self, cfg: jconfig.Config, trainer, logger: jmetrics.MetricsLogger,
               rate: Throughput, compile_info: dict, peak: float, skipped: int,
               kept=lambda: ""):
    self.cfg, self.trainer, self.logger, self.rate = cfg, trainer, logger, rate
    self.kept = kept  # () -> what the run's checkpoints hold, for a stop's sentence
    self.compile_info, self.peak = compile_info, peak
    self.guard = SpikeGuard.from_config(cfg.train) if cfg.train.spike_factor else None
    self.skipped = skipped  # steps whose update was dropped (skip_nonfinite, dynamic scaling)
    self.losses: dict[int, float] = {}
    self.pending: list[tuple[int, dict]] = []  # device metrics not yet fetched
    self.logged = 0
    self.last_row: tuple[int, dict] | None = None  # (step, its device metrics) last logged
    self.last_eval: tuple[int, dict] | None = None  # (step, eval_* figures) of the last eval
    self.tokens_per_step = cfg.train.batch_size * trainer.model.tokens_per_example
    self.flops_per_step = trainer.model.flops_per_example * cfg.train.batch_size

  def add(self, step: int, metrics: dict) -> None:
    self.pending.append((step, metrics))
    self.rate.steps += 1

  def _check(self, s: int, m: dict) -> str | None:
    """Raises on a loss the run cannot go on from; the guard's reason to roll back, or None."""
    cfg, trainer = self.cfg, self.trainer
    loss, grad_norm = self.losses[s], float(m["grad_norm"])  # a finite loss with an overflowed
    if trainer.dynamic_scale and m["skipped"] and float(m["loss_scale"]) <= cfg.precision.min_scale:
      raise FloatingPointError(f"gradients overflow at step {s} with the loss scale at its minimum "
                               f"{float(m['loss_scale'])}; stopping without saving")
    if self.guard is not None and not cfg.train.skip_nonfinite and not trainer.dynamic_scale:
      return self.guard.judge(s, loss, grad_norm)  # gradient still makes the state NaN
    if (not (math.isfinite(loss) and math.isfinite(grad_norm)) and not cfg.train.skip_nonfinite
        and not trainer.dynamic_scale):  # dynamic scaling skips an overflow and backs off
      kept = self.kept()
      raise FloatingPointError(f"loss is {loss} and gradient norm {grad_norm} at step {s}; "
                               f"stopping without saving{f', {kept}' if kept else ''}")
    return None

  def flush(self, now_step: int, extra: dict | None = None) -> tuple[int, int, str] | None:
    """Fetches and checks the pending metrics and logs the newest; with the spike guard, a spike
    logs the row of the step that called for it instead (marked `spike`; the steps after it in
    this flush are rolled back unjudged) and returns (first, last, why) of the high steps."""
    fetched = jax.device_get([m for _, m in self.pending])
    for (s, _), m in zip(self.pending, fetched):
      self.losses[s] = float(m["loss"])
      self.skipped += int(m.get("skipped", 0))
      why = self._check(s, m)
      if why is not None:
        elapsed = time.perf_counter() - self.rate.t  # not a throughput interval: rolled back
        self._log(s, m, elapsed / max(self.rate.steps, 1), extra, {"spike": 1})
        self.pending.clear()
        return self.guard.high[0], s, why
    self._log(now_step, fetched[-1], self.rate.close(now_step), extra)
    self.pending.clear()
    self.rate.restart()
    return None

  def _log(self, step: int, fetched: dict, step_time: float, extra: dict | None,
           mark: dict | None = None) -> None:
    m = {k: float(v) for k, v in fetched.items()}
    row = {"loss": m.pop("loss"), "learning_rate": m.pop("learning_rate"),
           "grad_norm": m.pop("grad_norm"), "step_time_s": step_time,
           "examples_per_sec": self.cfg.train.batch_size / step_time}
    if self.tokens_per_step:
      row["tokens_per_sec"] = self.tokens_per_step / step_time
    # The first row says how the step was compiled (a cache hit or miss, and how long it took).
    mfu = self.flops_per_step / step_time / (self.peak * self.trainer.mesh.size)
    self.last_row = step, m
    if extra:
      self.last_eval = step, extra
    self.logger.log(step, {**row, "mfu": mfu, **m, **(extra or {}), **(mark or {}),
                           **(self.compile_info if not self.logged else {}),
                           **({"rollbacks": self.guard.rollbacks} if self.guard else {})})
    self.logged += 1


  def closing_figures(self) -> dict:
    """What the summary adds of the rows: the last evaluation's figures (`eval_step`,
    `eval_loss`, ...) and the experts' load at the last logged step (`moe_step`,
    `moe_max_load`, `moe_load`: each expert's share of the routed rows, `moe_dropped`)."""
    out: dict = {}
    if self.last_eval is not None:
      out.update({"eval_step": self.last_eval[0], **self.last_eval[1]})
    if self.last_row is not None and "moe_max_load" in self.last_row[1]:
      step, m = self.last_row
      out.update({"moe_step": step, "moe_max_load": m["moe_max_load"],
                  "moe_load": [m[k] for k in sorted(k for k in m if k.startswith("moe_load/"))],
                  **({"moe_dropped": m["moe_dropped"]} if "moe_dropped" in m else {})})
    return out


def kept(ckpt) -> str:
  """What a run that stops without saving leaves in `ckpt` (a Checkpointer), for its sentence."""
  latest = ckpt.latest_step()
  if ckpt.saving():
    return "the checkpoint being written is completed and kept"
  if latest is None:
    return f"and no checkpoint has been written in {ckpt.directory}: there is none to resume from"
  return f"the newest checkpoint, of step {latest}, is kept"


class Rollbacks:
  """The loop's side of the spike guard: when to copy the state, the rollback itself, and saves
  put off while a high loss is being judged."""

  def __init__(self, cfg: jconfig.Config, reporter: Reporter, split: jmetrics.TimeSplit, log):
    self.cfg, self.reporter, self.split, self.log = cfg, reporter, split, log
    self.guard = reporter.guard
    self.save_owed = False  # a save put off while a high loss was being judged

  def start(self, step: int, state: dict) -> None:
    with self.split.part("rollback"):
      self.guard.start(step, state, self.reporter.skipped, self.split.beside_steps())

  def after_flush(self, step: int, state: dict, save: bool, final: bool,
                  watchdog: Watchdog) -> bool:
    """Copies a state whose losses were all good; whether to save now. A state with a high loss
    not yet judged is not saved: a rollback would return to a step before it, and the checkpoint
    of this step would then hold the spike's update."""
    if self.guard.clear:
      watchdog.at(step, f"copying the state of step {step} to host memory (loss-spike guard)",
                  slow=True)
      with self.split.part("rollback"):
        self.guard.keep(step, state, self.reporter.skipped, self.split.beside_steps())
      save, self.save_owed = save or self.save_owed, False
    elif save and not final:
      save, self.save_owed = False, True
    return save

  def roll_back(self, first: int, last: int, why: str, now: int) -> tuple[Any, int]:
    """The state and step to go on from after the spike at steps first..last, found at `now`."""
    guard = self.guard
    if guard.should_stop(first):
      raise guard.give_up(first, last, why, self.reporter.kept())
    with self.split.part("rollback"):
      good = guard.roll_back()
      restored = good.copy.restore()
    for s in [s for s in self.reporter.losses if s > good.step]:
      del self.reporter.losses[s]
    self.reporter.skipped = good.skipped
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    self.log(f"loss spike at {steps} ({why}): rolled back to step {good.step} and skipped the "
             f"batches of steps {good.step + 1}-{now} (rollback {guard.rollbacks} of at most "
             f"{guard.max_rollbacks})")
    t = time.perf_counter()
    # The steps since the copy: their wall time less what the loop spent beside them meanwhile.
    self.split.seconds["rollback"] += (t - good.t) - (self.split.beside_steps() - good.beside)
    good.t, good.beside = t, self.split.beside_steps()
    self.reporter.rate.restart(t)
    return restored, good.step


class Evaluation:
  """Every train.eval_every steps: mean loss and metrics over the first train.eval_steps batches
  of data.eval_split, through the step's own sharded path and layer order. train.eval_steps=0
  (or as many batches as the split holds) is every example: the last batch is padded to the
  batch's shape and its padding weighs 0 (Trainer.eval_weighted), and each batch counts by its
  examples (or their loss_weight)."""
  WEIGHT = "loss_weight"  # train/step.py's WEIGHT: a loss's own weight of its batch

  def __init__(self, cfg: jconfig.Config, trainer, evals, batch_abstract: dict,
               batch_sharding: dict, split: jmetrics.TimeSplit):
    self.cfg, self.trainer, self.evals, self.split = cfg, trainer, evals, split
    self.batch_abstract, self.batch_sharding = batch_abstract, batch_sharding
    self.step_fn = self.weighted_fn = None

  def due(self, step: int) -> bool:
    return self.evals is not None and step % self.cfg.train.eval_every == 0

  def _batch(self, params, k: int, full: int) -> dict:
    """Batch k's figures and its 'examples' (the global rows of weight 1): the first `full`
    from the loader's batches, the one past them padded (the split's remainder)."""
    if k < full:
      out = self.step_fn(params, global_batch(self.evals.next(), self.batch_sharding))
      return {**out, "examples": self.cfg.train.batch_size}
    if self.weighted_fn is None:
      self.weighted_fn = self.trainer.eval_jitted(self.batch_abstract, weighted=True)
    batch, weight = self.evals.padded_batch(k)
    rows = next(iter(self.batch_sharding.values()))  # split over `data` like every batch leaf
    return self.weighted_fn(params, global_batch(batch, self.batch_sharding),
                            jax.make_array_from_process_local_data(rows, weight))

  def __call__(self, step: int, state: dict, metrics: dict, watchdog: Watchdog,
               rate: Throughput) -> dict:
    watchdog.at(step, f"waiting for step {step} to finish before evaluating")
    jax.block_until_ready(metrics)  # the steps so far count as training time, the eval does not
    watchdog.at(step, f"evaluating after step {step}", slow=True)
    t = time.perf_counter()
    with self.split.part("eval"):
      if self.step_fn is None:
        self.step_fn = self.trainer.eval_jitted(self.batch_abstract)
      evals = self.evals
      evals.restore({"epoch": 0, "position": 0})  # the same batches every time, so evals compare
      whole = evals.whole_split_steps
      n = min(self.cfg.train.eval_steps or whole, whole)
      full = min(n, evals.steps_per_epoch)
      outs = jax.device_get([self._batch(state["params"], k, full) for k in range(n)])
      evals.close()
    rate.exclude(time.perf_counter() - t)
    # Batches weigh by their examples, or by their loss_weight where the loss has one.
    w = np.array([float(o.get(self.WEIGHT, o["examples"])) for o in outs])
    mean = lambda k: float(np.sum(w * np.array([float(o[k]) for o in outs])) / max(w.sum(), 1e-30))
    return {f"eval_{k}": float(np.mean([o[k] for o in outs])) if k == self.WEIGHT else mean(k)
            for k in outs[0] if k != "examples"}

  def close(self) -> None:
    if self.evals is not None:
      self.evals.close()


class Checkpointing:
  """Saves every checkpoint.every steps, at the last step and when stopping; with several
  processes, a save waits until no process has one in flight (preemption.StopVote)."""

  def __init__(self, cfg: jconfig.Config, ckpt: jckpt.Checkpointer, trainer, batches,
               vote: preemption.StopVote | None, split: jmetrics.TimeSplit,
               peak: dict | None = None):
    self.cfg, self.ckpt, self.trainer, self.batches = cfg, ckpt, trainer, batches
    self.vote, self.split, self.peak = vote, split, peak  # peak: metrics.peak_record

  def due(self, step: int) -> bool:
    every = self.cfg.checkpoint.every
    return bool(every and step % every == 0)

  def save(self, step: int, state: dict, skipped: int, watchdog: Watchdog) -> None:
    watchdog.at(step, f"saving the checkpoint of step {step}", slow=True)
    with self.split.part("checkpoint"):
      if self.vote is not None:
        self.vote.until_saved(self.ckpt.saving)  # orbax starts a save by waiting for the last
      extra = {"data": self.batches.state(), "config": jconfig.to_dict(self.cfg),
               "skipped_steps": skipped, "model": jckpt.model_origin(self.trainer.model),
               **({"peak_flops": self.peak} if self.peak else {})}
      self.ckpt.maybe_save(step, self.trainer.to_logical(state), extra, force=True)

  def finish(self, step: int, watchdog: Watchdog) -> None:
    """After the last step: every process's save is written before any closes."""
    watchdog.at(step, "waiting for the last checkpoint to be written", slow=True)
    if self.vote is not None:
      with self.split.part("checkpoint"):
        self.vote.until_saved(self.ckpt.saving)

  def close(self, step: int, peer_lost: bool, watchdog: Watchdog) -> None:
    """Waits for the save in flight (a failed one is a SaveError): an incomplete one is never
    read, so the last complete checkpoint is what a rerun resumes."""
    if not peer_lost:  # a save in flight waits at a barrier for the dead process: leave it
      watchdog.at(step, "closing the checkpointer (a save may be in flight)", slow=True)
      with self.split.part("checkpoint"):
        self.ckpt.close()


class Profiling:
  """--profile-steps A-B: the profiler traces steps A..B; its start and stop are not step time."""

  def __init__(self, window: tuple[int, int] | None, directory: str):
    self.window = jprofile.Window(window, directory) if window else None

  def before(self, step: int, state: Any, rate: Throughput) -> None:
    if self.window:
      rate.exclude(self.window.before(step, state))

  def after(self, step: int, state: Any, rate: Throughput) -> None:
    if self.window:
      rate.exclude(self.window.after(step, state))

  def close(self) -> None:
    if self.window:
      self.window.stop()

  def summary(self, compiled: Any, trainer) -> dict:
    return self.window.summary(compiled, trainer) if self.window else {}


class Stopping:
  """Which processes asked to stop, read after each step: a signal lands in one process, and with
  several every process must stop after the same step (preemption.StopVote)."""

  def __init__(self, flag: preemption.StopFlag, mesh, processes: int):
    self.flag = flag
    # One process needs no agreement: it stops after the step its own signal lands in.
    self.vote = preemption.StopVote(mesh) if processes > 1 else None

  def asked(self, step: int, watchdog: Watchdog) -> dict[int, signal.Signals]:
    """{process: signal} of those that asked. Read once a step: a signal landing later in the
    step is handled after the next one (the one after that with several processes)."""
    if self.vote is None:
      return {jax.process_index(): self.flag.requested} if self.flag.requested else {}
    watchdog.at(step, f"the stop-signal exchange after step {step} (a collective of every "
                      f"process, behind step {step - 1})")
    return self.vote(self.flag.requested)
