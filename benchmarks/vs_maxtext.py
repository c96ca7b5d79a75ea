"""jaxpar against MaxText 0.2.5, side by side: the same JAX, the same models, the same 8 simulated
CPU devices, the two trainers alternating in one run.

python benchmarks/vs_maxtext.py --maxtext-venv DIR [--pairs N] [--steps S] [--warmup W]
                                [--only LAYOUT ...] [--out FILE]
Writes benchmarks/results/vs_maxtext.json by default (git-ignored; the committed figures are in
benchmarks/reference/vs_maxtext.json). DIR (or $MAXTEXT_VENV) is a virtual environment with
MaxText 0.2.5, as /work/shared/tools/prepare-maxtext DIR builds it (Python 3.12, JAX 0.11.1).
Both sides run in child processes of that environment's python: MaxText's trainer as it is
installed there, jaxpar's from this checkout (PYTHONPATH), so they share JAX, jaxlib and XLA.

The models (Llama/Mixtral style on both sides: RMSNorm, rotary, SwiGLU, untied head, fp32
weights and activations, layers under scan, full remat (only each layer's input kept), AdamW,
synthetic tokens, no checkpoints, no evaluation, no compilation cache):
  dense  4 layers, d_model 128, 4 heads (4 kv heads, head 32), MLP 512, vocab 256;
  moe    the same with 8 experts of width 256 in every layer, top-2, capacity factor 1.25 (MaxText:
         its one-hot dispatch, sparse_matmul=False, the only expert-parallel path it runs on the
         CPU: the other needs ragged_all_to_all, which XLA:CPU lacks).
Sequence 128, global batch 16. Both sides' parameter counts are recorded and must agree.
The layouts (jaxpar mesh data x model x pipeline / MaxText's ici_* axes):
  one_device_dense, one_device_moe  1 device (the child sees one CPU device);
  fsdp            dense 8x1x1 with ZeRO-3 / ici_fsdp_parallelism=8;
  data_tensor     dense 4x2x1 / ici_data_parallelism=4, ici_tensor_parallelism=2;
  pipeline        dense 2x1x4, gpipe, 8 microbatches / ici_data_parallelism=2,
                  ici_pipeline_parallelism=4, num_pipeline_microbatches=8;
  experts_8       moe 8x1x1, the experts over data / ici_expert_parallelism=8;
  experts_tensor  moe 4x2x1 / ici_expert_parallelism=4, ici_tensor_parallelism=2.
Per layout the runs go jaxpar, MaxText, MaxText, jaxpar (--pairs 2; the order flips each pair),
each a new process that compiles. Figures per run:
  tokens_per_sec  steady state: the batch's tokens over the median step time of the steps after
                  the first --warmup (compile included), a step's time being the interval between
                  the trainer's writes of two consecutive steps' metrics (both write every step,
                  after fetching that step's results: jaxpar train.log_every=1, MaxText's
                  metrics_file), clocked by wrapping the writer in the child; `tokens_per_sec_mean`
                  over their summed time;
  tokens_per_cpu_s  the same by the median step's CPU time of the child process (all threads):
                  on a shared machine a side that finds both cores free runs up to 2x faster by
                  the wall clock, while its CPU time per step moves much less;
  compile_s       the train step's `Lowered.compile` (XLA's compile; tracing and lowering not
                  included), timed by wrapping jax.stages.Lowered.compile in the child;
  memory          that compiled step's memory_analysis per device: argument, output, temp and
                  alias bytes, `bytes` = argument + output + temp;
  collectives     bytes per device per step by kind (all-to-all, all-gather, all-reduce,
                  reduce-scatter, collective-permute), read from the compiled step's HLO text by
                  jaxpar.analysis.hlo.collective_bytes (loops counted by trip count).
MaxText's expert layouts set moe_dispatch_no_expert_sharding=true, its expert-parallel dispatch by
all-to-all; its default keeps `expert` on the batch and gathers the expert weights instead.
The JSON holds every run, the medians per side, the ratio jaxpar / MaxText of tokens/s, the host,
the versions and the load average at the start and end; a layout MaxText cannot run on the CPU
keeps its error line. On a shared machine, read the ratios: both sides saw the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "vs_maxtext.json")
SIDES = ("jaxpar", "maxtext")
SEQ, BATCH = 128, 16

# The models, by side. jaxpar's keys are jaxpar/config.py's, MaxText's its configs/base.yml's.
JAXPAR_MODELS = {
    "dense": ["model.kind=llama", "model.n_layers=4", "model.d_model=128", "model.n_heads=4",
              "model.n_kv_heads=4", "model.d_ff=512", "model.vocab_size=256",
              f"model.seq_len={SEQ}", "model.tie_embeddings=false"],
}
JAXPAR_MODELS["moe"] = JAXPAR_MODELS["dense"] + [
    "model.n_experts=8", "model.experts_per_token=2", "model.moe_d_ff=256",
    "model.capacity_factor=1.25", "train.moe_aux_weight=0.01", "train.moe_z_weight=0"]
JAXPAR_COMMON = [f"train.batch_size={BATCH}", "parallel.remat=full",
                 "precision.param_dtype=float32",
                 "precision.compute_dtype=float32", "train.lr=3e-4", "train.weight_decay=0.1",
                 "train.clip_norm=1.0", "data.source=synthetic", "checkpoint.every=0",
                 "train.compile_cache=off"]
MAXTEXT_MODELS = {
    "dense": ["decoder_block=llama2", "base_emb_dim=128", "base_num_query_heads=4",
              "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=512", "base_num_decoder_layers=4",
              "vocab_size=256", f"max_target_length={SEQ}", "logits_via_embedding=false"],
}
MAXTEXT_MODELS["moe"] = [k for k in MAXTEXT_MODELS["dense"]
                         if not k.startswith(("decoder_block", "base_mlp_dim"))] + [
    "decoder_block=mixtral", "base_mlp_dim=256", "base_moe_mlp_dim=256", "num_experts=8",
    "num_experts_per_tok=2", "capacity_factor=1.25", "sparse_matmul=false", "megablox=false",
    "load_balance_loss_weight=0.01"]
MAXTEXT_COMMON = ["dtype=float32", "weight_dtype=float32", "remat_policy=full", "scan_layers=true",
                  "opt_type=adamw", "learning_rate=3e-4", "adam_weight_decay=0.1",
                  "gradient_clipping_threshold=1.0", "enable_dropout=false",
                  "dataset_type=synthetic", "enable_checkpointing=false",
                  "save_checkpoint_on_completion=false", "enable_tensorboard=false",
                  "hardware=cpu", "attention=dot_product", "eval_interval=-1", "log_period=100000",
                  "jax_cache_dir=", "skip_jax_distributed_system=true", "log_config=false"]
ICI = ("data", "fsdp", "tensor", "expert", "pipeline")

# name: (model, devices, jaxpar mesh, jaxpar overrides, MaxText's ici_* degrees and extra keys)
LAYOUTS = {
    "one_device_dense": ("dense", 1, "1x1x1", [], {}, []),
    "one_device_moe": ("moe", 1, "1x1x1", [], {}, []),
    "fsdp": ("dense", 8, "8x1x1", ["parallel.zero_stage=3"], {"fsdp": 8}, []),
    "data_tensor": ("dense", 8, "4x2x1", [], {"data": 4, "tensor": 2}, []),
    "pipeline": ("dense", 8, "2x1x4", ["parallel.schedule=gpipe", "parallel.microbatches=8"],
                 {"data": 2, "pipeline": 4}, ["num_pipeline_microbatches=8"]),
    "experts_8": ("moe", 8, "8x1x1", [], {"expert": 8}, ["moe_dispatch_no_expert_sharding=true"]),
    "experts_tensor": ("moe", 8, "4x2x1", [], {"expert": 4, "tensor": 2},
                       ["moe_dispatch_no_expert_sharding=true"]),
}

VERSIONS = ("import sys, json, jax, jaxlib, flax, optax, importlib.metadata as m; "
            "import maxtext.trainers.pre_train.train; "
            "print(json.dumps({'python': sys.version.split()[0], 'jax': jax.__version__, "
            "'jaxlib': jaxlib.__version__, 'flax': flax.__version__, 'optax': optax.__version__, "
            "'maxtext': m.version('maxtext')}))")


class Refusal(Exception):
  """Bad input: one sentence for the user, exit 2."""


# ---------------------------------------------------------------------------------------------
# The child: one side, one layout, in the MaxText environment's python.

def _capture_compiles() -> list:
  """Wraps jax.stages.Lowered.compile: each call's (seconds, compiled)."""
  import jax.stages
  seen = []
  original = jax.stages.Lowered.compile

  def compile(self, *args, **kwargs):
    t0 = time.perf_counter()
    compiled = original(self, *args, **kwargs)
    seen.append((time.perf_counter() - t0, compiled))
    return compiled

  jax.stages.Lowered.compile = compile
  return seen


