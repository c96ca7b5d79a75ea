"""jaxpar on one GPU, in one call: MFU, memory truth, offload and the largest model that trains.

`python benchmarks/gpu_check.py --out DIR [--small] [--budget-s S] [--only NAME,...] [--list]`

Written for a short lease of one H200 (the `device` tool: about 15 minutes in all, machine start
included), so everything is one command that stays inside `--budget-s` (default 450 s) and writes
`DIR/gpu_check.json` and `DIR/profile_summary.txt`. Each measurement runs in its own process
(a clean allocator peak; XLA flags set before JAX starts; an out-of-memory ends one measurement,
not the check), in priority order; one that would not finish in the time left is skipped and the
JSON says so, so a rerun with `--only` can pick up the rest.

What it measures (all bf16 compute, float32 master weights and AdamW state, T = 2048,
synthetic tokens; cuDNN's fused attention where jaxpar finds it usable):
1. `gpt`, `llama`: MFU (DESIGN.md's definition over the datasheet peak that jaxpar.train.metrics names),
   tokens/s, and the step's time split into matmuls, attention, optimizer and the rest, read from
   one profiler window (jaxpar.analysis.profile.category_split over the step's HLO).
2. `gpt_offload`, `gpt_remat`, with `gpt`: memory truth: the peak plan.py predicts (the compiled
   program's arguments + outputs + temporaries - donated, jaxpar.analysis.hlo.memory, the one definition
   plan.py reports) against the allocator's `peak_bytes_in_use` after 3 steps.
3. `gpt_offload` against `gpt`: offload for real: `memory_analysis()`'s device and host bytes
   (separate on GPU, unlike XLA:CPU), and the step time offload costs.
4. levers for MFU: batch, remat policy, XLA's latency-hiding scheduler (`gpt_b16_dots`, `gpt_b4`,
   `gpt_lhs`); the best configuration is named in the summary.
5. `largest`, `largest_offload`: the largest decoder (d_model 4096, depth searched) that trains,
   predicted from two compiled depths (peak memory is linear in depth under the layer scan) and
   confirmed by 2 real steps, without and with optimizer offload.
6. `llama_moe`: a mixture's tokens/s and MFU beside `llama`'s; `moe_exchange`: its exchange
   alone (parallel/expert.py) on every local device, the ragged path jaxpar takes on GPUs
   (jax.lax.ragged_all_to_all; emulated on the CPU under --small) against the padded path on
   the same rows: the largest difference, rows/s and the bytes each sends.

Stack: Python >= 3.11, jax >= 0.10.2 with a CUDA plugin, flax, optax, orbax-checkpoint; none of
tensorflow-datasets, grain, array_record or tensorboardX is imported (each measurement checks).
A stack that differs is one line and exit 2, before anything starts. `--small` runs a tiny shape
of every measurement on whatever backend is there (CPU too): the test suite runs it so the script
cannot rot; its numbers are not measurements.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
try:
  import jaxpar  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`, as on the GPU machine
  sys.path.insert(0, os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(HERE, "results", "gpu_check")
ABSENT_ON_GPU_HOST = ("tensorflow_datasets", "grain", "array_record", "tensorboardX")
# What the check needs, from pyproject.toml's floors; the GPU machine has jax 0.11.2.
NEEDS = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12", "optax": "0.2.5",
         "orbax-checkpoint": "0.11"}
WARMUP = 2
MEMORY_AFTER = 3  # the allocator's peak is read after this many steps
# The GPU machine's allocator may take this share of device memory (JAX's default is 0.75); the
# largest-model search needs the rest.
MEM_FRACTION = "0.92"

GPT_1B = {"model.kind": "gpt", "model.n_layers": 16, "model.d_model": 2048, "model.n_heads": 16,
          "model.d_ff": 8192, "model.seq_len": 2048, "model.vocab_size": 50304,
          "train.batch_size": 8}
# Llama at the same size: SwiGLU's three matrices of 5632 hold what GPT's two of 8192 do;
# grouped-query attention with 4 kv heads, Llama-2's vocabulary.
LLAMA_1B = {**GPT_1B, "model.kind": "llama", "model.d_ff": 5632, "model.n_kv_heads": 4,
            "model.vocab_size": 32000}
LARGEST = {"model.kind": "gpt", "model.d_model": 4096, "model.n_heads": 32, "model.d_ff": 16384,
           "model.seq_len": 2048, "model.vocab_size": 50304, "train.batch_size": 1,
           "parallel.remat": "full"}
SMALL_SHAPE = {"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.d_ff": 128,
               "model.seq_len": 32, "model.vocab_size": 256, "train.batch_size": 4}
SMALL_LLAMA = {**SMALL_SHAPE, "model.kind": "llama", "model.n_kv_heads": 2}


def phases(small: bool) -> list[dict]:
  """The measurements in priority order: name, kind, config overrides, steps, XLA flags, and the
  seconds one is expected to need (a phase is skipped when less than that is left)."""
  gpt = {**SMALL_SHAPE, "model.kind": "gpt"} if small else GPT_1B
  llama = SMALL_LLAMA if small else LLAMA_1B
  steps = 3 if small else 8
  need = 10 if small else 75
  out = [
      dict(name="gpt", kind="train", overrides=gpt, steps=steps, profile=True, need_s=need),
      dict(name="llama", kind="train", overrides=llama, steps=steps, profile=True, need_s=need),
      dict(name="gpt_offload", kind="train", steps=steps, need_s=need,
           overrides={**gpt, "parallel.offload_optimizer": True}),
      dict(name="gpt_remat", kind="train", steps=steps, need_s=need,
           overrides={**gpt, "parallel.remat": "dots_saveable"}),
      dict(name="gpt_b16_dots", kind="train", steps=steps, need_s=need,
           overrides={**gpt, "train.batch_size": 2 * gpt["train.batch_size"],
                      "parallel.remat": "dots_saveable"}),
      dict(name="gpt_b4", kind="train", steps=steps, need_s=need,
           overrides={**gpt, "train.batch_size": max(gpt["train.batch_size"] // 2, 1)}),
      dict(name="gpt_lhs", kind="train", steps=steps, need_s=need, overrides=gpt,
           xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true"),
  ]
  levers = out[4:]
  del out[4:]
  family = {**SMALL_SHAPE, "parallel.remat": "full"} if small else LARGEST
  # --small has no allocator limit on CPU: a stated budget stands in for the device's memory.
  budget = 4 * 2**20 if small else None
  for offload in (False, True):
    out.append(dict(name="largest_offload" if offload else "largest", kind="largest",
                    overrides={**family, "parallel.offload_optimizer": offload},
                    depths=(1, 2) if small else (8, 16), budget_bytes=budget,
                    need_s=15 if small else 120))
  # a mixture of experts: the accelerators' grouped matmul (jax.lax.ragged_dot, models/grouped.py)
  # on the device, 8 experts of a quarter of the dense width, top-2
  out.append(dict(name="llama_moe", kind="train", steps=steps, need_s=need,
                  overrides={**llama, "model.n_experts": 8, "model.experts_per_token": 2,
                             "model.moe_d_ff": llama["model.d_ff"] // 4}))
  # the same with a capacity: each expert's C fixed slots and one batched matmul (moe._slotted)
  out.append(dict(name="llama_moe_capacity", kind="train", steps=steps, need_s=need,
                  overrides={**out[-1]["overrides"], "model.capacity_factor": 1.25}))
  # its exchange (parallel/expert.py): jax.lax.ragged_all_to_all on the device(s), against the
  # padded all-to-all on the same rows; --small on 4 simulated CPU devices, the ragged path
  # emulated (XLA:CPU has no ragged all-to-all)
  out.append(dict(name="moe_exchange", kind="exchange", need_s=need, steps=steps,
                  rows=256 if small else 32768, width=64 if small else 2048, experts=8,
                  xla_flags="--xla_force_host_platform_device_count=4" if small else None))
  return out + levers


# --- the stack ------------------------------------------------------------------------------

def _version_tuple(v: str) -> tuple:
  return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_stack(small: bool) -> dict:
  """{package: version}; raises SystemExit(2) with one line if the stack is not what the check
  needs. Nothing here starts a JAX backend (a parent holding GPU memory would starve the runs)."""
  if sys.version_info < (3, 11):
    raise SystemExit(f"error: gpu_check needs Python >= 3.11, found {platform.python_version()}")
  found = {"python": platform.python_version()}
  for pkg, floor in NEEDS.items():
    try:
      found[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      raise SystemExit(f"error: gpu_check needs {pkg} >= {floor}, which is not installed")
    if _version_tuple(found[pkg]) < _version_tuple(floor):
      raise SystemExit(f"error: gpu_check needs {pkg} >= {floor}, found {found[pkg]}")
  plugins = sorted(d.metadata["Name"] for d in md.distributions()
                   if re.fullmatch(r"jax[-_]cuda\d+[-_]plugin", d.metadata["Name"] or ""))
  found["cuda_plugins"] = plugins
  if not small and not plugins:
    raise SystemExit("error: gpu_check needs JAX's CUDA plugin (jax-cuda12-plugin or "
                     "jax-cuda13-plugin) for a GPU run; none is installed (use --small on CPU)")
  return found


# --- one measurement, in its own process ----------------------------------------------------

def _absent_imported() -> list[str]:
  return sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT_ON_GPU_HOST))


def _host_fields(compiled) -> dict:
  """memory_analysis()'s host-memory fields (real on GPU; zero on XLA:CPU, which does not
  separate host memory)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # some backends raise instead of returning nothing
    stats = None
  out = {}
  for key in ("host_argument_size_in_bytes", "host_output_size_in_bytes",
              "host_temp_size_in_bytes", "host_alias_size_in_bytes",
              "host_generated_code_size_in_bytes"):
    v = getattr(stats, key, None) if stats is not None else None
    out[key] = int(v) if v is not None else None
  return out


