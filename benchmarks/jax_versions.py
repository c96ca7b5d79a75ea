"""The main job's speed and compile time on two Python/JAX installs, side by side on one machine.

python benchmarks/jax_versions.py --python A --python B [--pairs N] [--steps S] [--out FILE]
Writes benchmarks/results/jax_versions.json by default (git-ignored; the committed figures are in
benchmarks/reference/jax_versions.json).

Each interpreter (a virtual environment's python with jaxpar installed) runs scripts/train.py on
the default model with synthetic data, on 8 simulated CPU devices, for each case:
  fsdp         8x1x1 with ZeRO-3 (parameters, gradients and optimizer state over data);
  data_tensor  2x4x1: data 2 x tensor 4.
The runs alternate (A B, then B A, ...) so that load on the machine falls on both sides alike,
each from a new workdir and with no compilation cache (every run compiles). Figures per run:
tokens/s over the run after its first log interval (the summary's `tokens_per_sec`, which leaves
the compile out) and the step's compile seconds (`compile_s`). The JSON holds every run, the
medians per side and case, and the ratios B / A of the medians.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "jax_versions.json")
CASES = {
    "fsdp": ("8x1x1", ["parallel.zero_stage=3"]),
    "data_tensor": ("2x4x1", ["parallel.zero_stage=0"]),
}


def child_env() -> dict:
  """No inherited device count, cache or cluster; 8 simulated devices."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                              "SLURM_", "OMPI_", "PMI_", "VIRTUAL_ENV"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return env


def versions(python: str) -> dict:
  """Python, jax, jaxlib and flax versions of the interpreter `python`."""
  code = ("import sys, jax, jaxlib, flax, json; print(json.dumps({'python': sys.version.split()[0],"
          " 'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'flax': flax.__version__}))")
  out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=child_env(),
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def one_run(python: str, mesh: str, overrides: list[str], steps: int) -> dict:
  """train.py under `python` for `steps` steps; the summary's figures."""
  with tempfile.TemporaryDirectory(prefix="jaxpar-versions-") as tmp:
    metrics = os.path.join(tmp, "m.jsonl")
    cmd = [python, TRAIN, "--mesh", mesh, "--steps", str(steps), "--workdir",
           os.path.join(tmp, "wd"), "--metrics-file", metrics, "--no-progress", "--set",
           "data.source=synthetic", "train.compile_cache=off", "checkpoint.every=0",
           f"train.log_every={max(steps // 4, 1)}", *overrides]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    if r.returncode != 0:
      raise SystemExit(f"{python} train.py failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    with open(metrics) as f:
      final = [json.loads(line) for line in f][-1]
  return {"tokens_per_sec": round(final["tokens_per_sec"], 1),
          "compile_s": round(final["compile_s"], 3),
          "wall_s": round(time.perf_counter() - t0, 2)}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--python", action="append", required=True,
                 help="an interpreter with jaxpar installed; give it twice (A, then B)")
  p.add_argument("--pairs", type=int, default=2, help="alternating pairs per case (default 2)")
  p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
  p.add_argument("--only", choices=sorted(CASES), help="one case")
  p.add_argument("--out", default=DEFAULT_OUT)
  return p


def main(argv: list[str] | None = None) -> dict:
  p = parser()
  args = p.parse_args(argv)
  if len(args.python) != 2:
    p.error("--python takes two interpreters: A, then B")
  sides = [{"python": py, **versions(py)} for py in args.python]
  result = {"what": "the main job's tokens/s and compile time, two JAX installs alternating",
            "host_cpu": _jaxpar_bench.host_cpu(), "steps": args.steps, "pairs": args.pairs,
            "load_average_at_start": os.getloadavg(), "sides": sides, "cases": {}}
  for name in ([args.only] if args.only else CASES):
    mesh, overrides = CASES[name]
    runs: list[list[dict]] = [[], []]
    for pair in range(args.pairs):
      for side in ((0, 1) if pair % 2 == 0 else (1, 0)):
        row = one_run(args.python[side], mesh, overrides, args.steps)
        runs[side].append(row)
        print(f"{name} {sides[side]['jax']}: {row}", flush=True)
    med = [{k: statistics.median(r[k] for r in rs) for k in ("tokens_per_sec", "compile_s")}
           for rs in runs]
    result["cases"][name] = {
        "mesh": mesh, "overrides": overrides, "runs": {sides[i]["jax"]: runs[i] for i in (0, 1)},
        "median": {sides[i]["jax"]: med[i] for i in (0, 1)},
        "ratio_b_over_a": {k: round(med[1][k] / med[0][k], 3) for k in med[0]}}
  result["load_average_at_end"] = os.getloadavg()
  _jaxpar_bench.write_json(result, args.out)
  print(json.dumps({n: c["ratio_b_over_a"] for n, c in result["cases"].items()}))
  return result


if __name__ == "__main__":
  main()