def _memory(compiled) -> dict:
  stats = compiled.memory_analysis()
  out = {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "temp", "alias", "generated_code")}
  out["bytes"] = out["argument"] + out["output"] + out["temp"]
  return out


def _step_program(seen: list, hlo_path: str) -> dict:
  """The train step among the compiled programs (the one holding the most bytes: the state and
  a batch in, the state out); its compile seconds and memory, its HLO text written to hlo_path."""
  if not seen:
    return {"error": "no program was compiled through jax.stages.Lowered.compile"}
  seconds, compiled = max(seen, key=lambda sc: _memory(sc[1])["bytes"])
  text = compiled.as_text()
  with open(hlo_path, "w") as f:
    f.write(text)
  name = text.split("\n", 1)[0].split()[1].rstrip(",") if text.startswith("HloModule") else ""
  return {"compile_s": round(seconds, 3), "module": name, "memory": _memory(compiled),
          "programs_compiled": len(seen), "hlo_file": hlo_path}


def _step_clock(cls: type, name: str) -> list:
  """Wraps the method that writes one step's metrics row: the (wall, process CPU) seconds at each
  call. The trainer calls it once a step, after that step's results are fetched, so consecutive
  marks are a step apart on both sides."""
  marks = []
  original = getattr(cls, name)

  def mark(self, *args, **kwargs):
    marks.append((time.perf_counter(), time.process_time()))
    return original(self, *args, **kwargs)

  setattr(cls, name, mark)
  return marks


