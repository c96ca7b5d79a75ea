"""Static report of a training step on a mesh: specs, bytes per device, collectives, FLOPs.

Nothing is allocated and nothing runs: the step is lowered from abstract shapes and compiled, and
every number is read from shardings or from the compiled program. All byte counts are per device
unless a key says `unsharded`.

FLOPs come in two flavours that mean different things:
- `flops_per_step`: XLA's cost analysis of the compiled per-device program. XLA:CPU counts each
  instruction once, so a while body (the layer scan, gradient accumulation) is NOT multiplied by
  its trip count; with loops it undercounts.
- `model_flops_per_step`: the model's analytic training FLOPs (DESIGN's definition) for one global
  batch, summed over all devices; this is the number MFU uses.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo
from jaxpar.config import Config, ConfigError, compile_cache_max_bytes, to_dict
from jaxpar.data import batch_spec
from jaxpar.models import base as jmodel
from jaxpar.models import decoder
from jaxpar.models.registry import build_model
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import rules
from jaxpar.train import executables
from jaxpar.train.step import Trainer


def spec_str(spec: P, ndim: int) -> str:
  """P('data') of a 2-D leaf -> "P('data', None)": padded to the leaf's rank."""
  parts = list(spec) + [None] * (ndim - len(spec))
  return "P(" + ", ".join(repr(a) for a in parts) + ")"


def shard_bytes(shape: Sequence[int], dtype: Any, sharding: NamedSharding) -> int:
  """Bytes of one device's shard of a global array of `shape` and `dtype` under `sharding`."""
  return math.prod(sharding.shard_shape(tuple(shape))) * jnp.dtype(dtype).itemsize


def _full_bytes(leaf: Any) -> int:
  return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def _model(cfg: Config) -> jmodel.ModelDef:
  return build_model(cfg)  # the same model the training run builds


def _batch_abstract(cfg: Config) -> dict:
  """The global batch the step takes, from the config alone (no data is read)."""
  return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in batch_spec(cfg).items()}