def _device_limit() -> int | None:
  import jax
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # backends without allocator stats may raise
    stats = None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _build(overrides: dict):
  import jax

  from jaxpar import config as jconfig
  from jaxpar.models import registry as jmodel
  from jaxpar.parallel import mesh as jmesh
  from jaxpar.train.step import Trainer
  cfg = jconfig.load(None, [f"{k}={v}" for k, v in overrides.items()] + [
      "precision.compute_dtype=bfloat16", "precision.param_dtype=float32",
      "train.warmup_steps=1", "data.source=synthetic"])
  mesh = jmesh.make((1, 1, 1), jax.devices()[:1])
  model = jmodel.decoder(cfg)
  return cfg, mesh, model, Trainer(cfg, mesh, model)


def _compile(trainer, cfg):
  import jax
  import jax.numpy as jnp
  B, T = cfg.train.batch_size, cfg.model.seq_len
  abstract = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  t0 = time.perf_counter()
  compiled = trainer.lower(abstract).compile()
  return compiled, abstract, time.perf_counter() - t0


def _batches(trainer, cfg, abstract, n=2):
  import jax
  import numpy as np
  rng = np.random.default_rng(cfg.train.seed)
  B, T = cfg.train.batch_size, cfg.model.seq_len
  sharding = trainer.batch_sharding(abstract)
  return [jax.device_put({"tokens": rng.integers(0, cfg.model.vocab_size, (B, T + 1),
                                                 dtype=np.int32)}, sharding) for _ in range(n)]