def _rates(marks: list, warmup: int) -> dict:
  """Tokens/s of the steps after the first `warmup` (compile and warm-up): by the median step's
  wall time (compared: a step slowed by other work on the machine moves it little), by the
  summed wall time, and tokens per CPU second of this process (all its threads) by the median
  step's CPU time, which other work on the machine moves less."""
  wall = [b[0] - a[0] for a, b in zip(marks[warmup - 1:], marks[warmup:])]
  cpu = [b[1] - a[1] for a, b in zip(marks[warmup - 1:], marks[warmup:])]
  if not wall:
    raise RuntimeError(f"{len(marks)} steps logged, none past the {warmup} warm-up steps")
  tokens = BATCH * SEQ
  return {"tokens_per_sec": round(tokens / statistics.median(wall), 1),
          "tokens_per_sec_mean": round(len(wall) * tokens / sum(wall), 1),
          "tokens_per_cpu_s": round(tokens / statistics.median(cpu), 1),
          "steps_timed": len(wall), "step_s": [round(x, 4) for x in wall],
          "step_cpu_s": [round(x, 4) for x in cpu]}


def _child_jaxpar(layout: str, steps: int, warmup: int, tmp: str) -> dict:
  model, devices, mesh, extra, _, _ = LAYOUTS[layout]
  import jaxpar  # noqa: F401  (its host-memory setting comes before JAX's backend starts)
  seen = _capture_compiles()
  from jaxpar.commands.train import main
  from jaxpar.train.metrics import MetricsLogger
  marks = _step_clock(MetricsLogger, "log")  # log_every=1: one call a step
  metrics = os.path.join(tmp, "metrics.jsonl")
  argv = ["--mesh", mesh, "--steps", str(steps), "--workdir", os.path.join(tmp, "wd"),
          "--metrics-file", metrics, "--no-progress", "--set", *JAXPAR_COMMON,
          *JAXPAR_MODELS[model], "train.log_every=1", *extra]
  rc = main(argv)
  if rc:
    raise RuntimeError(f"jaxpar-train exited {rc}")
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  losses = [r["loss"] for r in rows if "loss" in r]
  return {**_rates(marks, warmup), "parameters": rows[-1]["parameters"],
          "last_loss": round(losses[-1], 4) if losses else None,
          **_step_program(seen, os.path.join(tmp, "step.hlo"))}


