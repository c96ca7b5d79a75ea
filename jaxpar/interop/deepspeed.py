"""DeepSpeed configs (ds_config.json) read as jaxpar overrides: `scripts/train.py --deepspeed FILE`.

`load(path, data_parallel)` maps the keys people write onto `--set`-style overrides, which the
script applies after --config and before the user's own --set (so those win). Its rules:

- a block that is absent, or a value of "auto" (Hugging Face's placeholder), leaves jaxpar's value;
- a key left out of a block that is present takes DeepSpeed's default (fp16 without a loss_scale
  is dynamically scaled; an optimizer without betas has (0.9, 0.999)), and the table says so; so
  does `gradient_clipping`, a top-level key whose absence DeepSpeed reads as 0, no clipping;
- the batch keys are completed as DeepSpeed's config does it; on a pipeline mesh (pipeline > 1)
  the accumulation steps are the pipeline's microbatches, as in DeepSpeed's pipeline engine;
- what cannot be honoured is named. A contradiction, or a request for a different optimizer or
  schedule family, is a ConfigError (the CLI's one sentence, exit 2); what only tunes how DeepSpeed
  runs (bucket sizes, overlap, logging) or where bytes live is a one-line warning; a key DeepSpeed
  does not have is a warning too.

DeepSpeed reads its file with hjson, so full-line `//` and `#` comments are accepted here as well.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh

AUTO = "auto"
DEFAULT = " (DeepSpeed default)"

# Why a key that DeepSpeed has does nothing here.
_COMM = "communication tuning; XLA schedules jaxpar's collectives"
_LOG = "DeepSpeed's logging; jaxpar logs every train.log_every steps and to --metrics-file"
_ENGINE = "a DeepSpeed engine setting with no jaxpar counterpart"
_MEMORY = "memory tuning of DeepSpeed's ZeRO; jaxpar's shardings are fixed by the ZeRO stage"

_TOP_IGNORED = {
    "steps_per_print": _LOG, "wall_clock_breakdown": _LOG, "dump_state": _LOG,
    "memory_breakdown": _LOG, "flops_profiler": _LOG, "tensorboard": _LOG, "wandb": _LOG,
    "csv_monitor": _LOG, "comet": _LOG, "comms_logger": _LOG, "timers": _LOG,
    "prescale_gradients": _COMM, "gradient_predivide_factor": _COMM,
    "communication_data_type": _COMM, "seq_parallel_communication_data_type": _COMM,
    "sparse_gradients": _COMM, "zero_allow_untested_optimizer": _ENGINE,
    "zero_force_ds_cpu_optimizer": _ENGINE, "data_types": _ENGINE, "aio": _ENGINE,
    "checkpoint": "DeepSpeed's checkpoint engine; jaxpar saves with orbax (checkpoint.every)",
    "autotuning": _ENGINE, "compile": _ENGINE, "elasticity": _ENGINE,
    "amp": "NVIDIA apex AMP; use the fp16 block",
}
_ZERO_IGNORED = {
    "contiguous_gradients": _MEMORY, "reduce_scatter": _COMM, "reduce_bucket_size": _COMM,
    "use_multi_rank_bucket_allreduce": _COMM, "allgather_partitions": _COMM,
    "allgather_bucket_size": _COMM, "overlap_comm": _COMM, "round_robin_gradients": _COMM,
    "load_from_fp32_weights": _ENGINE, "elastic_checkpoint": _ENGINE, "sub_group_size": _MEMORY,
    "cpu_offload_use_pin_memory": _MEMORY, "ignore_unused_parameters": _ENGINE,
    "legacy_stage1": _ENGINE, "zero_hpz_partition_size": _COMM, "zero_quantized_weights": _COMM,
    "zero_quantized_nontrainable_weights": _COMM, "zero_quantized_gradients": _COMM,
    "zeropp_loco_param": _COMM, "mics_shard_size": _COMM, "mics_hierarchical_params_gather": _COMM,
    "memory_efficient_linear": _MEMORY, "pipeline_loading_checkpoint": _ENGINE,
    "override_module_apply": _ENGINE, "log_trace_cache_warnings": _LOG,
    "enable_sanity_checks": _ENGINE, "leaf_module": _MEMORY,
}  # and every stage3_* key (_MEMORY)
_OFFLOAD_IGNORED = ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init",
                    "pipeline", "super_offload", "cpuadam_cores_perc")
_CKPT_IGNORED = ("contiguous_memory_optimization", "number_checkpoints",
                 "synchronize_checkpoint_boundary", "profile")
_OPTIMIZERS = ("adam", "adamw")
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclasses.dataclass
class Mapping:
  """What a DeepSpeed config asks of jaxpar: rows (DeepSpeed key, jaxpar key, value), warnings."""
  source: str
  rows: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
  warnings: list[str] = dataclasses.field(default_factory=list)

  @property
  def overrides(self) -> list[str]:
    """`--set` words, in the order the rows were made."""
    return [f"{key}={_text(value)}" for _, key, value in self.rows]

  def table(self, user_set: list[str] = ()) -> str:
    """One line per row, 'DeepSpeed key -> jaxpar key = value'; rows a `user_set` word
    (key=value) overrides say so."""
    mine = {w.split("=", 1)[0].strip(): w.split("=", 1)[1] for w in user_set if "=" in w}
    width = max([len(ds) for ds, _, _ in self.rows] + [12])
    lines = [f"{self.source} as jaxpar config (DeepSpeed key -> jaxpar key = value):"]
    for ds, key, value in self.rows:
      note = f"  (--set {key}={mine[key]} wins)" if key in mine else ""
      lines.append(f"  {ds:<{width}} -> {key} = {_text(value)}{note}")
    return "\n".join(lines)


def _text(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  return repr(value) if isinstance(value, float) else str(value)


def load(path: str, data_parallel: int, pipeline: int = 1) -> Mapping:
  """The mapping of the DeepSpeed config file at `path` for a mesh with `data_parallel` = data
  and `pipeline` stages."""
  if not os.path.isfile(path):
    raise ConfigError(f"DeepSpeed config {path} does not exist")
  with open(path) as f:
    text = "".join(l if not l.lstrip().startswith(("//", "#")) else "\n" for l in f)
  try:
    tree = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"DeepSpeed config {path} must hold a JSON object, got {type(tree).__name__}")
  return translate(tree, data_parallel, source=path, pipeline=pipeline)


def cli_overrides(path: str, mesh: str, user_set: list[str], show: bool = True) -> list[str]:
  """`--set` words for `scripts/train.py --deepspeed path --mesh mesh`, to go before the user's
  own; with `show`, prints the table (stdout) and one line per warning (stderr)."""
  import sys

  data, _, pipeline, _ = jmesh.parse(mesh)
  m = load(path, data, pipeline)
  if show:
    print(m.table(user_set), flush=True)
    for w in m.warnings:
      print(f"warning: deepspeed: {w}", file=sys.stderr, flush=True)
  return m.overrides


def translate(tree: dict, data_parallel: int, source: str = "DeepSpeed config",
              pipeline: int = 1) -> Mapping:
  """The mapping of a parsed DeepSpeed config (see the module's rules) for a mesh with
  `data_parallel` = data and `pipeline` stages."""
  m = Mapping(source)
  unknown: list[str] = []
  _batch(tree, data_parallel, pipeline, m)
  if "gradient_clipping" not in tree:  # DeepSpeed's default 0 turns clipping off
    m.rows.append(("gradient_clipping (DeepSpeed default: no clipping)", "train.clip_norm", 0.0))
  elif _given(tree, "gradient_clipping") is not None:
    m.rows.append(("gradient_clipping", "train.clip_norm",
                   _number("gradient_clipping", tree["gradient_clipping"])))
  _precision(tree, m, unknown)
  lr = _optimizer(tree.get("optimizer"), m, unknown)
  _scheduler(tree.get("scheduler"), lr, m, unknown)
  _zero(tree.get("zero_optimization"), m, unknown)
  _activation_checkpointing(tree.get("activation_checkpointing"), m, unknown)
  known = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
           "zero_optimization", "activation_checkpointing")
  for key, value in tree.items():
    if key in _TOP_IGNORED:
      _ignore(key, value, _TOP_IGNORED[key], m)
    elif key not in known:
      unknown.append(key)
  if unknown:
    m.warnings.append(f"not DeepSpeed keys jaxpar knows, ignored: {', '.join(unknown)}")
  return m


# -- helpers ---------------------------------------------------------------------------------------

def _given(block: dict, key: str) -> Any:
  """block[key], or None where it is absent or "auto"."""
  value = block.get(key)
  return None if value is None or value == AUTO else value


def _number(key: str, value: Any, integer: bool = False) -> float | int:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if integer:
    ok = ok and float(value).is_integer()
  if not ok or value < 0:
    kind = "a non-negative integer" if integer else "a non-negative number"
    raise ConfigError(f"DeepSpeed {key}={value!r} must be {kind}")
  return int(value) if integer else float(value)


def _ignore(key: str, value: Any, why: str, m: Mapping) -> None:
  """A one-line warning for a key that would change nothing here; none for `false` or "auto"."""
  if value in (False, None, AUTO):
    return
  m.warnings.append(f"{key}={json.dumps(value)} is not honoured ({why})")


def _block(tree: dict, key: str) -> dict:
  value = tree.get(key, {})
  if not isinstance(value, dict):
    raise ConfigError(f"DeepSpeed {key} must be an object, got {json.dumps(value)}")
  return value


def _check_keys(block: dict, prefix: str, known, unknown: list[str]) -> None:
  unknown += [f"{prefix}.{k}" for k in block if k not in known]


# -- blocks ----------------------------------------------------------------------------------------

def _batch(tree: dict, dp: int, pipeline: int, m: Mapping) -> None:
  """train_batch_size = micro x accumulation x data-parallel degree, derived as DeepSpeed's config
  does (runtime/config.py, _set_batch_related_parameters then _batch_assertion): a missing value
  is derived from the other two, a missing accumulation is 1 and the micro batch is never
  defaulted, so accumulation alone is refused. With a pipeline the accumulation steps are the
  pipeline's microbatches (DeepSpeed's PipelineEngine runs gradient_accumulation_steps
  microbatches per train_batch() and steps the optimizer once)."""
  keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
  total, micro, accum = (None if _given(tree, k) is None else _number(k, tree[k], integer=True)
                         for k in keys)
  for k, v in zip(keys, (total, micro, accum)):
    if v == 0:
      raise ConfigError(f"DeepSpeed {k}=0 must be positive")
  accum_name = keys[2]
  if accum is not None and total is None and micro is None and \
      not any(tree.get(k) == AUTO for k in keys[:2]):  # "auto": the batch is jaxpar's
    raise ConfigError(f"DeepSpeed gradient_accumulation_steps={accum} alone does not give the "
                      f"batch size: add train_batch_size or train_micro_batch_size_per_gpu "
                      f"(DeepSpeed refuses it too)")
  if total is not None and micro is not None:
    if accum is None:
      if total % (micro * dp):
        raise ConfigError(f"DeepSpeed train_batch_size={total} is not divisible by "
                          f"train_micro_batch_size_per_gpu={micro} x data-parallel degree {dp}")
      accum, accum_name = total // (micro * dp), accum_name + " (derived)"
    elif total != micro * accum * dp:
      raise ConfigError(f"DeepSpeed train_batch_size={total} is not train_micro_batch_size_per_gpu="
                        f"{micro} x gradient_accumulation_steps={accum} x data-parallel degree "
                        f"{dp} = {micro * accum * dp}")
  elif total is not None or micro is not None:
    if accum is None:
      accum, accum_name = 1, accum_name + DEFAULT
    if total is None:
      total = micro * accum * dp
    elif total % (accum * dp):
      raise ConfigError(f"DeepSpeed train_batch_size={total} is not divisible by "
                        f"gradient_accumulation_steps={accum} x data-parallel degree {dp}")
  if total is not None:
    name = keys[0] if _given(tree, keys[0]) is not None else \
        f"{keys[1]} x {keys[2]} x data {dp}"
    m.rows.append((name, "train.batch_size", total))
  if accum is None:
    return
  if pipeline > 1:
    m.rows.append((accum_name + " = pipeline microbatches", "parallel.microbatches", accum))
    m.rows.append((f"pipeline={pipeline}: one optimizer step per batch", "train.grad_accum", 1))
  else:
    m.rows.append((accum_name, "train.grad_accum", accum))


def _enabled(tree: dict, name: str) -> bool | None:
  """A precision block's `enabled`: None where the block is absent or "auto" (jaxpar's choice),
  else DeepSpeed's value, false where the present block leaves it out."""
  if name not in tree:
    return None
  value = _block(tree, name).get("enabled", False)
  if value == AUTO:
    return None
  # A string is refused, not read: DeepSpeed's older config took any non-empty string ("false"
  # too) as on, its pydantic config parses "true"/"false" as booleans.
  if not isinstance(value, bool):
    raise ConfigError(f"DeepSpeed {name}.enabled={json.dumps(value)} must be the JSON boolean "
                      f"true or false (or \"auto\")")
  return value


