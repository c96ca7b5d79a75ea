"""Choosing a layout: which DxMxP[xC] mesh, ZeRO stage and pipeline schedule to train on N devices.

`auto` enumerates every layout the model's shapes allow (mesh.check), compiles each on simulated
devices through plan.plan, rejects those whose peak bytes per device exceed the memory budget and
ranks the rest by predicted step time. A decoder whose sequence is long (CONTEXT_MIN_SEQ on) is
also tried with the sequence split over a context axis C > 1 (ring attention; under a pipeline,
its all-gather form):

  step = model FLOPs per device / device FLOP/s / (1 - bubble) + link bytes / link bandwidth

Compute and communication are added, not overlapped, for every layout alike. FLOPs are the model's
analytic training FLOPs split evenly over the devices (XLA's cost analysis counts a loop body
once). Link bytes are what one device sends under ring algorithms, from the compiled program's
collective result bytes: an all-reduce sends about twice its result (a reduce-scatter, then an
all-gather), a reduce-scatter (data - 1) times its result (jaxpar reduce-scatters gradients over
`data` only), the other kinds about their result.

`estimate` is the same prediction without compiling: the ZeRO paper's model-state bytes (params +
grads + optimizer state, split by stage) and analytic collective bytes. It orders the compiles, so
a search stopped early has compiled the layouts predicted fastest, and it is the whole of
`--analytic`, for models too large to compile here (activations are not counted there).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

from jaxpar import config as jconfig
from jaxpar import kinds
from jaxpar.analysis.devices import DEVICE_KINDS, Rates, rates  # noqa: F401 (the planner's rates)
from jaxpar.config import Config, ConfigError
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import pipeline
from jaxpar.planning import plan

SCHEDULES = ("gpipe", "1f1b", "circular")
# From this sequence length on, the search also tries context axes C > 1: attention's activations
# then dominate a decoder's step, and ring attention splits them (and the tokens) C ways.
CONTEXT_MIN_SEQ = 2048


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to run the step: a mesh, a ZeRO stage and, with pipeline > 1, a schedule."""
  mesh: tuple[int, ...]  # (data, model, pipeline) or, with a context axis, (d, m, p, context)
  zero_stage: int
  schedule: str = ""  # "" without a pipeline
  microbatches: int = 1
  virtual_stages: int = 1

  def __str__(self) -> str:
    text = f"{jmesh.spec_str(self.mesh)} ZeRO-{self.zero_stage}"
    if self.schedule:
      v = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
      text += f" {self.schedule}{v} M={self.microbatches}"
    return text

  def apply(self, cfg: Config) -> Config:
    """`cfg` with this layout's parallel settings (the rest of the config as it was)."""
    par = {"zero_stage": self.zero_stage, "virtual_stages": self.virtual_stages}
    if self.schedule:
      par.update(schedule=self.schedule, microbatches=self.microbatches)
    return jconfig.override(cfg, parallel=par)


