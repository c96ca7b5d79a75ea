"""A profiler window over training steps A..B, and their time split into compute and collectives.

`--profile-steps A:B` traces steps A to B (counted from 1, as the loop logs them) with
`jax.profiler` into `<workdir>/profile`, which TensorBoard's profile plugin or Perfetto open. The
window is fenced: the steps before A finish before the trace starts, and step B finishes before
it stops, so the trace holds exactly those steps.

The split is read back from the trace the profiler wrote (its `.xplane.pb`, through
`jax.profiler.ProfileData`, no TensorFlow needed): per device, the time covered by collective ops
(waiting for peers included) and the time covered by every other op of the step's program.
Whatever of the wall-clock step neither covers is `other` (host work, dispatch, idle). Where the
trace holds no op events, the split is estimated from the compiled HLO instead (collective bytes
over link bandwidth against FLOPs over peak FLOP/s, jaxpar.planning.autoplan's model) and says so.
"""
from __future__ import annotations

import glob
import os
import re
import time
from typing import Any

from jaxpar.analysis import devices, hlo
from jaxpar.config import ConfigError

_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|"
                         r"ragged-all-to-all|collective-broadcast|send|recv)|nccl", re.IGNORECASE)


def parse_window(text: str) -> tuple[int, int]:
  """'2:3' -> (2, 3): steps A..B inclusive, 1 <= A <= B; one sentence otherwise."""
  m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
  if not m:
    raise ConfigError(f"--profile-steps {text!r} is not of the form A:B with integer steps, "
                      f"e.g. 2:3")
  a, b = int(m.group(1)), int(m.group(2))
  if a < 1 or a > b:
    raise ConfigError(f"--profile-steps {text!r} needs 1 <= A <= B (steps count from 1), "
                      f"got A={a}, B={b}")
  return a, b


def check_window(window: tuple[int, int], total: int) -> None:
  """The window must end by the run's last step."""
  if window[1] > total:
    raise ConfigError(f"--profile-steps {window[0]}:{window[1]} ends after the run's last step "
                      f"{total}; use B <= {total}")


class Window:
  """Starts the trace before step A and stops it after step B; the loop calls `before`/`after`."""

  def __init__(self, window: tuple[int, int], directory: str):
    self.first, self.last = window
    self.directory = directory
    self.active = False
    self.steps = 0  # steps traced
    self.wall_s = 0.0
    self._t0 = 0.0
    self._annotation = None

  def before(self, step: int, state: Any) -> float:
    """Called before dispatching `step` (1-based); starts the trace at the window's first step
    (or the first step this run reaches inside it, after a resume). Returns the seconds the
    profiler itself took, which are not step time."""
    import jax
    spent = 0.0
    if not self.active and self.first <= step <= self.last and not self.steps:
      jax.block_until_ready(state)  # earlier steps stay out of the trace
      t0 = time.perf_counter()
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self.active, self._t0 = True, time.perf_counter()
      spent = self._t0 - t0
    if self.active:
      self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
      self._annotation.__enter__()
    return spent

  def after(self, step: int, state: Any) -> float:
    """Called after dispatching `step`; stops the trace once the window's last step is done.
    Returns the seconds the profiler itself took."""
    if not self.active:
      return 0.0
    self._annotation.__exit__(None, None, None)
    self.steps += 1
    if step < self.last:
      return 0.0
    import jax
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    self.wall_s = t0 - self._t0
    self.stop()  # writes the trace: seconds on a large run
    return time.perf_counter() - t0

  def stop(self) -> None:
    """Stops a trace still running (a run interrupted inside the window)."""
    if self.active:
      import jax
      jax.profiler.stop_trace()
      self.active = False

  def summary(self, compiled: Any, trainer: Any) -> dict:
    """{'profile': ...} for the run summary: the window, the trace and the split of its steps."""
    if not self.steps:
      return {"profile": {"steps": [self.first, self.last], "traced_steps": 0}}
    step_s = self.wall_s / self.steps
    out = {"steps": [self.first, self.last], "traced_steps": self.steps,
           "trace_dir": self.directory, "step_s": step_s}
    split = split_from_trace(self.directory, self.steps)
    if split is not None:
      out.update(source="trace", trace_file=split.pop("file"), **split)
    else:
      out.update(source="hlo estimate", **estimate_from_hlo(compiled, trainer, step_s))
    out["other_s"] = max(step_s - out["compute_s"] - out["collective_s"], 0.0)
    return {"profile": out}