def _precision(tree: dict, m: Mapping, unknown: list[str]) -> None:
  fp16 = _block(tree, "fp16")
  bf16_name = "bf16" if "bf16" in tree else "bfloat16"
  bf16 = _block(tree, bf16_name)
  state16, statebf = _enabled(tree, "fp16"), _enabled(tree, bf16_name)
  on16, onbf = state16 is True, statebf is True
  if on16 and onbf:
    raise ConfigError("DeepSpeed fp16.enabled and bf16.enabled are both true; enable one")
  _check_keys(fp16, "fp16", ("enabled", "auto_cast", "loss_scale", "initial_scale_power",
                             "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                             "min_loss_scale", "fp16_master_weights_and_grads"), unknown)
  _check_keys(bf16, "bf16", ("enabled", "immediate_grad_update", "check_grad_overflow",
                             "bf16_master_weights_and_grads", "bf16_optimizer_states"), unknown)
  if onbf:
    m.rows.append(("bf16.enabled", "precision.compute_dtype", "bfloat16"))
    for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
      _ignore(f"bf16.{k}", bf16.get(k), "jaxpar keeps parameters and optimizer state in "
              "precision.param_dtype", m)
  # DeepSpeed trains in float32 unless a block enables half precision; jaxpar's own default
  # (auto) would be bfloat16 on a GPU. Absent or "auto" blocks leave jaxpar's choice.
  present = {k: (b, state) for k, b, state in (("fp16", fp16, state16), (bf16_name, bf16, statebf))
             if k in tree}
  if present and all(state is False for _, state in present.values()):
    off = [f"{k}.enabled" + ("" if "enabled" in b else DEFAULT) + "=false"
           for k, (b, _) in present.items()]
    m.rows.append((", ".join(off), "precision.compute_dtype", "float32"))
  if not on16:
    return
  m.rows.append(("fp16.enabled", "precision.compute_dtype", "float16"))

  def get(key, default):  # (value, how the table names it)
    v = _given(fp16, key)
    return (default, f"fp16.{key}{DEFAULT}") if v is None else (v, f"fp16.{key}")
  scale, name = get("loss_scale", 0)
  scale = _number("fp16.loss_scale", scale)
  if scale > 0:
    m.rows.append((name, "precision.loss_scale", scale))
    return
  m.rows.append((name + " = 0", "precision.loss_scale", "dynamic"))
  power, name = get("initial_scale_power", 16)
  m.rows.append((name, "precision.initial_scale", 2.0 ** _number(name, power, integer=True)))
  window, name = get("loss_scale_window", 1000)
  m.rows.append((name, "precision.growth_interval", _number(name, window, integer=True)))
  floor, name = get("min_loss_scale", 1)
  m.rows.append((name, "precision.min_scale", _number(name, floor)))
  hysteresis, _ = get("hysteresis", 2)
  if hysteresis != 1:
    m.warnings.append(f"fp16.hysteresis={hysteresis} is not honoured (jaxpar backs the scale off "
                      f"on every overflow, as hysteresis 1)")
  _ignore("fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis"),
          "jaxpar has no hysteresis", m)
  _ignore("fp16.auto_cast", fp16.get("auto_cast"), "jaxpar casts matmul inputs itself", m)
  _ignore("fp16.fp16_master_weights_and_grads", fp16.get("fp16_master_weights_and_grads"),
          "jaxpar keeps master weights in precision.param_dtype", m)


def _optimizer(opt: Any, m: Mapping, unknown: list[str]) -> float | None:
  """Rows for AdamW's hyperparameters; returns the optimizer's learning rate (None: jaxpar's)."""
  if opt is None:
    return None
  opt = _block({"optimizer": opt}, "optimizer")
  kind = opt.get("type")
  # "auto" is refused too: Hugging Face fills only the optimizer's params, and DeepSpeed has no
  # optimizer of that name
  if not isinstance(kind, str) or kind.lower() not in _OPTIMIZERS:
    said = "is missing" if kind is None else f"={kind!r} is not available"
    raise ConfigError(f"DeepSpeed optimizer.type{' ' * (kind is None)}{said}: jaxpar trains with "
                      f"AdamW (DeepSpeed types Adam, AdamW)")
  _check_keys(opt, "optimizer", ("type", "params"), unknown)
  p = _block(opt, "params")
  _check_keys(p, "optimizer.params", ("lr", "betas", "eps", "weight_decay", "adam_w_mode",
                                      "torch_adam", "bias_correction", "amsgrad", "fused"), unknown)
  decay = _given(p, "weight_decay")
  if p.get("adam_w_mode") is False and kind.lower() == "adam" and decay:
    raise ConfigError("DeepSpeed optimizer.params.adam_w_mode=false (Adam with L2 weight decay) "
                      "is not available: jaxpar's AdamW decays weights decoupled")
  for key, wanted in (("bias_correction", True), ("amsgrad", False)):
    if key in p and p[key] is not wanted:
      raise ConfigError(f"DeepSpeed optimizer.params.{key}={_text(p[key])} is not available in "
                        f"jaxpar's AdamW")
  for key in ("torch_adam", "fused"):
    _ignore(f"optimizer.params.{key}", p.get(key), "an implementation choice of DeepSpeed's Adam", m)
  lr = _given(p, "lr")
  lr = 1e-3 if lr is None and "lr" not in p else lr  # FusedAdam's default; "auto": jaxpar's
  betas = _given(p, "betas")
  if "betas" not in p:
    betas = (0.9, 0.999)
  if betas is not None:
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
      raise ConfigError(f"DeepSpeed optimizer.params.betas={json.dumps(betas)} must be [b1, b2]")
    name = "optimizer.params.betas" + ("" if "betas" in p else DEFAULT)
    m.rows.append((name + "[0]", "train.b1", _number("optimizer.params.betas", betas[0])))
    m.rows.append((name + "[1]", "train.b2", _number("optimizer.params.betas", betas[1])))
  if decay is not None or "weight_decay" not in p:
    name = "optimizer.params.weight_decay" + ("" if "weight_decay" in p else DEFAULT)
    m.rows.append((name, "train.weight_decay", _number(name, decay or 0.0)))
  eps = _given(p, "eps")
  if eps is not None and _number("optimizer.params.eps", eps) != 1e-8:
    m.warnings.append(f"optimizer.params.eps={eps} is not honoured (jaxpar's AdamW uses eps=1e-8)")
  if lr is not None:
    lr = _number("optimizer.params.lr", lr)
    m.rows.append(("optimizer.params.lr" + ("" if "lr" in p else DEFAULT), "train.lr", lr))
  return lr


def _scheduler(sched: Any, opt_lr: float | None, m: Mapping, unknown: list[str]) -> None:
  """WarmupLR / WarmupDecayLR / WarmupCosineLR as jaxpar's linear warmup + cosine decay."""
  if sched is None:
    return
  sched = _block({"scheduler": sched}, "scheduler")
  kind = _given(sched, "type")
  if kind not in _SCHEDULERS:
    raise ConfigError(f"DeepSpeed scheduler.type={kind!r} is not available: jaxpar's schedule is "
                      f"warmup then cosine decay (DeepSpeed types {', '.join(_SCHEDULERS)})")
  _check_keys(sched, "scheduler", ("type", "params"), unknown)
  p = _block(sched, "params")
  cosine = kind == "WarmupCosineLR"  # its rates are ratios of the optimizer's
  known = {"warmup_num_steps", "warmup_type", "last_batch_iteration", "total_num_steps"}
  known |= {"warmup_min_ratio", "cos_min_ratio"} if cosine else {"warmup_min_lr", "warmup_max_lr"}
  _check_keys(p, "scheduler.params", known, unknown)

  def get(key, default):  # (value, None for "auto"; how the table names it)
    name = f"scheduler.params.{key}"
    if key not in p:
      return default, name + DEFAULT
    value = _given(p, key)
    return (None if value is None else _number(name, value)), name
  if cosine:
    floor, floor_name = get("cos_min_ratio", 0.0001)
    start, start_name = get("warmup_min_ratio", 0.0)
  else:
    # Both schedulers' peak defaults to 0.001 (lr_schedules.py), whatever the optimizer's rate:
    # DeepSpeed's schedulers set the rate, so a peak replaces the optimizer's; "auto" keeps it.
    peak, peak_name = get("warmup_max_lr", 0.001)
    if peak is not None:
      if opt_lr is not None and opt_lr != peak:
        m.warnings.append(f"optimizer.params.lr={opt_lr} is replaced by {peak_name}={peak}, "
                          f"as in DeepSpeed")
      m.rows[:] = [r for r in m.rows if r[1] != "train.lr"] + [(peak_name, "train.lr", peak)]
    peak = opt_lr if peak is None else peak
    start, start_name = get("warmup_min_lr", 0.0)
    if kind == "WarmupLR":
      floor, floor_name = 1.0, "scheduler.type=WarmupLR (constant after warmup)"
    else:  # decays to warmup_min_lr
      floor = start / peak if start is not None and peak else None
      floor_name = "scheduler.params.warmup_min_lr / warmup_max_lr"
  steps, name = get("warmup_num_steps", 1000)
  if steps is not None:
    m.rows.append((name, "train.warmup_steps", _number(name, steps, integer=True)))
  if kind != "WarmupLR":
    total, name = get("total_num_steps", None)
    if total is not None:
      m.rows.append((name, "train.steps", _number(name, total, integer=True)))
  if floor is not None:
    m.rows.append((floor_name, "train.min_lr_ratio", floor))
  if start:
    m.warnings.append(f"{start_name}={start} as the warmup's start is not honoured (jaxpar "
                      f"warms up from 0)")
  if p.get("warmup_type", "log") == "log":
    m.warnings.append("scheduler.params.warmup_type=log (DeepSpeed's default) is not honoured "
                      "(jaxpar warms up linearly)")
  if kind == "WarmupDecayLR":
    m.warnings.append("scheduler.type=WarmupDecayLR decays linearly; jaxpar decays by a cosine "
                      "to the same floor at the same step")


def _zero(zero: Any, m: Mapping, unknown: list[str]) -> None:
  if zero is None:
    return
  if isinstance(zero, bool):  # DeepSpeed's old spelling: true = stage 1
    m.rows.append(("zero_optimization", "parallel.zero_stage", int(zero)))
    return
  zero = _block({"zero_optimization": zero}, "zero_optimization")
  stage = _given(zero, "stage")
  if stage is not None:
    if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
      raise ConfigError(f"DeepSpeed zero_optimization.stage={stage!r} is not a ZeRO stage "
                        f"(0, 1, 2 or 3)")
    m.rows.append(("zero_optimization.stage", "parallel.zero_stage", stage))
  off = zero.get("offload_optimizer")
  if zero.get("cpu_offload") is True and off is None:  # the deprecated spelling
    off = {"device": "cpu"}
  if off is not None:
    off = _block({"zero_optimization.offload_optimizer": off}, "zero_optimization.offload_optimizer")
    _check_keys(off, "zero_optimization.offload_optimizer",
                ("device", "pin_memory", "ratio") + _OFFLOAD_IGNORED, unknown)
    device = _given(off, "device") or "none"
    if device not in ("none", "cpu", "nvme"):
      raise ConfigError(f"DeepSpeed zero_optimization.offload_optimizer.device={device!r} is not "
                        f"one of none, cpu, nvme")
    if device == "nvme":
      m.warnings.append("zero_optimization.offload_optimizer.device=nvme is not honoured "
                        "(jaxpar offloads to pinned host memory instead)")
    m.rows.append(("zero_optimization.offload_optimizer.device", "parallel.offload_optimizer",
                   device != "none"))
    if device != "none":
      if off.get("pin_memory") is False:
        m.warnings.append("zero_optimization.offload_optimizer.pin_memory=false is not honoured "
                          "(jaxpar's offload uses pinned host memory)")
      ratio = _given(off, "ratio")
      if ratio is not None and ratio != 1:
        m.warnings.append(f"zero_optimization.offload_optimizer.ratio={ratio} is not honoured "
                          f"(jaxpar offloads all of the optimizer state)")
      for k in _OFFLOAD_IGNORED:
        _ignore(f"zero_optimization.offload_optimizer.{k}", off.get(k), _MEMORY, m)
  param = zero.get("offload_param") or ({"device": "cpu"} if zero.get("cpu_offload_param") else None)
  if isinstance(param, dict) and (_given(param, "device") or "none") != "none":
    m.warnings.append(f"zero_optimization.offload_param.device={param['device']} is not honoured "
                      f"(parameters stay in device memory; jaxpar offloads optimizer state only)")
  known = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param"}
  for k, v in zero.items():
    if k in _ZERO_IGNORED or k.startswith("stage3_"):
      _ignore(f"zero_optimization.{k}", v, _ZERO_IGNORED.get(k, _MEMORY), m)
    elif k not in known:
      unknown.append(f"zero_optimization.{k}")


def _activation_checkpointing(ac: Any, m: Mapping, unknown: list[str]) -> None:
  """The block's presence asks for rematerialised layers (parallel.remat)."""
  if ac is None:
    return
  ac = _block({"activation_checkpointing": ac}, "activation_checkpointing")
  m.rows.append(("activation_checkpointing", "parallel.remat", True))
  _ignore("activation_checkpointing.partition_activations", ac.get("partition_activations"),
          "jaxpar keeps each layer's input as the model's shardings place it", m)
  _ignore("activation_checkpointing.cpu_checkpointing", ac.get("cpu_checkpointing"),
          "checkpointed activations stay in device memory", m)
  for k in _CKPT_IGNORED:
    _ignore(f"activation_checkpointing.{k}", ac.get(k), _MEMORY, m)
  _check_keys(ac, "activation_checkpointing",
              ("partition_activations", "cpu_checkpointing") + _CKPT_IGNORED, unknown)