def factorisations(n: int, contexts: Sequence[int] = (1,)) -> list[tuple[int, ...]]:
  """Every (data, model, pipeline) with data * model * pipeline = n, data-major; then, for each
  context c > 1 in `contexts` that divides n, every (d, m, p, c) with d * m * p * c = n."""
  def three(k: int) -> list[tuple[int, int, int]]:
    return [(d, m, k // (d * m)) for d in range(k, 0, -1) if k % d == 0
            for m in range(1, k // d + 1) if (k // d) % m == 0]
  out: list[tuple[int, ...]] = list(three(n))
  for c in contexts:
    if c > 1 and n % c == 0:
      out += [(*dmp, c) for dmp in three(n // c)]
  return out


def context_degrees(cfg: Config, n: int) -> list[int]:
  """The context axes the search tries: 1, and for a decoder from CONTEXT_MIN_SEQ tokens on every
  divisor of n above 1."""
  if not kinds.get(cfg.model.kind).decoder or cfg.model.seq_len < CONTEXT_MIN_SEQ:
    return [1]
  return [c for c in range(1, n + 1) if n % c == 0]


def layouts(cfg: Config, n: int) -> tuple[list[Layout], list[str]]:
  """(layouts the model's shapes allow on n devices, one sentence per mesh or choice ruled out).

  ZeRO stages 0-3 when data > 1 (they shard over `data`; with one data shard all are stage 0);
  with pipeline P > 1 each schedule with P and 2P microbatches, circular with 2 virtual stages.
  """
  out, ruled_out = [], []
  for shape in factorisations(n, context_degrees(cfg, n)):
    d, m, p = shape[:3]
    pipes = [("", 1, 1)] if p == 1 else [(s, k * p, 2 if s == "circular" else 1)
                                         for s in SCHEDULES for k in (1, 2)]
    allowed, errors = [], []
    for sched, micro, v in pipes:  # the ZeRO stage changes none of these checks
      lay = Layout(shape, 0, sched, micro, v)
      try:
        jmesh.check(shape, lay.apply(cfg), n)
        if sched:
          pipeline.build(sched, p, micro, v)
      except ConfigError as e:
        errors.append((f"{jmesh.spec_str(shape)} {sched} M={micro}: " if sched else "", str(e)))
        continue
      allowed.append((sched, micro, v))
    # A mesh no choice fits is one sentence; otherwise the schedule-specific refusals.
    ruled_out.extend([errors[0][1]] if not allowed else [a + b for a, b in errors])
    out += [Layout(shape, stage, *a) for stage in (range(4) if d > 1 else (0,)) for a in allowed]
  if not out:
    shown = "; ".join(ruled_out[:3]) + (f"; and {len(ruled_out) - 3} more" if len(ruled_out) > 3
                                          else "")
    raise ConfigError(f"no layout of this model runs on {n} devices: every mesh is ruled out "
                      f"({shown})")
  return out, ruled_out


# -- predictions -----------------------------------------------------------------------------------

def state_bytes_per_param(cfg: Config) -> tuple[int, int, int]:
  """(param, grad, optimizer-state) bytes per parameter of jaxpar's AdamW: grads and both moments
  take the parameter dtype."""
  b = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.precision.param_dtype]
  return b, b, 2 * b


def model_state_bytes(n_params: float, data: int, stage: int, bytes_param: float,
                      bytes_grad: float, bytes_opt: float, shards: int = 1) -> float:
  """Per-device params + grads + optimizer state under ZeRO `stage` over `data` devices (the ZeRO
  paper's accounting); `shards` = model x pipeline degree, which splits all three first."""
  per = n_params / shards
  return per * (bytes_param / (data if stage >= 3 else 1) + bytes_grad / (data if stage >= 2 else 1)
                + bytes_opt / (data if stage >= 1 else 1))


def zero_table(n_params: float, n: int, bytes_param: float, bytes_grad: float,
               bytes_opt: float) -> list[float]:
  """Model-state bytes per device for ZeRO stages 0-3, data parallel over n devices."""
  return [model_state_bytes(n_params, n, s, bytes_param, bytes_grad, bytes_opt) for s in range(4)]


def for_device(cfg: Config, kind: str) -> Config:
  """`cfg` as it would run on `kind`: compute_dtype auto means bfloat16 on a GPU."""
  if kind != "cpu" and cfg.precision.compute_dtype == "auto":
    return jconfig.override(cfg, precision={"compute_dtype": "bfloat16"})
  return cfg


def _compute_dtype_bytes(cfg: Config) -> int:
  name = cfg.precision.compute_dtype
  return 4 if name in ("auto", "float32") else 2


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What the predictions need from the model: parameter count and training FLOPs per step, and
  the parameters of a mixture's experts (split over `data`, not reduced over it)."""
  n_params: float
  flops_per_step: float
  expert_params: float = 0.0

  @staticmethod
  def of(cfg: Config, n_params: float | None = None) -> ModelFacts:
    """From the model `cfg` builds (abstract shapes only); `n_params` overrides its count, and
    then the FLOPs are 6 N per token (plus the attention term of DESIGN's definition)."""
    import jax
    model = plan._model(cfg)
    count = sum(math.prod(a.shape) for a in jax.tree_util.tree_leaves(model.abstract))
    axes = jax.tree_util.tree_leaves(model.logical, is_leaf=lambda x: isinstance(x, tuple))
    experts = sum(math.prod(a.shape) for a, ax in zip(jax.tree_util.tree_leaves(model.abstract),
                                                      axes) if "expert" in ax)
    flops = model.flops_per_example * cfg.train.batch_size
    if n_params is not None:
      mc = cfg.model
      tokens = mc.seq_len * cfg.train.batch_size
      attention = 12 * mc.n_layers * mc.n_heads * mc.head_width() * mc.seq_len  # H K, not D
      attention = attention if mc.kind != "cnn" else 0
      count, flops, experts = n_params, (6 * n_params + attention) * tokens, 0
    return ModelFacts(float(count), float(flops), float(experts))


def _bubble(lay: Layout) -> tuple[float, int]:
  """(bubble fraction, ticks) of the layout's executed schedule; (0, 0) without a pipeline."""
  if not lay.schedule:
    return 0.0, 0
  sched = pipeline.build(lay.schedule, lay.mesh[2], lay.microbatches, lay.virtual_stages)
  return sched.bubble_fraction, sched.ticks


def _times(flops_per_step: float, n: int, sent: float, bubble: float, r: Rates) -> dict:
  compute = flops_per_step / n / r.flops / (1.0 - bubble)
  comm = sent / r.link
  return {"compute_s": compute, "collective_s": comm, "step_s": compute + comm}


def estimate(cfg: Config, lay: Layout, facts: ModelFacts, r: Rates,
             state: tuple[float, float, float] | None = None) -> dict:
  """The analytic prediction for one layout: model-state bytes, link bytes and step time."""
  d, m, p, c = jmesh.normalize(lay.mesh)
  bp, bg, bo = state or state_bytes_per_param(cfg)
  shard = (facts.n_params - facts.expert_params) / (m * p)  # the experts stay split over data
  sent = 0.0
  if d > 1:
    ring = (d - 1) / d
    sent += (2 if lay.zero_stage <= 1 else 1) * ring * shard * bg  # all-reduce / reduce-scatter
    sent += {1: 1, 2: 1, 3: 2}.get(lay.zero_stage, 0) * ring * shard * bp  # parameter all-gathers
  bubble, ticks = _bubble(lay)
  mc = cfg.model
  if mc.kind != "cnn":
    act = cfg.train.batch_size / d * mc.seq_len / c * mc.d_model * _compute_dtype_bytes(cfg)
    if mc.n_experts and d > 1:  # parallel/expert.py, per MoE layer: rows out and back in the fwd
      # and their transposes in the backward (a recomputed forward would add two); a buffer holds
      # d x every row of the device (dropless), each device of `model` sending 1/m of its width
      # (expert.width_axis; not inside a pipeline's or a context axis' shard_map)
      width = m if p == 1 and c == 1 and mc.d_model % m == 0 else 1
      sent += 4 * mc.mixture_layers() * (d - 1) / d * d * act * mc.experts_per_token / width
    if c > 1:  # models/ring.py, per layer of the device's stage: the K/V ring sends (6c - 4) x
      # one device's k chunk; under a pipeline its all-gather form, 6 (c - 1) x
      kv = act / mc.d_model * (mc.n_kv_heads or mc.n_heads) * mc.head_width() / m
      sent += mc.n_layers / p * (6 * (c - 1) if p > 1 else 6 * c - 4) * kv
    if m > 1:  # Megatron: two all-reduces forward and two backward per layer
      sent += 4 * (mc.n_layers / p) * 2 * (m - 1) / m * act
    if p > 1:  # the executor sends one activation and one cotangent per tick
      sent += 2 * ticks * act / lay.microbatches
  row = _row(lay, "analytic")
  row.update(memory_bytes=model_state_bytes(facts.n_params, d, lay.zero_stage, bp, bg, bo, m * p),
             link_bytes=sent, bubble=bubble,
             **_times(facts.flops_per_step, d * m * p * c, sent, bubble, r))
  return row


def evaluate(cfg: Config, lay: Layout, facts: ModelFacts, r: Rates, devices: Sequence[Any]) -> dict:
  """The compiled prediction for one layout: plan.plan's peak bytes and collectives."""
  report = plan.plan(lay.apply(cfg), lay.mesh, devices)
  n = math.prod(lay.mesh)
  coll = report["collectives"]
  sent = sum(report["sent_bytes"].values())  # ring algorithms, as `estimate` counts them
  bubble = report["pipeline"]["bubble_fraction"] if report["pipeline"] else 0.0
  row = _row(lay, "compiled")
  row.update(memory_bytes=report["compiled"]["peak_bytes"], collective_bytes=sum(coll.values()),
             collectives=coll, link_bytes=sent, bubble=bubble,
             model_state_bytes=sum(report["bytes_per_device"].values()),
             **_times(facts.flops_per_step, n, sent, bubble, r))
  if report["experts"]:  # a mixture: its experts' bytes on one device, from the program
    row["experts"] = report["experts"]
  return row


def _row(lay: Layout, source: str) -> dict:
  return {"layout": str(lay), "mesh": jmesh.spec_str(lay.mesh), "zero_stage": lay.zero_stage,
          "schedule": lay.schedule or None, "microbatches": lay.microbatches if lay.schedule else None,
          "virtual_stages": lay.virtual_stages, "source": source}


# -- ranking ---------------------------------------------------------------------------------------

TIE = 1.0001  # predicted step times this close are one prediction (a few bytes of loss reduction)


def rank(rows: list[dict], budget: float) -> tuple[list[dict], list[dict]]:
  """(rows within `budget` bytes per device, fastest first, with reasons; the rows over it)."""
  by_step = sorted((r for r in rows if r["memory_bytes"] <= budget), key=lambda r: r["step_s"])
  fit, group = [], []  # predictions within TIE of each other: the one with less memory first
  for r in by_step + [None]:
    if r is None or (group and r["step_s"] > group[0]["step_s"] * TIE):
      fit += sorted(group, key=lambda g: g["memory_bytes"])
      group = []
    if r is not None:
      group.append(r)
  over = [r for r in rows if r["memory_bytes"] > budget]
  for i, row in enumerate(fit):
    row["rank"] = i + 1
    row["why"] = _why(row, fit, budget, i)
  return fit, over


def _why(row: dict, fit: list[dict], budget: float, i: int) -> str:
  """What sets this layout apart among those that fit, then how it fits."""
  parts = []
  if i == 0:
    parts.append("fastest predicted step")
  elif row["step_s"] <= fit[0]["step_s"] * TIE:
    parts.append("ties the fastest, holds more memory")
  least_sent = min(r["link_bytes"] for r in fit)
  least_flat = min((r["link_bytes"] for r in fit if not r["bubble"]), default=None)
  if row["link_bytes"] <= least_sent:
    parts.append("least collective bytes" + ("" if least_sent else " (none)"))
  elif not row["bubble"] and row["link_bytes"] <= least_flat:
    parts.append("least collective bytes of the layouts without a pipeline bubble")
  elif row["link_bytes"] <= 1.1 * least_sent:
    parts.append("collective bytes within 10% of the least")
  if row["memory_bytes"] <= min(r["memory_bytes"] for r in fit):
    parts.append("least memory")
  elif i and row["memory_bytes"] < min(r["memory_bytes"] for r in fit[:i]):
    parts.append("less memory than every faster layout")
  if row["bubble"]:
    parts.append(f"bubble {row['bubble']:.0%}")
  share = row["collective_s"] / row["step_s"] if row["step_s"] else 0.0
  parts.append(f"collectives {100 * share:.2g}% of its step")
  what = "peak" if row["source"] == "compiled" else "model state"
  parts.append(f"fits with ZeRO-{row['zero_stage']} at {_bytes(row['memory_bytes'])} {what} "
               f"of {_bytes(budget)}")
  return "; ".join(parts)


def _bytes(b: float) -> str:
  for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
    if abs(b) >= scale:
      return f"{b / scale:.3g} {unit}"
  return f"{b:.0f} B"


def _ms(s: float) -> str:
  return f"{s:.4g} s" if s >= 10 else f"{s * 1e3:.4g} ms"


# -- the two modes ---------------------------------------------------------------------------------

def auto(cfg: Config, n: int, r: Rates, budget: float, devices: Sequence[Any] | None = None,
         max_candidates: int | None = None, time_limit: float | None = None,
         log: Callable[[str], None] = lambda s: None) -> dict:
  """Compiles the layouts of `cfg` on n devices, fastest analytic prediction first, and ranks them.

  Stops after `max_candidates` compiles or once `time_limit` seconds have passed; the result then
  says how many were left out. Rows over `budget` bytes per device are rejected.
  """
  import jax
  t0 = time.perf_counter()
  cfg = for_device(cfg, r.kind)
  devices = list(jax.devices() if devices is None else devices)[:n]
  facts = ModelFacts.of(cfg)
  lays, ruled_out = layouts(cfg, n)
  order = sorted(lays, key=lambda lay: estimate(cfg, lay, facts, r)["step_s"])
  rows, failed, stopped = [], [], None
  for k, lay in enumerate(order):
    if max_candidates is not None and k >= max_candidates:
      stopped = f"--max-candidates {max_candidates}"
      break
    if time_limit is not None and time.perf_counter() - t0 > time_limit:
      stopped = f"--time-limit {time_limit:g} s"
      break
    t1 = time.perf_counter()
    try:
      row = evaluate(cfg, lay, facts, r, devices)
    except Exception as e:  # a layout the rules or XLA refuse is reported; the survey goes on
      failed.append(f"{lay}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
      log(f"[{k + 1}/{len(order)}] not compiled: {failed[-1]}")
      continue
    finally:
      jax.clear_caches()  # one compiled program at a time in memory
    rows.append(row)
    log(f"[{k + 1}/{len(order)}] {lay}: peak {_bytes(row['memory_bytes'])}, predicted "
        f"{_ms(row['step_s'])} ({time.perf_counter() - t1:.1f} s to compile)")
  fit, over = rank(rows, budget)
  return {"mode": "auto", "devices": n, "device": dataclasses.asdict(r), "budget_bytes": budget,
          "layouts": len(lays), "ruled_out": ruled_out, "compiled": len(rows), "failed": failed,
          "stopped_early": stopped, "seconds": time.perf_counter() - t0,
          "ranked": fit, "over_budget": over}


def analytic(cfg: Config, n: int, r: Rates, budget: float, n_params: float | None = None,
             state: tuple[float, float, float] | None = None) -> dict:
  """Every layout by the analytic prediction alone (nothing compiles), and the ZeRO table."""
  cfg = for_device(cfg, r.kind)
  facts = ModelFacts.of(cfg, n_params)
  state = state or state_bytes_per_param(cfg)
  lays, ruled_out = layouts(cfg, n)
  fit, over = rank([estimate(cfg, lay, facts, r, state) for lay in lays], budget)
  return {"mode": "analytic", "devices": n, "device": dataclasses.asdict(r), "budget_bytes": budget,
          "n_params": facts.n_params, "state_bytes_per_param": list(state),
          "zero_model_state_bytes": zero_table(facts.n_params, n, *state),
          "layouts": len(lays), "ruled_out": ruled_out, "ranked": fit, "over_budget": over}


def format_result(res: dict, top: int = 5) -> str:
  """The ranking as text: rates used, what was enumerated and compiled, the top rows and why."""
  dev = res["device"]
  lines = [f"{res['devices']} {dev['kind']} devices: {_human_rate(dev['flops'])} and "
           f"{_bytes(dev['link'])}/s link each ({dev['source']}); memory budget "
           f"{_bytes(res['budget_bytes'])} per device"]
  if res["mode"] == "analytic":
    bp, bg, bo = res["state_bytes_per_param"]
    lines.append(f"model states per device, data parallel over {res['devices']} devices, "
                 f"{res['n_params']:.4g} parameters x ({bp:g} + {bg:g} + {bo:g}) bytes "
                 "(params + grads + optimizer state):")
    for stage, b in enumerate(res["zero_model_state_bytes"]):
      lines.append(f"  ZeRO-{stage}: {_bytes(b)}")
  out = res["ruled_out"]
  lines.append(f"{res['layouts']} layouts the model's shapes allow; {len(out)} meshes or "
               f"schedules ruled out" + (":" if out else ""))
  lines += [f"  {why}" for why in out[:3]]
  if len(out) > 3:
    lines.append(f"  ... and {len(out) - 3} more (--json lists them all)")
  if res["mode"] == "auto":
    lines.append(f"compiled {res['compiled']} in {res['seconds']:.0f} s"
                 f"; {len(res['over_budget'])} over the memory budget")
    lines += [f"  failed to compile: {why}" for why in res.get("failed", [])]
    if res["stopped_early"]:
      tried = res["compiled"] + len(res.get("failed", []))
      lines.append(f"STOPPED EARLY ({res['stopped_early']}): compiled {tried} of "
                   f"{res['layouts']} layouts, in order of analytic predicted step time; the other "
                   f"{res['layouts'] - tried} were predicted slower and are not ranked")
  else:
    lines.append("analytic: memory is model state only (no activations); nothing compiled; "
                 f"{len(res['over_budget'])} over the memory budget")
  ranked = res["ranked"][:top]
  if not ranked:
    least = min(res["over_budget"], key=lambda r: r["memory_bytes"], default=None)
    lines.append("no layout fits the memory budget" + (
        f"; the least memory is {least['layout']}'s {_bytes(least['memory_bytes'])} per device"
        if least else ""))
    return "\n".join(lines)
  lines.append("")
  head = ("#", "layout", "step", "compute", "collectives", "memory")
  rows = [(str(r["rank"]), r["layout"], _ms(r["step_s"]), _ms(r["compute_s"]),
           _ms(r["collective_s"]), _bytes(r["memory_bytes"])) for r in ranked]
  widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
  fmt = lambda x: "  ".join(c.ljust(w) for c, w in zip(x, widths))
  lines.append(fmt(head))
  for x, r in zip(rows, ranked):
    lines.append(fmt(x))
    lines.append(" " * (widths[0] + 2) + "why: " + r["why"])
    if r.get("experts"):
      ex = r["experts"]
      lines.append(" " * (widths[0] + 2) + f"experts: {ex['per_device']} of {ex['n_experts']} "
                   f"per device, weights {_bytes(ex['weights_bytes'] or 0)}, dispatch buffer "
                   f"{_bytes(ex['dispatch_buffer_bytes'])}, all-to-all "
                   f"{_bytes(ex['all_to_all_bytes'])} per step")
  return "\n".join(lines)


def _human_rate(f: float) -> str:
  return f"{f / 1e12:.4g} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.4g} GFLOP/s"