def _union(spans: list[tuple[int, int]]) -> int:
  """Total length covered by [start, end) spans."""
  total, end = 0, None
  for a, b in sorted(spans):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def _exclusive(spans: list[tuple[int, int, int]], n: int) -> list[int]:
  """Time covered by [start, end, rank) spans, each instant given to the lowest rank covering it:
  ranks 0..n-1 get their share, so the shares add up to the union of all spans (ops that ran at
  once on one device, e.g. XLA:CPU's concurrent thunks, are counted once)."""
  marks = sorted([(a, 1, r) for a, b, r in spans] + [(b, -1, r) for a, b, r in spans])
  active, out, last = [0] * n, [0] * n, None
  for t, step, rank in marks:
    if last is not None and t > last:
      top = next((r for r in range(n) if active[r]), None)
      if top is not None:
        out[top] += t - last
    active[rank] += step
    last = t
  return out


def _op_events(path: str):
  """(device, HLO op name, module, (start_ns, end_ns)) of every XLA op event in one .xplane.pb."""
  import jax
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    on_device = plane.name.startswith("/device:")
    for line in plane.lines:
      for ev in line.events:
        stats = dict(ev.stats)
        op = stats.get("hlo_op")
        if op is None and on_device and line.name == "XLA Ops":
          op = ev.name  # GPU device planes name events after the HLO op
        if op is None:
          continue
        # XLA:CPU tags each op with its device; a GPU plane is one device.
        device = (plane.name, stats.get("device_ordinal"))
        yield (device, str(op), stats.get("hlo_module"),
               (int(ev.start_ns), int(ev.start_ns + ev.duration_ns)))


def _newest_trace(directory: str) -> str | None:
  files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  return max(files, key=os.path.getmtime) if files else None


def split_from_trace(directory: str, steps: int) -> dict | None:
  """{'compute_s', 'collective_s', 'devices', 'file'}: per device per step, averaged over devices,
  from the newest .xplane.pb under `directory`; None when it holds no XLA op events."""
  path = _newest_trace(directory)
  if path is None:
    return None
  busy: dict[Any, list] = {}
  coll: dict[Any, list] = {}
  for device, op, _, span in _op_events(path):
    busy.setdefault(device, []).append(span)
    if _COLLECTIVE.search(op):
      coll.setdefault(device, []).append(span)
  if not busy:
    return None
  n = len(busy)
  covered = sum(_union(s) for s in busy.values()) / n / steps * 1e-9
  collective = sum(_union(coll.get(d, [])) for d in busy) / n / steps * 1e-9
  return {"compute_s": covered - collective, "collective_s": collective, "devices": n,
          "file": path}


# What a step's time goes to, by HLO instruction: cuDNN's fused attention kernels; matrix
# products (dots, convolutions, cuBLAS/Triton GEMMs, fusions around a dot); the optimizer (every
# op outside the loss's forward `jvp(...)` and backward `transpose(jvp(...))`: the update, the
# clipping norm, offload's copies); everything else of the forward and backward (norms,
# softmax and masking of XLA's attention, elementwise work, the loss).
CATEGORIES = ("matmul", "attention", "optimizer", "other")
_CONTROL = {"while", "call", "conditional", "tuple", "get-tuple-element", "parameter", "bitcast",
            "constant", "async-start", "async-done", "async-update"}
