"""`"2x4x1"` -> `Mesh(data, model, pipeline, context)`, with every degree checked once, up front.

A mesh is written DxMxP or DxMxPxC; the three-number form means context=1. Shapes in code are
4-tuples (`normalize` makes one of either form)."""
from __future__ import annotations

import os
import re

from jaxpar import kinds
from jaxpar.config import Config, ConfigError, microbatches

# the mesh's axes, outermost first: their one definition. `context` splits the sequence (ring
# attention, models/ring.py); innermost, so a ring's neighbours are neighbouring devices.
AXES = ("data", "model", "pipeline", "context")
DATA, MODEL, PIPE, CONTEXT = AXES


def parse(spec: str) -> tuple[int, int, int, int]:
  """'2x4x1' -> (2, 4, 1, 1), '1x1x1x4' -> (1, 1, 1, 4); anything else is a ConfigError naming
  the value."""
  m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)(?:x(\d+))?\s*", spec or "")
  if not m or min(int(g) for g in m.groups() if g is not None) < 1:
    raise ConfigError(f"mesh {spec!r} is not of the form DxMxP or DxMxPxC with positive integers "
                      f"(data x model x pipeline [x context]), e.g. 2x4x1 or 2x2x1x2")
  return normalize(int(g) for g in m.groups() if g is not None)


def normalize(shape) -> tuple[int, int, int, int]:
  """A (d, m, p) or (d, m, p, c) shape -> (d, m, p, c)."""
  shape = tuple(int(s) for s in shape)
  if len(shape) not in (3, 4):
    raise ConfigError(f"a mesh shape has 3 or 4 degrees (data, model, pipeline[, context]), "
                      f"not {shape}")
  return shape + (1,) * (4 - len(shape))  # type: ignore[return-value]


def spec_str(shape) -> str:
  """(2, 4, 1, 1) -> '2x4x1'; (2, 2, 1, 2) -> '2x2x1x2': the form a user writes."""
  shape = normalize(shape)
  return "x".join(map(str, shape if shape[3] > 1 else shape[:3]))


def size(mesh, axis: str) -> int:
  """The degree of `axis` in `mesh`; 1 where the mesh lacks it (a user's three-axis Mesh)."""
  return mesh.shape[axis] if axis in mesh.axis_names else 1


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


def check(shape, cfg: Config, n_devices: int) -> None:
  """Every degree against the devices and the model, one message naming all of them."""
  d, m, p, c = shape = normalize(shape)
  named = f"data={d}, model={m}, pipeline={p}" + (f", context={c}" if c > 1 else "")
  spec = spec_str(shape)
  if d * m * p * c != n_devices:
    raise ConfigError(f"mesh {spec} needs {d * m * p * c} devices, found {n_devices} ({named})")
  problems = []
  mc, tc, pc = cfg.model, cfg.train, cfg.parallel
  micro = tc.batch_size // tc.grad_accum
  if micro % d:
    problems.append(f"train.batch_size/train.grad_accum={micro} is not divisible by data={d}")
  decoder = kinds.get(mc.kind).decoder
  if decoder:
    kv = mc.n_kv_heads or mc.n_heads
    for name, value in (("model.n_heads", mc.n_heads), ("model.n_kv_heads", kv),
                        ("model.d_ff", mc.d_ff)):
      if value % m:
        problems.append(f"{name}={value} is not divisible by model={m}")
    if mc.padded_vocab() % m:
      padded = (f" (padded to {mc.padded_vocab()} by model.vocab_multiple={mc.vocab_multiple})"
                if mc.padded_vocab() != mc.vocab_size else "")
      problems.append(f"model.vocab_size={mc.vocab_size}{padded} is not divisible by model={m}; "
                      f"a model.vocab_multiple that model={m} divides pads it")
    stages = p * (pc.virtual_stages if pc.schedule == "circular" else 1)
    if mc.n_experts:
      problems += _expert_problems(mc, d, m)
    if mc.n_layers % stages:
      problems.append(f"model.n_layers={mc.n_layers} is not divisible by {stages} pipeline stages")
    if mc.n_experts and mc.moe_every > 1 and p > 1:
      problems += _moe_every_problems(mc, p, stages)
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
  if c > 1:
    problems += _context_problems(cfg, c, p, decoder)
  if problems:
    raise ConfigError(f"mesh {spec} ({named}) does not fit: " + "; ".join(problems))


def _moe_every_problems(mc, p: int, stages: int) -> list[str]:
  """A mixture in every k-th layer under a pipeline: each stage holds whole groups of k layers
  (its blocks of the dense and mixture weights then line up with its layers); the circular
  schedule's reorder of the stack is for layers of one kind."""
  groups = mc.mixture_layers()
  if stages != p:
    return [f"model.moe_every={mc.moe_every} is not supported with parallel.virtual_stages="
            f"{stages // p} (the circular schedule reorders a stack of identical layers); use 1"]
  if groups % p:
    return [f"model.n_layers={mc.n_layers} / model.moe_every={mc.moe_every} = {groups} mixture "
            f"layers are not divisible by {p} pipeline stages (each stage holds whole groups of "
            "moe_every layers)"]
  return []


def _expert_problems(mc, d: int, m: int) -> list[str]:
  """What a mixture of experts needs: experts split evenly over `data` (expert parallelism, the
  rules' `expert` row), the experts' width over `model`."""
  problems = []
  if mc.n_experts % d:
    problems.append(f"model.n_experts={mc.n_experts} is not divisible by data={d}, which splits "
                    "the experts (expert parallelism)")
  if mc.moe_d_ff % m:  # the shared experts' width is a multiple of it; d_ff is checked above
    problems.append(f"model.moe_d_ff={mc.moe_d_ff} is not divisible by model={m}")
  return problems


def context_attention(choice: str, pipelined: bool) -> str:
  """`parallel.context_attention` as it runs: "auto" is the ring, or the all-gather form under a
  pipeline (its stages run different branches in one tick; XLA:CPU's collective-permute waits
  for every device of the program, all-gathers and reduce-scatters only for their group)."""
  if choice == "auto":
    return "allgather" if pipelined else "ring"
  return choice


def ring_in_pipeline(p: int) -> str:
  """Why `parallel.context_attention=ring` is refused on a pipeline of `p` stages."""
  return (f"parallel.context_attention=ring cannot run inside a pipeline (pipeline={p}): its "
          "stages run different branches in one tick, where the ring's permutes would wait on "
          "each other; use allgather or auto")


def _context_problems(cfg: Config, c: int, p: int, decoder: bool) -> list[str]:
  """What a context axis of `c` needs: a decoder (ring attention), a sequence of 2c equal chunks,
  the all-gather form under a pipeline."""
  mc = cfg.model
  if not decoder:
    return [f"model.kind={mc.kind} has no context-parallel attention, use context=1"]
  problems = []
  if mc.seq_len % (2 * c):
    problems.append(f"model.seq_len={mc.seq_len} is not divisible by 2 x context={2 * c} "
                    "(each device holds two equal chunks of the sequence)")
  if p > 1 and cfg.parallel.context_attention == "ring":
    problems.append(ring_in_pipeline(p))
  return problems


def make(shape, devices=None):
  """A GSPMD (Auto axis types) mesh over `devices` (default: all); `shape` (d, m, p[, c])."""
  import jax
  from jax.sharding import AxisType
  return jax.make_mesh(normalize(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices if devices is not None else jax.devices())