def measure_train(spec: dict, trace_dir: str) -> dict:
  """One configuration: compile, memory (compiled and allocator), timed steps, MFU, and the step
  split from a profiler window of 2 steps."""
  import statistics

  import jax

  from jaxpar.analysis import hlo, profile
  from jaxpar.models import gpt
  from jaxpar.train import metrics
  cfg, mesh, model, trainer = _build(spec["overrides"])
  mc, B = cfg.model, cfg.train.batch_size
  T, H = mc.seq_len, mc.n_heads
  G, K = mc.n_kv_heads or H, mc.d_model // H
  attn = gpt.attention_implementation((B, T, H, K), (B, T, G, K), "bfloat16")
  compiled, abstract, compile_s = _compile(trainer, cfg)
  memory = hlo.memory(compiled)
  host = _host_fields(compiled)
  t0 = time.perf_counter()
  state = trainer.init(cfg.train.seed)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  batches = _batches(trainer, cfg, abstract)
  done = 0

  def run():
    nonlocal state, done
    with jax.set_mesh(mesh):
      state, out = compiled(state, batches[done % len(batches)])
    done += 1
    return out

  losses, step_s, allocator_peak = [], [], None
  for _ in range(WARMUP):
    losses.append(float(run()["loss"]))
  for _ in range(spec["steps"]):
    t0 = time.perf_counter()
    losses.append(float(run()["loss"]))  # waits for the step: one step per timing
    step_s.append(time.perf_counter() - t0)
    if done == MEMORY_AFTER:
      allocator_peak = metrics.device_peak_memory_bytes()
  if not all(math.isfinite(x) for x in losses):
    raise RuntimeError(f"non-finite loss: {losses}")
  median_s = statistics.median(step_s)
  peak, peak_source = metrics.peak_flops_per_device()
  tokens_per_s = B * T / median_s
  flops_per_token = model.flops_per_example / T
  result = {
      "config": spec["overrides"], "xla_flags": spec.get("xla_flags", ""),
      "params": sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(model.abstract)),
      "attention": {"implementation": attn[0], "why": attn[1]},
      "compile_s": compile_s, "init_s": init_s,
      "step_s": {"median": median_s, "min": min(step_s), "max": max(step_s), "repeats": step_s},
      "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token,
      "peak_flops_per_device": peak, "peak_source": peak_source,
      "mfu": metrics.mfu(tokens_per_s, flops_per_token, peak, 1),
      "memory": {"predicted_peak_bytes": memory["peak_bytes"], "compiled": memory,
                 "compiled_host": host, "allocator_peak_bytes_after_3_steps": allocator_peak,
                 "allocator_over_predicted": (allocator_peak / memory["peak_bytes"]
                                              if allocator_peak and memory["peak_bytes"] else None),
                 "device_bytes_limit": _device_limit()},
      "loss": {"first": losses[0], "last": losses[-1]},
  }
  if spec.get("profile"):
    jax.block_until_ready(state)
    jax.profiler.start_trace(trace_dir)
    t0 = time.perf_counter()
    for _ in range(2):
      run()
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t0) / 2
    jax.profiler.stop_trace()
    text = compiled.as_text()
    module = re.search(r"^HloModule\s+([\w.\-]+)", text, re.MULTILINE)
    split = profile.category_split(trace_dir, 2, profile.op_categories(text),
                                   module.group(1) if module else None)
    if split is not None:
      split.pop("file")
      split["step_s"] = wall
      split["idle_s"] = max(wall - split["busy_s"], 0.0)
    result["split"] = split
  return result