def plan(cfg: Config, mesh_shape: str | Sequence[int], devices: Sequence[Any] | None = None,
         model: jmodel.ModelDef | None = None, batch: Any = None, store_step: bool = False,
         **trainer_kw) -> dict:
  """The DESIGN plan JSON of one step of `cfg` on a DxMxP mesh over the first D*M*P `devices`.

  `model` (default: `model.kind`'s) may be a user's own (`jaxpar.from_nnx` ...), with `batch` a
  batch or its ShapeDtypeStructs (default: the config's token batch) and `trainer_kw` what
  `jaxpar.Trainer` takes beside it (`tx`, `frozen`, `rules` ...): what that trainer's state costs.
  `store_step` (jaxpar-plan; the config's own model and batch only) keeps the compiled step in
  the step store under the key `jaxpar-train` looks up (train/executables.py), unless it is there.
  """
  # Bad input (mesh, divisibility, too few devices) raises ConfigError before anything compiles.
  if isinstance(mesh_shape, str):
    shape = jmesh.parse(mesh_shape)
  else:
    shape = jmesh.normalize(mesh_shape)
  n = math.prod(shape)
  devices = list(jax.devices() if devices is None else devices)
  # A mesh smaller than the devices present is a valid plan (the rest idle); a larger one is not.
  devices = devices[:n] if len(devices) >= n else devices
  if model is None:  # the config's model: every degree checked against it
    jmesh.check(shape, cfg, len(devices))
  elif n > len(devices):
    raise ConfigError(f"mesh {jmesh.spec_str(shape)} needs {n} devices, found {len(devices)}")
  mesh = jmesh.make(shape, devices)
  own_model = model is None and batch is None
  model = _model(cfg) if model is None else model
  trainer = Trainer(cfg, mesh, model, **trainer_kw)
  batch = _batch_abstract(cfg) if batch is None else jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  compiled = _compile(trainer, batch, store_step and not trainer_kw and own_model)
  text = compiled.as_text()

  # What the state costs is read off its layout (train/layout.py); the rest off the program.
  layout = trainer.state_layout
  is_spec = lambda x: isinstance(x, P)
  abstract = trainer.model.abstract
  param_sh = layout.state_shardings["params"]
  grad_sh = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), layout.zero.grads,
                                   is_leaf=is_spec)
  opt_sh = layout.state_shardings["opt"]
  opt_abstract = layout.abstract_state["opt"]

  def total(tree_abstract, tree_sh) -> int:
    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, s: shard_bytes(a.shape, a.dtype, s), tree_abstract, tree_sh)))

  # Grads take the param dtype: the step casts to the compute dtype inside the loss only. A
  # frozen parameter (a LoRA's base weights) has none: the step neither reduces nor keeps it.
  frozen = trainer.frozen or jax.tree_util.tree_map(lambda _: False, abstract)
  trained = jax.tree_util.tree_map(lambda a, f: None if f else a, abstract, frozen)
  grads_sh = jax.tree_util.tree_map(lambda s, f: None if f else s, grad_sh, frozen)
  per_device = {"params": total(abstract, param_sh), "grads": total(trained, grads_sh),
                "opt_state": total(opt_abstract, opt_sh)}
  full_params = sum(_full_bytes(a) for a in jax.tree_util.tree_leaves(abstract))
  unsharded = {"params": full_params,
               "grads": sum(_full_bytes(a) for a in jax.tree_util.tree_leaves(trained)),
               "opt_state": sum(_full_bytes(a) for a in jax.tree_util.tree_leaves(opt_abstract))}

  parameters, experts = [], []
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  leaves = lambda tree, leaf=None: jax.tree_util.tree_leaves(tree, is_leaf=leaf)
  is_axes = lambda x: isinstance(x, tuple) and not is_spec(x)
  for (path, a), logical, p_sh, g_sh, o_spec in zip(
      flat, leaves(trainer.model.logical, is_axes), leaves(param_sh), leaves(grad_sh),
      leaves(layout.zero.opt, is_spec)):
    parameters.append({
        "path": rules.path_str(path),
        "shape": list(a.shape),
        "dtype": jnp.dtype(a.dtype).name,
        "logical": list(logical),
        "spec": spec_str(p_sh.spec, a.ndim),
        "grad_spec": spec_str(g_sh.spec, a.ndim),
        "opt_spec": spec_str(o_spec, a.ndim),
        "bytes_per_device": shard_bytes(a.shape, a.dtype, p_sh),
    })
    if "expert" in logical:  # (its path's key, experts in all, experts on one device)
      at = list(logical).index("expert")
      experts.append((jax.tree_util.keystr(path), a.shape[at], p_sh.shard_shape(a.shape)[at]))

  d, m, p, c = shape
  return {
      "devices": n,
      "platform": devices[0].platform,
      "mesh": {"data": d, "model": m, "pipeline": p, "context": c,
               "shape": jmesh.spec_str(shape)},
      "zero_stage": cfg.parallel.zero_stage,
      "offload_optimizer": cfg.parallel.offload_optimizer,
      # how activations and the loss are handled: the per-layer remat policy, sequence
      # parallelism (its all-gathers show in `collectives`) and the loss scale at step 0
      "activations": {"remat": cfg.parallel.remat,
                      "sequence_parallel": cfg.parallel.sequence_parallel},
      "loss_scale": _loss_scale(cfg),
      # the vocabulary's padding (model.vocab_multiple) is held, but is no parameter
      "param_count": sum(math.prod(a.shape) for a in jax.tree_util.tree_leaves(abstract))
                     - decoder.padding_params(abstract, cfg.model),
      "bytes_per_device": per_device,
      "unsharded_bytes": unsharded,
      "compiled": hlo.memory(compiled),
      "collectives": hlo.collective_bytes(text),
      # what one device sends for them (ring algorithms over each one's group): the link's load
      "sent_bytes": hlo.sent_bytes(text, trainer.mesh.size),
      "flops_per_step": hlo.flops(compiled),
      "model_flops_per_step": model.flops_per_example * cfg.train.batch_size,
      "pipeline": _pipeline(layout.schedule),
      "experts": _experts(experts, text),
      "parameters": parameters,
      "config": to_dict(cfg),
  }


def _experts(leaves: list[tuple[str, int, int]], text: str) -> dict | None:
  """A mixture's experts on one device, read off the compiled program `text`: the bytes of the
  expert weights and of their optimizer state (the entry parameters named by the leaves' paths,
  `leaves`: (key path, experts, experts per device) of each parameter with the `expert` axis), the
  largest all-to-all (the buffer that carries one layer's rows to their experts' owners, or back)
  and the all-to-all bytes of a step. None for a model without experts."""
  if not leaves:
    return None
  keys = [key for key, _, _ in leaves]
  weights = opt = 0
  params = hlo.entry_parameters(text)
  for name, size in params:
    if any(name.endswith("['params']" + k) for k in keys):
      weights += size
    elif any(name.endswith(k) for k in keys):
      opt += size
  named = any(name for name, _ in params)  # a program whose parameters carry no paths: unknown
  a2a = [sum(hlo.shape_bytes(f"{t}[{','.join(map(str, dims))}]") for t, dims in c.arrays)
         for c in hlo.collectives(text) if c.kind == "all-to-all"]
  total, local = max((e, el) for _, e, el in leaves)
  return {"n_experts": total, "split": total // local, "per_device": local,
          "weights_bytes": weights if named else None, "opt_state_bytes": opt if named else None,
          "dispatch_buffer_bytes": max(a2a, default=0),
          "all_to_all_bytes": hlo.collective_bytes(text)["all-to-all"]}


def _compile(trainer: Trainer, batch: Any, store: bool) -> Any:
  """The step compiled; with `store`, one the step store lacks is compiled past JAX's cache and
  kept there (an executable JAX's cache loads cannot be kept: executables.save)."""
  lowered = trainer.lower(batch)
  where = executables.folder() if store else None
  key = executables.fingerprint(trainer, batch, trainer.batch_sharding(batch)) if where else None
  if key is None or executables.stored(where, key):
    return lowered.compile()
  compiled = executables.compile_fresh(lowered)
  executables.save(where, key, compiled, compile_cache_max_bytes(trainer.cfg))
  return compiled