def _child_maxtext(layout: str, steps: int, warmup: int, tmp: str) -> dict:
  model, devices, _, _, ici, extra = LAYOUTS[layout]
  seen = _capture_compiles()
  import maxtext
  from absl import app
  from maxtext.trainers.pre_train import train
  from maxtext.common.metric_logger import MetricLogger
  from maxtext.utils import max_utils
  marks = _step_clock(MetricLogger, "write_metrics_locally")  # metrics_file: one call a step
  counted = []
  count = max_utils.calculate_num_params_from_pytree

  def counting(params):
    n = count(params)
    counted.append(int(n))
    return n

  max_utils.calculate_num_params_from_pytree = counting
  metrics = os.path.join(tmp, "metrics.jsonl")
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  keys = [*MAXTEXT_COMMON, *MAXTEXT_MODELS[model], *extra,
          *(f"ici_{a}_parallelism={ici.get(a, 1)}" for a in ICI),
          f"per_device_batch_size={BATCH / devices:g}", f"steps={steps}",
          f"metrics_file={metrics}", f"base_output_directory={os.path.join(tmp, 'out')}",
          "run_name=vs_maxtext"]
  try:
    app.run(train.main, argv=["vs_maxtext", base, *keys])
  except SystemExit as e:
    if e.code not in (None, 0):
      raise RuntimeError(f"MaxText's trainer exited {e.code}") from None
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  return {**_rates(marks, warmup), "parameters": counted[0] if counted else None,
          "last_loss": round(rows[-1]["learning/loss"], 4),
          **_step_program(seen, os.path.join(tmp, "step.hlo"))}


def child(side: str, layout: str, steps: int, warmup: int, tmp: str, result: str) -> None:
  """Runs one side's trainer on `layout`; writes its figures (or its error line) to `result`."""
  t0 = time.perf_counter()
  try:
    out = (_child_jaxpar if side == "jaxpar" else _child_maxtext)(layout, steps, warmup, tmp)
  except BaseException as e:  # the error line is the result: MaxText may not run a layout on CPU
    import traceback
    traceback.print_exc()
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    out = {"error": f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]}
  out["wall_s"] = round(time.perf_counter() - t0, 2)
  with open(result, "w") as f:
    json.dump(out, f)


# ---------------------------------------------------------------------------------------------
# The parent: checks, alternation, figures.

def venv_python(venv: str | None) -> str:
  """The MaxText environment's python, or a Refusal naming what is missing."""
  if not venv:
    raise Refusal("no MaxText environment: pass --maxtext-venv DIR or set MAXTEXT_VENV "
                  "(/work/shared/tools/prepare-maxtext DIR builds one)")
  py = os.path.join(venv, "bin", "python")
  if not os.path.isfile(py) or not os.access(py, os.X_OK):
    raise Refusal(f"--maxtext-venv {venv} has no bin/python: give a virtual environment built "
                  "by prepare-maxtext DIR")
  return py