def _host_ram() -> int | None:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def measure_largest(spec: dict) -> dict:
  """The deepest model of the family that fits the device's memory. The compiled peak (plan.py's
  figure) is close to linear in depth under the layer scan: two compiled depths give a first
  guess, each further compile refines it (secant through the two nearest points) until the peak
  is within 95% of the allocator's limit; 2 real steps confirm it (15% shallower once if they run
  out of memory). With offload the host holds the AdamW moments (8 bytes a parameter): the
  depth is also capped so that they fill at most half the host's RAM."""
  import jax

  from jaxpar.analysis import hlo
  from jaxpar.train import metrics
  limit = spec.get("budget_bytes") or _device_limit()
  if not limit:
    raise RuntimeError("this backend reports no memory limit; give budget_bytes")
  target = 0.95 * limit
  compiled_at: dict[int, dict] = {}
  compile_s = 0.0

  last: dict[int, tuple] = {}  # the newest build, so the confirmed depth is not compiled twice

  def compile_at(depth: int):
    nonlocal compile_s
    if depth in last:
      return last[depth]
    last.clear()
    cfg, mesh, model, trainer = _build({**spec["overrides"], "model.n_layers": depth})
    compiled, abstract, s = _compile(trainer, cfg)
    compile_s += s
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(model.abstract))
    # With offload, where the device fields also count the host-resident state (the host_*
    # fields say how much), the prediction errs on the safe side.
    compiled_at[depth] = {"peak_bytes": hlo.memory(compiled)["peak_bytes"], "params": n_params,
                          "host": _host_fields(compiled)}
    last[depth] = (cfg, mesh, trainer, compiled, abstract)
    return last[depth]

  def guess() -> int:
    pts = sorted(compiled_at.items(), key=lambda kv: abs(kv[1]["peak_bytes"] - target))[:2]
    (d1, a), (d2, b) = sorted(pts)
    per_layer = (b["peak_bytes"] - a["peak_bytes"]) / (d2 - d1)
    depth = int(d1 + (target - a["peak_bytes"]) // per_layer) if per_layer > 0 else d2
    ram = _host_ram()
    if spec["overrides"].get("parallel.offload_optimizer") and ram:
      per_param_layer = (b["params"] - a["params"]) / (d2 - d1)
      cap = int(d1 + (ram / 2 / 8 - a["params"]) // per_param_layer)
      depth = min(depth, cap)
    return max(depth, 1)

  for depth in spec["depths"]:
    compile_at(depth)
  depth = guess()
  for _ in range(3):  # compile-only refinement: cheap next to a step of a model this size
    if depth in compiled_at:
      break
    compile_at(depth)
    if compiled_at[depth]["peak_bytes"] <= target:
      break
    depth = min(guess(), depth - 1)
  predicted = depth
  tries = []
  for depth in (predicted, max(int(predicted * 0.85), 1)):
    try:
      cfg, mesh, trainer, compiled, abstract = compile_at(depth)
      if compiled_at[depth]["peak_bytes"] > limit:
        raise MemoryError(f"compiled peak {compiled_at[depth]['peak_bytes']} bytes is over the "
                          f"limit {limit}")
      state = trainer.init(cfg.train.seed)
      batches = _batches(trainer, cfg, abstract, n=1)
      losses = []
      for _ in range(2):
        with jax.set_mesh(mesh):
          state, out = compiled(state, batches[0])
        losses.append(float(out["loss"]))
      tries.append({"n_layers": depth, "params": compiled_at[depth]["params"], "ok": True,
                    "losses": losses, "predicted_peak_bytes": compiled_at[depth]["peak_bytes"],
                    "allocator_peak_bytes": metrics.device_peak_memory_bytes()})
      break
    except Exception as e:  # out of memory: one step back, once
      tries.append({"n_layers": depth, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]})
      state = compiled = trainer = None
      last.clear()
  return {"config": spec["overrides"], "limit_bytes": limit, "host_ram_bytes": _host_ram(),
          "compiled_at": compiled_at, "predicted_max_layers": predicted, "compile_s": compile_s,
          "tries": tries, "largest": next((t for t in tries if t["ok"]), None)}


def measure_exchange(spec: dict) -> dict:
  """A mixture's exchange alone (expert.run_owned over every local device on `data`, top-2 rows
  of `width` float32 values, `rows` a device, `experts` experts with random group sizes, each row
  times its expert's matrix), forward and backward, by the ragged path jaxpar takes off the CPU
  (jax.lax.ragged_all_to_all; --small: its emulation on the CPU) and by the padded path: the
  largest difference of rows back and gradients, rows/s of each, the bytes each device's
  collectives carry on the device (sent_bytes; the CPU's emulation itself moves the padded
  buffers)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from jaxpar.analysis import hlo
  from jaxpar.models import grouped
  from jaxpar.parallel import expert
  from jaxpar.parallel import mesh as jmesh
  devices = jax.devices()
  d, A, D, E = len(devices), spec["rows"], spec["width"], spec["experts"]
  rng = np.random.default_rng(0)
  sizes = np.stack([rng.multinomial(A, np.ones(E) / E) for _ in range(d)]).astype(np.int32)
  rows, w, c = (jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)
                for s in ((d * A, D), (E, D, D), (d * A, D)))
  mesh = jmesh.make((d, 1, 1), devices)

  def local(rows, w, sizes, c):
    out = expert.run_owned(rows, sizes.reshape(E), lambda x, g: grouped.matmul(x, w, g), A,
                           "data")
    return jax.lax.psum(jnp.sum(out * c), "data"), out
  f = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=(P(), P("data")),
                    axis_names={"data"})
  args = (rows, w, jnp.asarray(sizes), c)
  runs = {}
  for path, flag in (("ragged", True), ("padded", False)):
    expert.RAGGED = flag
    with jax.set_mesh(mesh):
      step = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True)).lower(*args).compile()
      text = step.as_text()
      (_, out), grads = step(*args)
      jax.block_until_ready(grads)
      times = []
      for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - t0)
    runs[path] = dict(result=jax.device_get((out, grads)), step_s=float(np.median(times)),
                      ragged_all_to_alls=text.count("ragged-all-to-all("),
                      all_to_all_bytes=hlo.collective_bytes(text)["all-to-all"])
  expert.RAGGED = None
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
      jax.tree_util.tree_leaves(runs["ragged"].pop("result")),
      jax.tree_util.tree_leaves(runs["padded"].pop("result"))))
  row = D * 4
  for path, r in runs.items():
    r["rows_per_s"] = d * A / r["step_s"]
  # per device and step: 4 exchanges (rows out and back, forward and backward) of its real rows
  # (the ragged path, the most any device sends) or of d buffers of A rows (padded)
  runs["ragged"]["sent_bytes"] = int(4 * sizes.sum(1).max() * row)
  runs["padded"]["sent_bytes"] = int(4 * d * A * row)
  return dict(devices=d, rows_per_device=A, width=D, experts=E, max_abs_difference=diff,
              emulated=jax.default_backend() == "cpu", paths=runs,
              receive_buffer_bytes=int(d * A * row))


def child(spec: dict, out: str) -> int:
  import jax
  t0 = time.perf_counter()
  trace_dir = os.path.join(os.path.dirname(out), "trace_" + spec["name"])
  if spec["kind"] == "train":
    result = measure_train(spec, trace_dir)
  elif spec["kind"] == "exchange":
    result = measure_exchange(spec)
  else:
    result = measure_largest(spec)
  device = jax.local_devices()[0]
  result.update(name=spec["name"], backend=jax.default_backend(), device_kind=device.device_kind,
                seconds=time.perf_counter() - t0, imported_absent_modules=_absent_imported())
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  return 1 if result["imported_absent_modules"] else 0


# --- the whole check --------------------------------------------------------------------------

def _human(n: int | None) -> str:
  if n is None:
    return "n/a"
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tail(text: str, n: int = 15) -> str:
  return "\n".join((text or "").strip().splitlines()[-n:])


def run_phase(spec: dict, parts: str, timeout: float, small: bool) -> dict:
  out = os.path.join(parts, spec["name"] + ".json")
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
  if spec.get("xla_flags"):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + spec["xla_flags"]).strip()
  if small:
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "") or "cpu"
  t0 = time.perf_counter()
  try:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec),
                        "--child-out", out], env=env, capture_output=True, text=True,
                       timeout=timeout)
  except subprocess.TimeoutExpired as e:
    return {"failed": f"did not finish within {timeout:.0f} s",
            "tail": _tail(e.stderr if isinstance(e.stderr, str) else "")}
  if r.returncode != 0 or not os.path.exists(out):
    return {"failed": f"exit code {r.returncode}", "tail": _tail(r.stderr or r.stdout),
            "seconds": time.perf_counter() - t0}
  with open(out) as f:
    return json.load(f)


def summarise(results: dict) -> dict:
  """The figures the issue asks for, from the phases that ran."""
  ok = {k: v for k, v in results.items() if "failed" not in v and "skipped" not in v}
  train = {k: v for k, v in ok.items() if "mfu" in v}
  s: dict = {}
  if train:
    best = max(train, key=lambda k: train[k]["mfu"])
    s["mfu"] = {k: round(v["mfu"], 4) for k, v in train.items()}
    s["best"] = {"phase": best, "mfu": train[best]["mfu"], "config": train[best]["config"],
                 "xla_flags": train[best]["xla_flags"],
                 "tokens_per_s": train[best]["tokens_per_s"]}
  s["memory_ratio_allocator_over_predicted"] = {
      k: v["memory"]["allocator_over_predicted"] for k, v in train.items()
      if k in ("gpt", "gpt_offload", "gpt_remat")}
  if "gpt" in train and "gpt_offload" in train:
    a, b = train["gpt"], train["gpt_offload"]
    s["offload"] = {
        "device_peak_bytes": {"off": a["memory"]["predicted_peak_bytes"],
                              "on": b["memory"]["predicted_peak_bytes"]},
        "host_bytes_on": b["memory"]["compiled_host"],
        "allocator_peak_bytes": {"off": a["memory"]["allocator_peak_bytes_after_3_steps"],
                                 "on": b["memory"]["allocator_peak_bytes_after_3_steps"]},
        "step_s": {"off": a["step_s"]["median"], "on": b["step_s"]["median"]},
        "step_time_cost": b["step_s"]["median"] / a["step_s"]["median"] - 1}
  for k in ("largest", "largest_offload"):
    if k in ok:
      s[k] = ok[k]["largest"]
  if "moe_exchange" in ok:
    x = ok["moe_exchange"]
    s["moe_exchange"] = {"devices": x["devices"], "emulated": x["emulated"],
                         "max_abs_difference": x["max_abs_difference"],
                         **{f"{k}_{p}": x["paths"][p][k] for p in ("ragged", "padded")
                            for k in ("rows_per_s", "sent_bytes")}}
  if "llama" in train and "llama_moe" in train:  # the mixture's active MLP is half the dense one's
    runs = {"dense": "llama", "moe": "llama_moe", "moe_capacity": "llama_moe_capacity"}
    runs = {k: train[v] for k, v in runs.items() if v in train}
    s["moe"] = {"tokens_per_s": {k: r["tokens_per_s"] for k, r in runs.items()},
                "mfu": {k: r["mfu"] for k, r in runs.items()}}
  return s


def profile_text(results: dict) -> str:
  lines = []
  for name, r in results.items():
    split = r.get("split")
    if not split:
      continue
    step = split["step_s"]
    lines.append(f"{name}: step {step * 1e3:.1f} ms ({r['attention']['implementation']} "
                 f"attention), MFU {r['mfu']:.1%} of {r['peak_source']}")
    for k in ("matmul", "attention", "optimizer", "other", "idle"):
      v = split[k + "_s"]
      lines.append(f"  {k:<10} {v * 1e3:9.2f} ms  {v / step:6.1%}")
  return "\n".join(lines) + ("\n" if lines else "no profile window ran\n")


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="MFU, memory truth, offload and the largest model on "
                                           "one GPU, in one call")
  ap.add_argument("--out", default=DEFAULT_OUT, help="folder for gpu_check.json and "
                                                      "profile_summary.txt")
  ap.add_argument("--small", action="store_true", help="tiny shapes on any backend (a smoke "
                                                       "test of the script, not a measurement)")
  ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget in seconds")
  ap.add_argument("--only", default="", help="comma-separated phase names (see --list)")
  ap.add_argument("--list", action="store_true", help="print the phases and exit")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  ap.add_argument("--child-out", help=argparse.SUPPRESS)
  return ap


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  if args.child:
    return child(json.loads(args.child), args.child_out)
  t_start = time.perf_counter()
  todo = phases(args.small)
  names = [p["name"] for p in todo]
  if args.list:
    print("\n".join(names))
    return 0
  only = [n for n in args.only.split(",") if n]
  unknown = sorted(set(only) - set(names))
  if unknown:
    print(f"error: --only names unknown phases {', '.join(unknown)}; the phases are "
          f"{', '.join(names)}", file=sys.stderr)
    return 2
  if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
    print(f"error: --budget-s must be a positive number of seconds, got {args.budget_s}",
          file=sys.stderr)
    return 2
  try:
    versions = check_stack(args.small)
  except SystemExit as e:
    print(e, file=sys.stderr)
    return 2
  if os.path.isfile(args.out):
    print(f"error: --out {args.out} is a file; give a folder", file=sys.stderr)
    return 2
  parts = os.path.join(args.out, "parts")
  os.makedirs(parts, exist_ok=True)
  results: dict = {}
  for spec in todo:
    if only and spec["name"] not in only:
      continue
    left = args.budget_s - (time.perf_counter() - t_start)
    if left < spec["need_s"]:
      results[spec["name"]] = {"skipped": f"{left:.0f} s of the budget left, it needs about "
                                          f"{spec['need_s']} s"}
      print(f"gpu_check: {spec['name']}: skipped ({left:.0f} s left)", flush=True)
      continue
    r = run_phase(spec, parts, left, args.small)
    results[spec["name"]] = r
    if "failed" in r:
      print(f"gpu_check: {spec['name']}: failed ({r['failed']})\n{r['tail']}", flush=True)
    elif "mfu" in r:
      mem = r["memory"]
      print(f"gpu_check: {spec['name']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, "
            f"step {r['step_s']['median'] * 1e3:.1f} ms, peak {_human(mem['predicted_peak_bytes'])} "
            f"predicted, {_human(mem['allocator_peak_bytes_after_3_steps'])} by the allocator "
            f"({r['seconds']:.0f} s)", flush=True)
    elif "paths" in r:
      g, p = r["paths"]["ragged"], r["paths"]["padded"]
      print(f"gpu_check: {spec['name']}: ragged{' (emulated)' if r['emulated'] else ''} "
            f"{g['rows_per_s']:,.0f} rows/s, sends {_human(g['sent_bytes'])}; padded "
            f"{p['rows_per_s']:,.0f} rows/s, sends {_human(p['sent_bytes'])}; largest difference "
            f"{r['max_abs_difference']:.1e} ({r['seconds']:.0f} s)", flush=True)
    else:
      largest = r.get("largest") or {}
      print(f"gpu_check: {spec['name']}: {largest.get('n_layers')} layers, "
            f"{(largest.get('params') or 0) / 1e6:,.1f}M parameters, peak "
            f"{_human(largest.get('predicted_peak_bytes'))} predicted of "
            f"{_human(r['limit_bytes'])} ({r['seconds']:.0f} s)", flush=True)
  backends = {r.get("backend") for r in results.values() if r.get("backend")}
  report = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "small": args.small, "budget_s": args.budget_s, "versions": versions,
      "machine": {"python": platform.python_version(), "platform": platform.platform(),
                  "cpu_count": os.cpu_count(), "backends": sorted(backends),
                  "device_kinds": sorted({r["device_kind"] for r in results.values()
                                          if r.get("device_kind")})},
      "phases": results, "summary": summarise(results),
      "seconds": time.perf_counter() - t_start,
  }
  with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, "profile_summary.txt"), "w") as f:
    f.write(profile_text(results))
  failed = [k for k, v in results.items() if "failed" in v]
  absent = sorted({m for v in results.values() for m in v.get("imported_absent_modules", [])})
  print(f"gpu_check: {len(results) - len(failed)} of {len(results)} phases measured in "
        f"{report['seconds']:.0f} s -> {os.path.join(args.out, 'gpu_check.json')}")
  if absent:
    print(f"error: imported {', '.join(absent)}, which the GPU machine lacks", file=sys.stderr)
  return 1 if failed or absent else 0


if __name__ == "__main__":
  sys.exit(main())
