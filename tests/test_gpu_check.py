"""benchmarks/gpu_check.py, the one-call GPU check, kept runnable on CPU (`--small`).

The GPU machine lacks tensorflow-datasets, grain, array_record and tensorboardX: the check runs
here with those imports made to fail, so a dependency on them cannot creep in unnoticed.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

BLOCKER = """
import importlib.abc, sys
ABSENT = {"tensorflow_datasets", "grain", "array_record", "tensorboardX"}
class _Absent(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ABSENT:
      raise ImportError(f"{name} is not installed on the GPU machine")
    return None
sys.meta_path.insert(0, _Absent())
"""


def load():
  spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def run(args, tmp_path, block=True):
  env = dict(os.environ)
  if block:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_the_blocker_blocks(tmp_path):
  # Otherwise the test below would prove nothing.
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(BLOCKER)
  r = subprocess.run([sys.executable, "-c", "import tensorflow_datasets"], capture_output=True,
                     text=True, env={**os.environ, "PYTHONPATH": str(site)})
  assert r.returncode != 0 and "not installed on the GPU machine" in r.stderr


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("gpu_check")
  out = tmp / "out"
  # Every train phase runs measure_train; gpt (with the profiler window) stands for them here.
  r = run(["--small", "--out", str(out), "--only", "gpt,largest_offload"], tmp)
  assert r.returncode == 0, r.stdout + r.stderr
  return json.loads((out / "gpu_check.json").read_text()), (out / "profile_summary.txt").read_text()


def test_small_check_measures_without_the_modules_the_gpu_machine_lacks(small_report):
  report, summary = small_report
  phases = report["phases"]
  assert set(phases) == {"gpt", "largest_offload"}
  r = phases["gpt"]
  assert r["imported_absent_modules"] == [] == phases["largest_offload"]["imported_absent_modules"]
  assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
  assert r["loss"]["last"] < r["loss"]["first"]  # it trained
  # The step split comes from the profiler window: matmuls are found, and no category covers
  # more than the ops did, nor the ops more than the step.
  split = phases["gpt"]["split"]
  assert split["matmul_s"] > 0 and split["other_s"] > 0
  parts = sum(split[k + "_s"] for k in ("matmul", "attention", "optimizer", "other"))
  assert split["busy_s"] <= split["step_s"] * 1.05
  assert parts <= split["busy_s"] * 1.001 + 1e-6
  assert "matmul" in summary and "optimizer" in summary
  s = report["summary"]
  offload = load().summarise({"gpt": r, "gpt_offload": r})["offload"]
  assert set(offload) >= {"device_peak_bytes", "host_bytes_on", "step_time_cost"}
  moe = load().summarise({"llama": r, "llama_moe": r})["moe"]
  assert moe["tokens_per_s"] == {"dense": r["tokens_per_s"], "moe": r["tokens_per_s"]}
  moe = load().summarise({"llama": r, "llama_moe": r, "llama_moe_capacity": r})["moe"]
  assert set(moe["tokens_per_s"]) == {"dense", "moe", "moe_capacity"}
  specs = {spec["name"]: spec for spec in load().phases(small=True)}
  assert specs["llama_moe_capacity"]["overrides"]["model.capacity_factor"] == 1.25
  assert "model.capacity_factor" not in specs["llama_moe"]["overrides"]
  # --small's stand-in device has 4 MiB: the search lands close under it, not just anywhere
  # that fits (the first two compiled depths, 1 and 2 layers, take about 2 MiB).
  largest = s["largest_offload"]
  assert largest["ok"] and largest["n_layers"] > 2
  assert 0.7 * 4 * 2**20 < largest["predicted_peak_bytes"] <= 0.95 * 4 * 2**20


def test_the_moe_exchange_phase_runs_the_ragged_path_against_the_padded_one():
  """--small's moe_exchange phase, in this process (its 8 simulated CPU devices): the ragged
  exchange, emulated on the CPU, gives the padded path's rows and gradients exactly, and the
  bytes it would send are the real rows', under the padded buffers'."""
  from jaxpar.parallel import expert
  spec = next(p for p in load().phases(small=True) if p["name"] == "moe_exchange")
  r = load().measure_exchange(spec)
  assert expert.RAGGED is None  # put back
  assert r["emulated"] and r["devices"] == 8 and r["max_abs_difference"] == 0.0
  g, p = r["paths"]["ragged"], r["paths"]["padded"]
  assert g["sent_bytes"] < p["sent_bytes"] == 4 * 8 * 256 * 64 * 4
  assert g["rows_per_s"] > 0 and p["rows_per_s"] > 0
  s = load().summarise({"moe_exchange": r})["moe_exchange"]
  assert s["sent_bytes_ragged"] == g["sent_bytes"] and s["max_abs_difference"] == 0.0


def test_the_predicted_peak_is_plan_pys(small_report):
  from jaxpar import config as jconfig
  from jaxpar.planning import plan
  report, _ = small_report
  r = report["phases"]["gpt"]
  cfg = jconfig.load(None, [f"{k}={v}" for k, v in r["config"].items()] + [
      "precision.compute_dtype=bfloat16", "precision.param_dtype=float32",
      "train.warmup_steps=1", "data.source=synthetic"])
  assert plan.plan(cfg, "1x1x1")["compiled"]["peak_bytes"] == r["memory"]["predicted_peak_bytes"]


def test_a_wrong_stack_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
  mod = load()
  monkeypatch.setitem(mod.NEEDS, "flax", "99.0")
  assert mod.main(["--small", "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: gpu_check needs flax >= 99.0, found ") and "\n" not in err
  assert not (tmp_path / "o").exists()


def test_a_gpu_run_without_the_cuda_plugin_is_one_line(tmp_path, monkeypatch, capsys):
  mod = load()
  monkeypatch.setattr(mod.md, "distributions", lambda: [])  # a stack without any CUDA plugin
  assert mod.main(["--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "CUDA plugin" in err
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, says", [(["--only", "nope"], "unknown phases nope"),
                                        (["--budget-s", "nan"], "--budget-s must be")])
def test_bad_arguments_are_one_line(tmp_path, args, says):
  r = run(["--small", "--out", str(tmp_path / "o"), *args], tmp_path, block=False)
  assert r.returncode == 2 and says in r.stderr and r.stderr.strip().count("\n") == 0
