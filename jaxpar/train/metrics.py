"""Training-loop logging: JSONL metrics, TensorBoard scalars, a progress bar and MFU arithmetic.

Only the main process writes. Files and the TensorBoard writer are created on the first line
written, so a run that fails during setup leaves nothing behind, and every line is flushed, so an
interrupted run leaves only complete lines.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxpar.analysis import devices


def model_flops_per_token(n_params_nonembedding: int, n_layers: int, d_model: int,
                          seq_len: int) -> float:
  """Training FLOPs per token: 6N (weight matmuls, fwd+bwd) + 12·L·d·T (attention, PaLM)."""
  return 6.0 * n_params_nonembedding + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops_per_device: float,
        n_devices: int) -> float:
  """Model FLOPs utilization in [0, 1]: achieved model FLOP/s over the peak of all devices."""
  return tokens_per_sec * flops_per_token / (peak_flops_per_device * n_devices)


def peak_flops_per_device(earlier: dict | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one local device, where the number came from): see jaxpar.analysis.devices."""
  return devices.peak_flops_per_device(earlier)


def peak_record(peak: float, source: str) -> dict:
  """What a checkpoint keeps of the peak, for a restart: see jaxpar.analysis.devices."""
  return devices.peak_record(peak, source)


def device_peak_memory_bytes() -> int | None:
  """Largest `peak_bytes_in_use` over local devices; None where the backend keeps no stats (CPU)."""
  peaks = []
  for d in jax.local_devices():
    try:
      stats = d.memory_stats()
    except Exception:  # backends without allocator stats may raise instead of returning None
      stats = None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


_CACHE_ASKED = "/jax/compilation_cache/compile_requests_use_cache"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def compile_watch(this_thread: bool = False):
  """Times the compiles in the block and says whether they came from the persistent cache.

  Yields a dict that holds, after the block, `compile_s` (wall seconds) and `compile_cache`:
  "hit" when every program compiled in the block was loaded from the cache, "miss" when any was
  compiled, "off" when no cache was looked up (JAX looks only with a cache folder set).
  `this_thread` counts only this thread's compiles (JAX reports each in the compiling thread),
  not those of a thread beside the block.
  """
  asked, hits = [0], [0]
  me = threading.get_ident()

  def listen(event: str, **kwargs) -> None:
    if this_thread and threading.get_ident() != me:
      return
    asked[0] += event == _CACHE_ASKED
    hits[0] += event == _CACHE_HIT

  out: dict[str, Any] = {}
  jax.monitoring.register_event_listener(listen)
  t0 = time.perf_counter()
  try:
    yield out
  finally:
    out["compile_s"] = time.perf_counter() - t0
    jax.monitoring.unregister_event_listener(listen)
    out["compile_cache"] = "off" if not asked[0] else "hit" if hits[0] == asked[0] else "miss"


class TimeSplit:
  """A run's wall seconds by what they went to, for the summary's goodput.

  startup: config to the first step, compile aside (devices, data, state, restore); compile: the
  step's (a cache hit or miss); steps: the training loop's time that no part below took, i.e.
  dispatching steps and waiting for them; input_wait: getting the next batch onto the devices;
  checkpoint: the loop blocked on saving (async saves block only while copying off the devices,
  and at the end); eval: evaluation; rollback: steps thrown away by the loss-spike guard,
  restoring the state, and the guard's copies of it. goodput = steps / wall.
  """
  PARTS = ("startup", "compile", "steps", "input_wait", "checkpoint", "eval", "rollback")
  BESIDE_STEPS = ("input_wait", "checkpoint", "eval", "rollback")  # parts timed inside the loop

  def __init__(self):
    self.t0 = time.perf_counter()
    self.seconds = dict.fromkeys(self.PARTS, 0.0)

  @contextlib.contextmanager
  def part(self, name: str):
    """Adds the block's wall time to `name`."""
    t = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] += time.perf_counter() - t

  def beside_steps(self) -> float:
    """Seconds the loop has spent so far on anything but steps."""
    return sum(self.seconds[k] for k in self.BESIDE_STEPS)

  def summary(self) -> dict[str, Any]:
    """{'wall_s', 'time_s': {part: seconds}, 'goodput'} up to now."""
    wall = time.perf_counter() - self.t0
    return {"wall_s": wall, "time_s": dict(self.seconds),
            "goodput": self.seconds["steps"] / wall if wall > 0 else 0.0}


