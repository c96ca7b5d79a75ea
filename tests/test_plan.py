"""The static plan: ZeRO bytes per device, DDP / ZeRO / Megatron collectives, and the CLI."""
import functools
import json
import math
import os
import subprocess
import sys

import jax
import pytest
from conftest import FAST_XLA

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.planning import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=8", "model.d_ff=256",
         "model.seq_len=32", "model.vocab_size=256", "train.batch_size=16"]
B, T, D, L = 16, 32, 64, 2
# Which model state ZeRO shards over `data`, by the first stage that shards it.
FIRST_STAGE = {"opt_state": 1, "grads": 2, "params": 3}



@functools.lru_cache(maxsize=None)
def report(mesh: str, *overrides: str) -> dict:
  return plan.plan(config.load(None, SMALL + list(overrides)), mesh)


def sharded_leaf_bytes(r: dict, spec_key: str) -> int:
  """Unsharded bytes of the parameters whose `spec_key` spec names `data`."""
  return sum(math.prod(q["shape"]) * 4 for q in r["parameters"] if "'data'" in q[spec_key])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_bytes_per_device(stage):
  r = report("8x1x1", f"parallel.zero_stage={stage}")
  assert r["zero_stage"] == stage and r["devices"] == 8
  for key, first in FIRST_STAGE.items():
    per, full = r["bytes_per_device"][key], r["unsharded_bytes"][key]
    if stage >= first:
      assert abs(8 * per - full) <= 0.05 * full, (key, per, full)
    else:
      assert per == full, (key, per, full)


def test_ddp_all_reduces_the_gradients_once():
  r = report("8x1x1", "parallel.zero_stage=0")
  assert r["config"]["precision"]["param_dtype"] == "float32"
  grads = r["unsharded_bytes"]["grads"]
  assert 0.9 * grads <= r["collectives"]["all-reduce"] <= 1.3 * grads
  assert r["collectives"]["reduce-scatter"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reduce_scatters_the_gradients(stage):
  r = report("8x1x1", f"parallel.zero_stage={stage}")
  c = r["collectives"]
  # Each device receives its 1/8 of every data-sharded gradient from one reduce-scatter.
  scattered = sharded_leaf_bytes(r, "grad_spec") / 8
  assert scattered > 0
  assert 0.9 * scattered <= c["reduce-scatter"] <= 1.1 * scattered
  # Only the few leaves ZeRO leaves replicated (and scalar metrics) are still all-reduced.
  assert c["all-reduce"] < 0.05 * r["unsharded_bytes"]["grads"]
  # The sharded parameters are whole on a device at least once a step: after the update (stage 2)
  # or per layer in the forward (stage 3).
  assert c["all-gather"] >= 0.9 * sharded_leaf_bytes(r, "opt_spec")


def test_tensor_parallel_is_near_megatron():
  r = report("1x4x1")
  megatron = 4 * L * B * T * D * 4  # 2 all-reduces forward + 2 backward per layer, fp32
  total = sum(r["collectives"].values())
  assert megatron <= total <= 1.6 * megatron, (r["collectives"], total / megatron)


def test_more_devices_than_present_is_a_config_error():
  with pytest.raises(ConfigError, match="needs 16 devices"):
    plan.plan(config.load(None, SMALL), "4x4x1", devices=jax.devices()[:8])


def cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=f"{FAST_XLA} --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [["--mesh", "3x1x1"], ["--mesh", "2by4"],
                                  ["--mesh", "2x4x1", "--set", "model.foo=1"], []])
def test_cli_bad_input_is_one_line_and_exit_2(args):
  p = cli(*args, "--json")
  assert p.returncode == 2, p.stderr
  assert p.stdout == ""
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  assert "Traceback" not in p.stderr


def test_cli_json():
  p = cli("--mesh", "2x4x1", "--json", "--set", *SMALL, "parallel.zero_stage=1")
  assert p.returncode == 0, p.stderr
  r = json.loads(p.stdout)  # the whole of stdout is one JSON object
  for key in ("devices", "mesh", "param_count", "bytes_per_device", "compiled", "collectives",
              "flops_per_step"):
    assert key in r
  assert set(r["bytes_per_device"]) >= {"params", "grads", "opt_state"}
  assert set(r["compiled"]) >= {"argument_bytes", "output_bytes", "temp_bytes"}
  assert set(r["collectives"]) == {"all-reduce", "all-gather", "reduce-scatter",
                                   "collective-permute", "all-to-all"}
  assert r["devices"] == 8
  assert r["mesh"] == {"data": 2, "model": 4, "pipeline": 1, "context": 1, "shape": "2x4x1"}
  assert r["param_count"] == sum(math.prod(q["shape"]) for q in r["parameters"])
  assert r["bytes_per_device"]["params"] == sum(q["bytes_per_device"] for q in r["parameters"])
  wq = next(q for q in r["parameters"] if q["path"] == "layers/wq")
  assert wq["logical"] == ["layers", "embed", "heads"]
  assert wq["spec"] == "P('pipeline', None, 'model')" and wq["opt_spec"] == "P('pipeline', 'data', 'model')"
  assert r["flops_per_step"] > 0 and r["model_flops_per_step"] > 0
  assert r["compiled"]["argument_bytes"] > 0

  text = plan.format_table(r)
  for q in r["parameters"]:
    assert q["path"] in text
  for word in ("opt_state", "temp_bytes", "all-reduce", "model_flops_per_step"):
    assert word in text


def test_plan_and_run_report_one_peak_memory(tmp_path):
  """One definition of peak bytes per device (arguments + outputs + temps - aliased) in both."""
  from jaxpar.train import loop
  cfg = config.load(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4",
                           "model.d_ff=64", "model.seq_len=16", "train.batch_size=8",
                           "data.source=synthetic", "train.steps=2"])
  report = plan.plan(cfg, "2x2x2")
  c = report["compiled"]
  assert c["peak_bytes"] == c["argument_bytes"] + c["output_bytes"] + c["temp_bytes"] - c["alias_bytes"]
  assert c["peak_bytes"] > c["temp_bytes"] > 0
  result = loop.run(cfg, (2, 2, 2), str(tmp_path / "wd"), progress=False, log=lambda *a: None)
  assert result.summary["peak_memory_bytes"] == c["peak_bytes"]


def test_plan_reports_remat_sequence_parallel_and_loss_scale():
  cfg = config.load(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
                           "model.seq_len=16", "train.batch_size=8", "parallel.remat=dots_saveable",
                           "parallel.sequence_parallel=true", "precision.loss_scale=dynamic"])
  on = plan.plan(cfg, "1x4x1")
  assert on["activations"] == {"remat": "dots_saveable", "sequence_parallel": True}
  assert on["loss_scale"]["kind"] == "dynamic" and on["loss_scale"]["scale"] == cfg.precision.initial_scale
  assert "remat dots_saveable, sequence parallel on, loss scale dynamic" in plan.format_table(on)
  off = plan.plan(config.override(cfg, parallel={"sequence_parallel": False}), "1x4x1")
  assert on["collectives"]["all-gather"] > off["collectives"]["all-gather"]  # seq gathered back
  # the row-parallel sums: reduce-scattered along seq instead of all-reduced
  assert on["collectives"]["reduce-scatter"] > 0 == off["collectives"]["reduce-scatter"]
  assert on["collectives"]["all-reduce"] < off["collectives"]["all-reduce"]