_ATTENTION_TARGET = re.compile(r"fmha|flash|attention", re.IGNORECASE)
_MATMUL_TARGET = re.compile(r"gemm|cublas|matmul|\$dot|triton", re.IGNORECASE)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def op_categories(hlo_text: str) -> dict[str, str | None]:
  """{HLO instruction name: one of CATEGORIES} for the instructions of an optimized program; None
  for loops, calls and tuples, whose spans cover their bodies' ops (which are named instead)."""
  comps, _ = hlo._module(hlo_text)
  has_dot: dict[str, bool] = {}

  def dot_inside(name: str, depth: int = 0) -> bool:
    if name not in has_dot:
      has_dot[name] = False  # a cycle (none in valid HLO) reads as no dot
      comp = comps.get(name)
      found = False
      for ins in (comp.instrs.values() if comp else ()):
        if ins.opcode in ("dot", "convolution"):
          found = True
        elif depth < 8:
          found = any(dot_inside(c, depth + 1) for c in _CALLS.findall(ins.raw))
        if found:
          break
      has_dot[name] = found
    return has_dot[name]

  out: dict[str, str] = {}
  for comp in comps.values():
    for ins in comp.instrs.values():
      if ins.opcode in _CONTROL:
        out[ins.name] = None
        continue
      target = _TARGET.search(ins.raw)
      target = target.group(1) if target else ""
      if target and _ATTENTION_TARGET.search(target):
        out[ins.name] = "attention"
      elif (ins.opcode in ("dot", "convolution") or (target and _MATMUL_TARGET.search(target))
            or any(dot_inside(c) for c in _CALLS.findall(ins.raw))):
        out[ins.name] = "matmul"
      else:
        m = _OP_NAME.search(ins.raw)
        in_loss = m is not None and ("jvp(" in m.group(1) or "transpose(" in m.group(1))
        out[ins.name] = "other" if in_loss or m is None else "optimizer"
  return out


def category_split(directory: str, steps: int, categories: dict[str, str | None],
                   module: str | None = None) -> dict | None:
  """Seconds per step of each of CATEGORIES (time covered by its ops, per device, averaged over
  devices; an instant where ops of several categories run counts once, for the first of
  CATEGORIES among them, so the categories add up to at most `busy_s`) and `busy_s` (covered by any
  op), from the newest trace under `directory`; ops of other programs than `module` (the step's
  HLO module name) are left out. None without op events."""
  path = _newest_trace(directory)
  if path is None:
    return None
  ranks = {c: i for i, c in enumerate(CATEGORIES)}
  spans: dict[Any, list] = {}
  for device, op, mod, span in _op_events(path):
    if module is not None and mod is not None and mod != module:
      continue
    # A loop's or call's span (category None) covers its body's ops: it ranks last, so it only
    # counts where none of its ops' events does.
    category = categories.get(op, "other")
    spans.setdefault(device, []).append((*span, len(CATEGORIES) if category is None
                                         else ranks[category]))
  if not spans:
    return None
  n = len(spans)
  shares = [_exclusive(p, len(CATEGORIES) + 1) for p in spans.values()]
  out = {c + "_s": sum(s[i] for s in shares) / n / steps * 1e-9 for i, c in enumerate(CATEGORIES)}
  out["busy_s"] = sum(sum(s) for s in shares) / n / steps * 1e-9
  out.update(devices=n, file=path)
  return out


def estimate_from_hlo(compiled: Any, trainer: Any, step_s: float) -> dict:
  """{'compute_s', 'collective_s'}: the measured step split in the ratio the compiled program
  predicts (FLOPs / peak against collective link bytes / link bandwidth)."""
  import jax
  mesh = trainer.mesh
  kind = next((k for k in devices.DEVICE_KINDS if k in jax.devices()[0].device_kind.lower()),
              "cpu")
  rates = devices.rates(kind, mesh.size)
  sent = sum(hlo.sent_bytes(compiled.as_text(), mesh.size).values())
  flops = trainer.model.flops_per_example * trainer.cfg.train.batch_size / mesh.size
  compute, comm = flops / rates.flops, sent / rates.link
  share = comm / (compute + comm) if compute + comm else 0.0
  return {"compute_s": step_s * (1 - share), "collective_s": step_s * share}
