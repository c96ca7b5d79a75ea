"""Time to first step and compile time: a cold start, a restart, and a new run of the same layout.

python benchmarks/startup.py [--only default|gpt_medium] [--repeat N] [--out FILE]
Writes benchmarks/results/startup.json by default (git-ignored; the committed figures are in
benchmarks/reference/startup.json).

Each case runs scripts/train.py three times as subprocesses, all with one fresh compilation cache
folder (train.compile_cache) that nothing else uses:
  cold     an empty cache and a new workdir: every program is compiled;
  restart  the same command again in the same workdir: it resumes the checkpoint the cold run
           saved when it was stopped, with the cache the cold run filled;
  new_run  the same command in another workdir: a new run of the same layout, same cache.
The cold run compiles the step (past JAX's cache) and keeps it in jaxpar's step store
(jaxpar/train/executables.py), so the restart and the new run load it without tracing
(`step_store: hit`); their `compile_s` is that load, the entry's MAC check included. JAX's own
programs (the init's, the helpers') are kept sealed as well (jaxpar/train/cache_folder.py) and
checked as they load: `mac_check` times that check alone, in this process, over every entry the
runs left (both subfolders, each entry read once, then checked `CHECK_REPEAT` times; the median
of wall and of CPU seconds), against the restart's `startup_s`. With --repeat N each case runs
N times, each from a fresh cache, and the ratios are the medians (with their ranges). Each run starts once the files of the one before are on disk
(os.sync), as a restart after a preemption does.
Each run is stopped by SIGTERM once its first metrics row is written (it saves a checkpoint and
exits 0, as a preempted job does). Time to first step is wall seconds from starting the process
to that row (Python and JAX start-up, data, state, compile and one step); compile time is the
step's compile as the run reports it (`compile_s`), and `first_step_s` the first step's own
time, which no cache removes; `startup_s` is the time to first step less that step's own
computation, i.e. everything before the first step starts (process, data, state or restore,
compile). The child's CPU seconds are recorded beside
the wall ones: on a shared machine other processes stretch wall time, far less CPU time. The
three runs use one command, so one compiled program: `--steps` and train.steps are compiled
into the learning-rate schedule, and a restart with another value compiles again.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "startup.json")
# name -> (mesh, train.py arguments). gpt_medium's global batch is cut from 64 to 8 sequences
# (one per data shard): the compiled program is the config's own layout, and a step on this CPU
# takes seconds instead of a minute.
CASES = {
    "default": ("2x4x1", ["--set", "parallel.zero_stage=3", "data.source=synthetic"]),
    "gpt_medium": ("8x1x1", ["--config", os.path.join(ROOT, "configs", "gpt_medium.yaml"),
                             "--set", "data.source=synthetic", "train.batch_size=8"]),
}
STEPS = 20  # never reached: each run is stopped after its first step
CHECK_REPEAT = 7


def child_env() -> dict:
  """No inherited device count, cache or cluster: each run is what a user's first command is."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                              "SLURM_", "OMPI_", "PMI_"))}
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


def one_run(mesh: str, args: list[str], workdir: str, cache: str, metrics: str) -> dict:
  """Starts train.py, waits for its first metrics row, stops it with SIGTERM; the figures."""
  if os.path.exists(metrics):
    os.remove(metrics)
  cmd = [sys.executable, TRAIN, "--mesh", mesh, "--steps", str(STEPS), "--workdir", workdir,
         "--metrics-file", metrics, "--no-progress", *args, f"train.compile_cache={cache}",
         "train.log_every=1"]
  os.sync()  # the previous run's checkpoint on disk first: its write-back is not this run's time
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=child_env(), cwd=ROOT)
  first = None
  while p.poll() is None:
    if os.path.exists(metrics):
      with open(metrics) as f:
        line = f.readline()
      if line.endswith("\n"):
        first, t_first = json.loads(line), time.perf_counter() - t0
        break
    time.sleep(0.01)
  if p.poll() is None:
    p.send_signal(signal.SIGTERM)
  out, _ = p.communicate(timeout=1200)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if first is None or p.returncode != 0:
    raise SystemExit(f"train.py failed (exit {p.returncode}):\n{out[-3000:]}")
  return {"time_to_first_step_s": round(t_first, 3), "compile_s": round(first["compile_s"], 3),
          # what a restart can save: everything before the first step starts computing
          "startup_s": round(t_first - first["step_time_s"], 3),
          # the first interval's time: the first step's own computation (and the first
          # collectives), which no cache removes
          "first_step_s": round(first["step_time_s"], 3),
          "compile_cache": first["compile_cache"], "step_store": first.get("step_store"),
          "first_step": first["step"],
          "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3),
          "total_wall_s": round(time.perf_counter() - t0, 3)}