def _plain(value: Any) -> Any:
  """JSON-ready copy: numpy/jax scalars become int/float/bool, non-finite floats become None."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    f = float(value)
    return f if math.isfinite(f) else None  # strict JSON has no NaN/Infinity
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if hasattr(value, "item") and getattr(value, "size", 1) == 1:
    return _plain(value.item())
  return str(value)


def _scalars(prefix: str, value: Any) -> list[tuple[str, float]]:
  """(tag, number) pairs of a possibly nested metric value; nested keys are joined with '/'."""
  if isinstance(value, dict):
    out = []
    for k, v in value.items():
      out.extend(_scalars(f"{prefix}/{k}", v))
    return out
  if isinstance(value, (bool, np.bool_)) or isinstance(value, str) or value is None:
    return []
  if isinstance(value, (int, float, np.integer, np.floating)):
    return [(prefix, float(value))]
  if hasattr(value, "item") and getattr(value, "size", 1) == 1:
    return _scalars(prefix, value.item())
  return []


def _human_flops(f: float) -> str:
  for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
    if f >= scale:
      return f"{f / scale:.4g} {unit}"
  return f"{f / 1e6:.4g} MFLOP/s"


def _human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


# The page that explains every line of the summary and every field of a metrics row.
OUTPUT_PAGE = "docs/output.md"


def format_summary(summary: dict[str, Any]) -> str:
  """Multi-line human-readable summary of a run; known keys are spelled out, the rest listed."""
  s = _plain(summary)
  lines = []
  if s.get("steps") is not None:
    lines.append(f"steps: {s['steps']}")
  if s.get("tokens_per_sec") is not None:
    lines.append(f"tokens/s: {s['tokens_per_sec']:,.0f}" + (
        " (every step timed, the first one's warm-up included: a run longer than train.log_every "
        "steps times the steady state)" if s.get("rate_includes_warmup") else ""))
  if s.get("mfu") is not None:
    line = f"MFU: {100 * s['mfu']:.2f}%"
    if s.get("peak_flops_per_device") is not None:
      line += f" of {_human_flops(s['peak_flops_per_device'])} per device"
    if s.get("peak_flops_source"):
      line += f" ({s['peak_flops_source']})"
    lines.append(line)
  if "peak_memory_bytes" in s:
    mem = s["peak_memory_bytes"]
    lines.append("peak memory per device: "
                 + ("not reported by this backend" if mem is None else _human_bytes(mem)
                    + " (compiled step: arguments + outputs + temporaries - donated)"))
  if s.get("eval_step") is not None:
    lines.append(_eval_line(s))
  if s.get("moe_load"):
    lines.append(_load_line(s))
  if s.get("profile"):
    lines.append(_profile_line(s["profile"]))
  if s.get("time_s") and s.get("wall_s") is not None:
    lines.append(_time_line(s))
  known = {"steps", "tokens_per_sec", "mfu", "peak_flops_per_device", "peak_flops_source",
           "peak_memory_bytes", "final", "profile", "rate_includes_warmup", "time_s", "wall_s",
           "goodput"}
  for k, v in s.items():
    if k not in known and not k.startswith(("eval_", "moe_")):
      lines.append(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
  lines.append(f"what each line means: {OUTPUT_PAGE}")
  return "\n".join(lines)


def _eval_line(s: dict[str, Any]) -> str:
  """'eval: loss 2.31, accuracy 41.25% (after step 40)' (and any other eval_* figure)."""
  figures = {k[len("eval_"):]: v for k, v in s.items()
             if k.startswith("eval_") and k != "eval_step" and v is not None}
  said = [f"{k} {100 * v:.2f}%" if k == "accuracy" else f"{k.replace('_', ' ')} {v:.4g}"
          for k, v in sorted(figures.items(), key=lambda kv: kv[0] != "loss")]
  return f"eval: {', '.join(said)} (after step {s['eval_step']})"


def _load_line(s: dict[str, Any]) -> str:
  """The experts' load at the last logged step: the busiest expert against an even share, and
  each expert's share of the routed rows."""
  shares = s["moe_load"]
  line = (f"experts' load: the busiest expert takes {s['moe_max_load']:.2f}x an even share "
          f"(1.00 = balanced); each expert's share of the routed rows "
          f"{' '.join(f'{x:.3f}' for x in shares)}")
  if s.get("moe_dropped") is not None:
    line += f"; {100 * s['moe_dropped']:.2f}% of the routed rows dropped (over capacity)"
  return line + f" (after step {s['moe_step']})"


