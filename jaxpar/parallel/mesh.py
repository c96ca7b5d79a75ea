"""`"2x4x1"` -> `Mesh(data, model, pipeline)`, with every degree checked once, up front."""
from __future__ import annotations

import os
import re

from jaxpar import kinds
from jaxpar.config import Config, ConfigError, microbatches

AXES = ("data", "model", "pipeline")  # the mesh's axes, outermost first: their one definition
DATA, MODEL, PIPE = AXES


def parse(spec: str) -> tuple[int, int, int]:
  """'2x4x1' -> (2, 4, 1); anything else is a ConfigError naming the value."""
  m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", spec or "")
  if not m or min(int(g) for g in m.groups()) < 1:
    raise ConfigError(f"mesh {spec!r} is not of the form DxMxP with positive integers "
                      f"(data x model x pipeline), e.g. 2x4x1")
  return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def ensure_cpu_devices(n: int) -> bool:
  """Asks XLA for `n` simulated CPU devices; must run before JAX starts. True if it set the flag.

  Only when the user has not fixed the count and no accelerator platform was requested.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in flags:
    return False
  if os.environ.get("JAX_PLATFORMS", "cpu") not in ("cpu", ""):
    return False
  try:  # a GPU build of jaxlib means real devices: never simulate over them
    import importlib.util
    if importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec("jax_cuda13_plugin"):
      return False
  except (ImportError, ValueError):
    pass
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  return True


def check(shape: tuple[int, int, int], cfg: Config, n_devices: int) -> None:
  """Every degree against the devices and the model, one message naming all of them."""
  d, m, p = shape
  named = f"data={d}, model={m}, pipeline={p}"
  if d * m * p != n_devices:
    raise ConfigError(f"mesh {d}x{m}x{p} needs {d * m * p} devices, found {n_devices} ({named})")
  problems = []
  mc, tc, pc = cfg.model, cfg.train, cfg.parallel
  micro = tc.batch_size // tc.grad_accum
  if micro % d:
    problems.append(f"train.batch_size/train.grad_accum={micro} is not divisible by data={d}")
  decoder = kinds.get(mc.kind).decoder
  if decoder:
    kv = mc.n_kv_heads or mc.n_heads
    for name, value in (("model.n_heads", mc.n_heads), ("model.n_kv_heads", kv),
                        ("model.d_ff", mc.d_ff), ("model.vocab_size", mc.vocab_size)):
      if value % m:
        problems.append(f"{name}={value} is not divisible by model={m}")
    stages = p * (pc.virtual_stages if pc.schedule == "circular" else 1)
    if mc.n_layers % stages:
      problems.append(f"model.n_layers={mc.n_layers} is not divisible by {stages} pipeline stages")
    if p > 1 and mc.dropout > 0:
      problems.append(f"model.dropout={mc.dropout} is not supported with a pipeline "
                      f"(pipeline={p}): the schedule does not carry the step's key; use pipeline=1 "
                      "or model.dropout=0")
  elif p > 1:
    problems.append(f"model.kind={mc.kind} has no layers to pipeline, use pipeline=1")
  if pc.sequence_parallel and decoder and mc.seq_len % m:
    problems.append(f"model.seq_len={mc.seq_len} is not divisible by model={m}, which sequence "
                    "parallelism splits it over")
  n_micro = microbatches(cfg, p)
  if p > 1 and (micro // d) % n_micro:
    problems.append(f"per-replica batch {micro // d} is not divisible by "
                    f"parallel.microbatches={n_micro}")
  if problems:
    raise ConfigError(f"mesh {d}x{m}x{p} ({named}) does not fit: " + "; ".join(problems))


def make(shape: tuple[int, int, int], devices=None):
  """A GSPMD (Auto axis types) mesh over `devices` (default: all)."""
  import jax
  from jax.sharding import AxisType
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=devices if devices is not None else jax.devices())