def folder_bytes(path: str) -> tuple[int, int]:
  files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
  return len(files), sum(os.path.getsize(f) for f in files)


def mac_check(cache: str) -> dict:
  """Seconds the MAC check of every entry in the cache's two subfolders takes (what a run that
  loads all of them spends checking), by subfolder: entries, bytes, median wall and CPU s."""
  from jaxpar.train import cache_folder, executables
  out = {}
  for sub, magic, suffix in ((cache_folder.JAX_FOLDER, cache_folder.PROGRAM_MAGIC,
                              cache_folder.PROGRAM_SUFFIX),
                             (executables.FOLDER, executables.MAGIC, executables.SUFFIX)):
    folder = cache_folder.open_folder(cache, sub)
    blobs = [(n[:-len(suffix)], folder.read(n)) for n in sorted(os.listdir(folder.path))
             if n.endswith(suffix) and not n.startswith(".")]
    wall, cpu = [], []
    for _ in range(CHECK_REPEAT):
      w0, c0 = time.perf_counter(), time.process_time()
      for key, blob in blobs:
        if cache_folder.unseal(magic, key, blob)[1] is not None:
          raise SystemExit(f"an entry of {folder.path} fails its check")
      wall.append(time.perf_counter() - w0)
      cpu.append(time.process_time() - c0)
    out[sub] = {"entries": len(blobs), "bytes": sum(len(b) for _, b in blobs),
                "check_wall_s": round(statistics.median(wall), 5),
                "check_cpu_s": round(statistics.median(cpu), 5)}
  return out


def case(name: str) -> dict:
  mesh, args = CASES[name]
  tmp = tempfile.mkdtemp(prefix=f"jaxpar-startup-{name}-")
  try:
    cache = os.path.join(tmp, "cache")
    rows = {}
    rows["cold"] = one_run(mesh, args, os.path.join(tmp, "wd"), cache, os.path.join(tmp, "m"))
    entries, size = folder_bytes(cache)
    rows["restart"] = one_run(mesh, args, os.path.join(tmp, "wd"), cache, os.path.join(tmp, "m"))
    rows["new_run"] = one_run(mesh, args, os.path.join(tmp, "wd2"), cache, os.path.join(tmp, "m"))
    checked = mac_check(cache)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  cold = rows["cold"]
  ratios = {f"{run}_{key}_vs_cold": round(rows[run][key] / cold[key], 3)
            for run in ("restart", "new_run")
            for key in ("compile_s", "time_to_first_step_s", "startup_s")}
  check_s = sum(c["check_wall_s"] for c in checked.values())
  ratios["mac_check_s_vs_restart_startup_s"] = round(check_s / rows["restart"]["startup_s"], 5)
  return {"mesh": mesh, "args": args, "runs": rows, "ratios": ratios,
          "cache_entries": entries, "cache_bytes": size, "mac_check": checked}


def repeated(name: str, times: int) -> dict:
  """`case` `times` times, each from a fresh cache and workdir; the ratios' medians beside
  each repetition's figures (a shared 2-core machine moves single runs by several percent)."""
  reps = [case(name) for _ in range(times)]
  if times == 1:
    return reps[0]
  medians = {k: round(statistics.median(r["ratios"][k] for r in reps), 3)
             for k in reps[0]["ratios"]}
  return {"mesh": reps[0]["mesh"], "args": reps[0]["args"], "ratios": medians,
          "ratio_ranges": {k: [min(r["ratios"][k] for r in reps), max(r["ratios"][k] for r in reps)]
                           for k in medians},
          "repetitions": reps}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", choices=sorted(CASES), action="append",
                 help="run only this case (repeatable)")
  p.add_argument("--repeat", type=int, default=1,
                 help="run each case this many times; the ratios are then their medians")
  p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  import jax
  result = {"host_cpu": _jaxpar_bench.host_cpu(), "jax": jax.__version__,
            "load_average_at_start": os.getloadavg(), "cases": {}}
  for name in args.only or list(CASES):
    result["cases"][name] = repeated(name, args.repeat)
    print(json.dumps({name: result["cases"][name]["ratios"]}), flush=True)
  result["load_average_at_end"] = os.getloadavg()
  _jaxpar_bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