def child_env(devices: int, side: str) -> dict:
  """No inherited device count, cache, cluster or paths; `devices` simulated CPU devices; this
  checkout's jaxpar on the path of jaxpar's side only."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "JAX_", "XLA_", "SLURM_", "OMPI_", "PMI_", "PYTHON",
                              "VIRTUAL_ENV", "LIBTPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  if side == "jaxpar":
    env["PYTHONPATH"] = ROOT
  return env


def versions(py: str) -> dict:
  """The environment's Python, JAX, Flax, Optax and MaxText versions; a Refusal if MaxText's
  trainer or jaxpar does not import there."""
  r = subprocess.run([py, "-c", VERSIONS], capture_output=True, text=True,
                     env=child_env(1, "maxtext"), cwd=tempfile.gettempdir())
  if r.returncode != 0:
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise Refusal(f"MaxText's trainer does not import with {py} ({last}): build the environment "
                  "with prepare-maxtext DIR")
  found = json.loads(r.stdout.strip().splitlines()[-1])
  r = subprocess.run([py, "-c", "import jaxpar.commands.train"], capture_output=True, text=True,
                     env=child_env(1, "jaxpar"), cwd=ROOT)
  if r.returncode != 0:
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise Refusal(f"jaxpar does not import with {py} ({last}): install what it names there, "
                  f"e.g. {py} -m pip install pyyaml tqdm (without touching MaxText's pins)")
  return found


def one_run(py: str, side: str, layout: str, steps: int, warmup: int) -> dict:
  """One child: `side`'s trainer on `layout`; its figures, with the collectives read from its
  compiled step's HLO."""
  from jaxpar.analysis import hlo
  devices = LAYOUTS[layout][1]
  with tempfile.TemporaryDirectory(prefix="vs-maxtext-") as tmp:
    result = os.path.join(tmp, "result.json")
    cmd = [py, os.path.abspath(__file__), "--child", side, "--layout", layout, "--steps",
           str(steps), "--warmup", str(warmup), "--tmp", tmp, "--result", result]
    load = os.getloadavg()[0]
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(devices, side),
                       cwd=tmp)
    if not os.path.exists(result):
      tail = "\n".join(r.stderr.strip().splitlines()[-20:])
      return {"error": f"the {side} child exited {r.returncode} without a result", "log": tail}
    with open(result) as f:
      out = json.load(f)
    out["load_average_1min_before"] = round(load, 2)
    if "hlo_file" in out:
      with open(out.pop("hlo_file")) as f:
        text = f.read()
      out["collectives"] = hlo.collective_bytes(text)
    if "error" in out:
      out["log"] = "\n".join(r.stderr.strip().splitlines()[-8:])
  return out