def _time_line(s: dict[str, Any]) -> str:
  """'wall 40.1 s = startup 5.2 + compile 13.7 (cache miss) + steps 20.1 + ...; goodput 50%'."""
  t = s["time_s"]
  cache = f" (cache {s['compile_cache']})" if s.get("compile_cache") in ("hit", "miss") else ""
  parts = " + ".join(f"{name.replace('_', ' ')} {t[name] or 0:.3g}" + (cache if name == "compile" else "")
                     for name in t)
  return f"time: wall {s['wall_s']:.3g} s = {parts}; goodput {100 * (s.get('goodput') or 0):.1f}%"


def _profile_line(p: dict[str, Any]) -> str:
  """The profiled steps' time split into compute, collectives and the rest, and where it came from."""
  a, b = p["steps"]
  if not p.get("traced_steps"):
    return f"profile: steps {a}-{b} were not run by this run; no trace"
  ms = lambda key: f"{1e3 * p[key]:.4g} ms"
  share = p["collective_s"] / p["step_s"] if p["step_s"] else 0.0
  how = ("measured from the profiler trace, per device, averaged over "
         f"{p.get('devices', 0)} devices" if p["source"] == "trace" else
         "estimated from the compiled HLO (FLOPs / peak FLOP/s against collective bytes / link "
         "bandwidth), not measured")
  return (f"profile steps {a}-{b} (trace in {p['trace_dir']}): step {ms('step_s')} = compute "
          f"{ms('compute_s')} + collectives {ms('collective_s')} ({share:.0%}) + other "
          f"{ms('other_s')}; {how}")


def _missing(package: str, consequence: str) -> None:
  """One line on stderr for an optional helper that is not installed (a bare accelerator image:
  `pip install -e .` installs it); the run goes on without it."""
  print(f"note: {package} is not installed, so {consequence} (pip install {package})",
        file=sys.stderr)


def _import_tensorboardx() -> None:
  """Imports tensorboardX without torch, where torch is installed but not imported yet.

  tensorboardX tries `import torch` when it is imported, only to accept torch tensors (jaxpar
  passes floats); with torch installed that import takes 1.06 s of CPU against 0.10 s without,
  and it ran beside the first step. torch is hidden from the import for those 0.1 s (a thread
  that imports torch in that window gets an ImportError), and importable again right after. A
  tensorboardX that cannot do without torch is imported again with it.
  """
  try:
    if "torch" not in sys.modules:
      before = set(sys.modules)
      sys.modules["torch"] = None  # `import torch` raises ImportError while this is here
      try:
        importlib.import_module("tensorboardX")
        return
      except ImportError:  # it needs torch after all: forget what it half imported
        for name in set(sys.modules) - before:
          if name.split(".")[0] == "tensorboardX":
            del sys.modules[name]
      finally:
        if sys.modules.get("torch", 0) is None:
          del sys.modules["torch"]
    importlib.import_module("tensorboardX")
  except Exception:  # the import at its use says what is missing
    pass