def _loss_scale(cfg: Config) -> dict:
  """{'kind': none | static | dynamic, 'scale': the scale the first step runs with, ...}."""
  pc = cfg.precision
  if pc.loss_scale == "dynamic":
    return {"kind": "dynamic", "scale": pc.initial_scale, "growth_interval": pc.growth_interval,
            "backoff": pc.backoff, "min_scale": pc.min_scale}
  scale = float(pc.loss_scale)
  return {"kind": "none" if scale == 1.0 else "static", "scale": scale}


def _pipeline(sched) -> dict | None:
  """The executed schedule: its size, bubble and stage x tick chart (None without a pipeline)."""
  if sched is None:
    return None
  return {"schedule": sched.name, "stages": sched.stages, "microbatches": sched.microbatches,
          "virtual_stages": sched.virtual_stages, "ticks": sched.ticks,
          "bubble_fraction": sched.bubble_fraction, "buffer_slots": sched.slots,
          "chart": sched.chart()}


def _mib(b: float) -> str:
  return f"{b / 2**20:,.3f} MiB"


def _flops(f: float | None) -> str:
  return "n/a" if f is None else f"{f:.4g}"


def format_table(report: dict) -> str:
  """The plan as text: one row per parameter, then totals, compiled memory, collectives, FLOPs."""
  ms = report["mesh"]
  lines = [f"mesh {ms['shape']} (data={ms['data']}, model={ms['model']}, pipeline={ms['pipeline']})"
           f" on {report['devices']} {report.get('platform', '')} devices, ZeRO stage "
           f"{report['zero_stage']}, {report['param_count']:,} parameters", ""]
  rows = [(q["path"], "x".join(map(str, q["shape"])) or "()", q["spec"], q["opt_spec"],
           f"{q['bytes_per_device']:,}") for q in report["parameters"]]
  head = ("parameter", "shape", "spec (params)", "spec (opt state)", "bytes/device")
  widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
  fmt = lambda r: "  ".join(c.rjust(w) if i == len(head) - 1 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths))).rstrip()
  lines += [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows] + [""]

  per, full = report["bytes_per_device"], report["unsharded_bytes"]
  lines.append(f"{'model state':<12}  {'per device':>16}  {'unsharded':>16}")
  for key in ("params", "grads", "opt_state"):
    lines.append(f"{key:<12}  {_mib(per[key]):>16}  {_mib(full[key]):>16}")
  lines.append(f"{'total':<12}  {_mib(sum(per.values())):>16}  {_mib(sum(full.values())):>16}")
  if report.get("offload_optimizer"):
    lines.append("opt_state lives in host memory (pinned_host), not in device memory")
  lines.append("")
  act, ls = report["activations"], report["loss_scale"]
  lines.append(f"remat {act['remat']}, sequence parallel {'on' if act['sequence_parallel'] else 'off'}, "
               f"loss scale {ls['kind']}" + (f" (starts at {ls['scale']:g})" if ls["kind"] != "none" else ""))
  lines.append("")
  lines.append("compiled program, per device (XLA memory analysis)")
  for key, value in report["compiled"].items():
    lines.append(f"  {key:<22} {_mib(value):>16}")
  lines.append("")
  lines.append("collectives, bytes per device per step (result buffers, loops by trip count)")
  coll = report["collectives"]
  for key, value in coll.items():
    lines.append(f"  {key:<22} {_mib(value):>16}")
  lines.append(f"  {'total':<22} {_mib(sum(coll.values())):>16}")
  lines.append("")
  lines.append(f"flops_per_step        {_flops(report['flops_per_step'])}  "
               "(XLA cost analysis, one device; loop bodies counted once)")
  lines.append(f"model_flops_per_step  {_flops(report['model_flops_per_step'])}  "
               "(analytic training FLOPs of one global batch, all devices)")
  ex = report.get("experts")
  if ex:
    lines.append("")
    lines.append(f"experts: {ex['n_experts']} split {ex['split']} ways over the mesh, "
                 f"{ex['per_device']} per device (from the compiled program)")
    for key in ("weights_bytes", "opt_state_bytes", "dispatch_buffer_bytes", "all_to_all_bytes"):
      value = ex[key]
      lines.append(f"  {key:<22} {'n/a' if value is None else _mib(value):>16}")
  pipe = report.get("pipeline")
  if pipe:
    lines.append("")
    lines.append(f"pipeline: {pipe['schedule']}, {pipe['stages']} stages, {pipe['microbatches']} "
                 f"microbatches, {pipe['virtual_stages']} virtual stages, {pipe['ticks']} ticks, "
                 f"bubble {pipe['bubble_fraction']:.3f} (idle stage-slots / all stage-slots)")
    lines.append(pipe["chart"])
  return "\n".join(lines)