def summarise(runs: dict) -> dict:
  """Medians per side of the timed figures; the compiled figures of each side's first run."""
  out = {}
  for side, rs in runs.items():
    ok = [r for r in rs if "error" not in r]
    if not ok:
      out[side] = {"error": rs[0]["error"]}
      continue
    out[side] = {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in ok),
                 "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in ok),
                 "compile_s": statistics.median(r["compile_s"] for r in ok),
                 "parameters": ok[0]["parameters"], "memory": ok[0]["memory"],
                 "collectives": ok[0]["collectives"], "runs_ok": len(ok)}
  if all("error" not in out[s] for s in SIDES):
    j, m = out["jaxpar"], out["maxtext"]
    out["ratio_tokens_per_sec"] = round(j["tokens_per_sec"] / m["tokens_per_sec"], 3)
    out["ratio_tokens_per_cpu_s"] = round(j["tokens_per_cpu_s"] / m["tokens_per_cpu_s"], 3)
    out["ratio_compile_s"] = round(j["compile_s"] / m["compile_s"], 3)
    out["ratio_bytes"] = round(j["memory"]["bytes"] / m["memory"]["bytes"], 3)
    out["parameters_agree"] = j["parameters"] == m["parameters"]
  return out


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--maxtext-venv", default=os.environ.get("MAXTEXT_VENV"),
                 help="a virtual environment with MaxText 0.2.5 (default: $MAXTEXT_VENV)")
  p.add_argument("--pairs", type=int, default=2,
                 help="pairs of runs per side and layout, the order flipped each pair (default 2)")
  p.add_argument("--steps", type=int, default=16, help="steps per run (default 16)")
  p.add_argument("--warmup", type=int, default=4,
                 help="first steps left out of tokens/s (default 4)")
  p.add_argument("--only", action="append", choices=sorted(LAYOUTS), help="a layout (repeatable)")
  p.add_argument("--out", default=DEFAULT_OUT)
  # the child's own arguments (the parent starts it)
  p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
  p.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
  p.add_argument("--tmp", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  return p


def main(argv: list[str] | None = None) -> dict | None:
  t0 = time.perf_counter()
  args = parser().parse_args(argv)
  if args.child:
    child(args.child, args.layout, args.steps, args.warmup, args.tmp, args.result)
    return None
  try:
    if args.warmup < 1 or args.steps < args.warmup + 2:
      raise Refusal(f"--steps {args.steps} --warmup {args.warmup}: warmup must be at least 1 and "
                    "steps at least warmup + 2")
    py = venv_python(args.maxtext_venv)
    found = versions(py)
  except Refusal as e:
    print(f"vs_maxtext: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
  import _jaxpar_bench
  result = {"what": "jaxpar and MaxText 0.2.5 on the same JAX, models and simulated CPU devices, "
                    "alternating",
            "host_cpu": _jaxpar_bench.host_cpu(), "versions": found,
            "maxtext_venv": os.path.abspath(args.maxtext_venv),
            "steps": args.steps, "warmup": args.warmup, "pairs": args.pairs,
            "batch": BATCH, "seq_len": SEQ, "tokens_per_step": BATCH * SEQ,
            "models": {"jaxpar": {"common": JAXPAR_COMMON, **JAXPAR_MODELS},
                       "maxtext": {"common": MAXTEXT_COMMON, **MAXTEXT_MODELS}},
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "layouts": {}}
  for name in (args.only or LAYOUTS):
    model, devices, mesh, extra, ici, mt_extra = LAYOUTS[name]
    runs: dict[str, list] = {s: [] for s in SIDES}
    for pair in range(args.pairs):
      for side in (SIDES if pair % 2 == 0 else SIDES[::-1]):
        if side == "maxtext" and runs[side] and "error" in runs[side][0]:
          continue  # MaxText cannot run this layout here: once is enough to say so
        row = one_run(py, side, name, args.steps, args.warmup)
        runs[side].append(row)
        brief = {k: row.get(k)
                 for k in ("tokens_per_sec", "tokens_per_cpu_s", "compile_s", "error")}
        print(f"{name} {side}: {brief}", flush=True)
    result["layouts"][name] = {
        "model": model, "devices": devices, "jaxpar_mesh": mesh, "jaxpar_overrides": extra,
        "maxtext_ici": {a: ici.get(a, 1) for a in ICI}, "maxtext_keys": mt_extra,
        **summarise(runs), "runs": runs}
  result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
  result["wall_s"] = round(time.perf_counter() - t0, 1)
  _jaxpar_bench.write_json(result, args.out)
  print(json.dumps({n: {k: lay.get(k) for k in ("ratio_tokens_per_sec", "ratio_tokens_per_cpu_s",
                                                "ratio_compile_s")}
                    for n, lay in result["layouts"].items()}))
  return result


if __name__ == "__main__":
  main()