class MetricsLogger:
  """Writes metrics as JSON lines, TensorBoard scalars and a tqdm progress bar.

  `log(step, metrics)` takes `step` as the number of completed steps. The bar shows `loss` and
  `tokens_per_sec` when those keys are present, and its rate is 1 / `step_time_s` from the second
  log on (the first interval holds compilation). `final(summary)` understands the keys `steps`,
  `tokens_per_sec`, `mfu`, `peak_flops_per_device`, `peak_flops_source` and `peak_memory_bytes`.
  """

  def __init__(self, workdir: str | None, metrics_file: str | None, total_steps: int,
               is_main: bool = True, use_tensorboard: bool = True, progress: bool = True):
    self.workdir = workdir
    self.metrics_file = metrics_file
    self.total_steps = total_steps
    self.is_main = is_main
    self.use_tensorboard = use_tensorboard and workdir is not None
    self.progress = progress
    self._file = None
    self._writer = None
    self._bar = None
    self._first_interval = True
    self._closed = False
    if self.use_tensorboard and is_main:
      # Imported beside the first step, not at the first log, where the steps would wait for it.
      # A missing package is reported at the first log.
      threading.Thread(target=_import_tensorboardx, daemon=True).start()

  def _write_line(self, record: dict[str, Any]) -> None:
    if not self.metrics_file:
      return
    if self._file is None:
      parent = os.path.dirname(os.path.abspath(self.metrics_file))
      os.makedirs(parent, exist_ok=True)
      self._file = open(self.metrics_file, "a", encoding="utf-8")
    self._file.write(json.dumps(_plain(record), allow_nan=False) + "\n")
    self._file.flush()

  def _tensorboard(self):
    if self._writer is None and self.use_tensorboard:
      try:  # imported late: only the main process needs it
        from tensorboardX import SummaryWriter
      except ImportError:
        self.use_tensorboard = False
        _missing("tensorboardX", "no TensorBoard events are written")
        return None
      self._writer = SummaryWriter(logdir=os.path.join(self.workdir, "tb"))
    return self._writer

  def _progress_bar(self, step: int):
    if self._bar is None and self.progress:
      try:
        from tqdm.auto import tqdm
      except ImportError:
        self.progress = False
        _missing("tqdm", "no progress bar is shown")
        return None

      class Bar(tqdm):
        """A tqdm whose step/s and time left come from the loop's measured step time."""
        measured_rate: float | None = None

        @property
        def format_dict(self):
          d = super().format_dict
          d["rate"] = self.measured_rate
          return d

      # Created at the first log with the steps already done as `initial`: those steps include
      # compilation (or ran before a resume), and tqdm would otherwise divide them by the few
      # microseconds since the bar started (~81,000 step/s).
      self._bar = Bar(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)
      self._first_interval = True
    return self._bar

  def log(self, step: int, metrics: dict[str, Any]) -> None:
    """Records `metrics` (name -> scalar) after `step` completed steps."""
    if not self.is_main or self._closed:
      return
    step = int(step)
    self._write_line({"step": step, **metrics})
    writer = self._tensorboard()
    if writer is not None:
      for name, value in metrics.items():
        for tag, number in _scalars(name, value):
          writer.add_scalar(tag, number, global_step=step)
      writer.flush()
    bar = self._progress_bar(step)
    if bar is not None:
      step_time = _plain(metrics.get("step_time_s"))
      # The first interval's step time includes compilation, so no rate is shown until the next.
      if not self._first_interval and step_time:
        bar.measured_rate = 1.0 / float(step_time)
      self._first_interval = False
      bar.update(max(0, step - bar.n))
      postfix = {}
      if _plain(metrics.get("loss")) is not None:
        postfix["loss"] = f"{float(_plain(metrics['loss'])):.4f}"
      if _plain(metrics.get("tokens_per_sec")) is not None:
        postfix["tok/s"] = f"{float(_plain(metrics['tokens_per_sec'])):,.0f}"
      if postfix:
        bar.set_postfix(postfix, refresh=False)
      bar.refresh()

  def final(self, summary: dict[str, Any]) -> str:
    """Writes the `"final": true` line, closes everything and returns the summary as text."""
    if self.is_main and not self._closed:
      self._write_line({"final": True, **summary})
    self.close()
    return format_summary(summary)

  def close(self) -> None:
    """Closes the bar, the TensorBoard writer and the metrics file; later calls do nothing."""
    if self._closed:
      return
    self._closed = True
    if self._bar is not None:
      self._bar.close()
    if self._writer is not None:
      self._writer.close()
    if self._file is not None:
      self._file.close()

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
