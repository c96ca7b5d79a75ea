"""Layout search: the ZeRO paper's model-state bytes, the enumeration, and --auto's ranking."""
import json
import os
import subprocess
import sys

import pytest
from conftest import FAST_XLA

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.planning import autoplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=f"{FAST_XLA} --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_zero_paper_model_states():
  # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, 64 devices, mixed-precision Adam:
  # fp16 params and grads (2 + 2 bytes) and K = 12 bytes of optimizer state per parameter.
  table = autoplan.zero_table(7.5e9, 64, 2, 2, 12)
  assert [round(b / GB, 2) for b in table] == [120.0, 31.41, 16.64, 1.88]


def test_cli_analytic_prints_the_zero_paper_figures():
  p = cli("--analytic", "--devices", "64", "--params", "7.5e9", "--state-bytes", "2,2,12",
          "--device-kind", "a100", "--set", "train.batch_size=64")
  assert p.returncode == 0, p.stderr
  for line in ("ZeRO-0: 120 GB", "ZeRO-1: 31.4 GB", "ZeRO-2: 16.6 GB", "ZeRO-3: 1.88 GB"):
    assert line in p.stdout, p.stdout
  # 120 GB of model state is over an A100's 80 GB: pure data parallelism without ZeRO is rejected.
  assert "1 over the memory budget" in p.stdout


def test_a_budget_nothing_fits_is_exit_1_naming_the_least_memory():
  p = cli("--analytic", "--devices", "64", "--params", "7.5e9", "--state-bytes", "2,2,12",
          "--device-kind", "a100", "--set", "train.batch_size=64", "--memory-per-device", "1e9")
  assert p.returncode == 1, p.stderr
  # ZeRO-3 on 64-way data parallelism holds the least: the paper's 1.88 GB.
  assert p.stdout.rstrip().endswith("no layout fits the memory budget; the least memory is "
                                    "64x1x1 ZeRO-3's 1.88 GB per device"), p.stdout
  j = cli("--analytic", "--devices", "64", "--params", "7.5e9", "--state-bytes", "2,2,12",
          "--device-kind", "a100", "--set", "train.batch_size=64", "--memory-per-device", "1e9",
          "--json")
  assert j.returncode == 1 and json.loads(j.stdout)["ranked"] == [], j.stderr


def test_layouts_of_the_default_model_on_8_devices():
  cfg = config.load(None, [])  # 4 layers, 4 heads, batch 16
  lays, ruled_out = autoplan.layouts(cfg, 8)
  meshes = {lay.mesh for lay in lays}
  assert (1, 8, 1) not in meshes and (1, 1, 8) not in meshes  # 4 heads, 4 layers
  assert {(8, 1, 1), (4, 2, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4)} <= meshes
  assert any("model.n_heads=4 is not divisible by model=8" in r for r in ruled_out)
  assert all(lay.zero_stage == 0 for lay in lays if lay.mesh[0] == 1)  # ZeRO shards over data
  assert {lay.zero_stage for lay in lays if lay.mesh == (8, 1, 1)} == {0, 1, 2, 3}
  # circular with 2 virtual stages needs 2P | 4 layers: pipeline 2 only
  assert {lay.mesh[2] for lay in lays if lay.schedule == "circular"} == {2}
  assert len(lays) == len(set(lays))


@pytest.fixture(scope="module")
def auto_default():
  """--auto on 8 simulated devices for the default model, the 2 layouts predicted fastest."""
  p = cli("--auto", "--devices", "8", "--max-candidates", "2", "--json")
  assert p.returncode == 0, p.stderr
  return json.loads(p.stdout)


def test_auto_ranks_the_default_model(auto_default):
  r = auto_default
  assert r["devices"] == 8 and r["compiled"] == 2 and r["stopped_early"] == "--max-candidates 2"
  assert r["layouts"] > 50  # meshes x ZeRO stages x schedules x microbatches
  ranked = r["ranked"]
  assert len(ranked) == 2 and [x["rank"] for x in ranked] == [1, 2]
  # fastest first; predictions within autoplan.TIE of each other, the one with less memory first
  for a, b in zip(ranked, ranked[1:]):
    assert a["step_s"] <= b["step_s"] * autoplan.TIE
    if a["step_s"] > b["step_s"]:
      assert a["memory_bytes"] <= b["memory_bytes"]
  for x in ranked:
    assert x["source"] == "compiled" and x["memory_bytes"] <= r["budget_bytes"]
    assert x["step_s"] == pytest.approx(x["compute_s"] + x["collective_s"])
    assert f"fits with ZeRO-{x['zero_stage']}" in x["why"]
  assert "fastest predicted step" in ranked[0]["why"]
  text = autoplan.format_result(r)
  assert "STOPPED EARLY (--max-candidates 2): compiled 2 of" in text
  assert ranked[0]["layout"] in text


def test_budget_rejects_what_does_not_fit(auto_default):
  rows = [dict(x) for x in auto_default["ranked"]]
  peaks = sorted(x["memory_bytes"] for x in rows)
  budget = (peaks[0] + peaks[-1]) / 2
  fit, over = autoplan.rank(rows, budget)
  assert fit and over and len(fit) + len(over) == len(rows)
  assert all(x["memory_bytes"] <= budget for x in fit)
  assert all(x["memory_bytes"] > budget for x in over)
  assert not autoplan.rank(rows, peaks[0] - 1)[0]


def test_ranked_bytes_are_the_compiled_programs(auto_default):
  # Ground truth outside the ranking: plan.py's compiled program for each layout --auto ranked
  # (the persistent compilation cache makes these two compiles loads). A budget between their
  # peaks then rejects exactly the layout whose compiled step needs more than it.
  from jaxpar.planning import plan
  cfg = autoplan.for_device(config.load(None, []), "cpu")
  compiled = {}
  for row in auto_default["ranked"]:
    lay = autoplan.Layout(tuple(int(s) for s in row["mesh"].split("x")), row["zero_stage"],
                          row["schedule"] or "", row["microbatches"] or 1, row["virtual_stages"])
    assert str(lay) == row["layout"]
    compiled[row["layout"]] = plan.plan(lay.apply(cfg), lay.mesh)["compiled"]["peak_bytes"]
    assert row["memory_bytes"] == compiled[row["layout"]], row["layout"]
  least, most = sorted(compiled.values())[0], sorted(compiled.values())[-1]
  assert least < most  # ZeRO-2 and ZeRO-0 of 8x1x1: the budget below separates them
  budget = (least + most) / 2
  fit, over = autoplan.rank([dict(x) for x in auto_default["ranked"]], budget)
  assert [x["layout"] for x in over] == [k for k, v in compiled.items() if v > budget]
  assert [x["layout"] for x in fit] == [k for k, v in compiled.items() if v <= budget]


@pytest.mark.parametrize("args", [["--auto"], ["--auto", "--devices", "8", "--mesh", "8x1x1"],
                                  ["--auto", "--devices", "8", "--memory-per-device", "lots"],
                                  ["--auto", "--devices", "2", "--time-limit", "nan"],
                                  ["--analytic", "--devices", "2", "--params", "inf", "--json"],
                                  ["--analytic", "--devices", "2", "--state-bytes", "nan,1,1"]])
def test_cli_bad_search_input_is_one_line_and_exit_2(args):
  p = cli(*args)
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr


def test_cli_device_kinds_are_autoplans():
  import importlib.util
  spec = importlib.util.spec_from_file_location("plan_script", os.path.join(ROOT, "scripts", "plan.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  assert script.autoplan_kinds() == autoplan.DEVICE_KINDS


def test_no_layout_on_the_devices_is_a_config_error():
  with pytest.raises(ConfigError, match=r"no layout of this model runs on 7 devices: every mesh is "
                                        r"ruled out \(mesh 7x1x1 .*not divisible by data=7"):
    autoplan.layouts(config.load(), 7)


def test_a_tie_goes_to_the_layout_with_less_memory():
  row = lambda layout, step_s, memory: {
      "layout": layout, "step_s": step_s, "memory_bytes": memory, "link_bytes": 1, "bubble": 0,
      "collective_s": 0.1, "zero_stage": 0, "source": "compiled"}
  rows = [row("b", 1.00001, 5), row("a", 1.0, 9), row("c", 2.0, 1)]
  fit, over = autoplan.rank(rows, budget=10)
  assert [r["layout"] for r in fit] == ["b", "a", "c"] and not over
  assert fit[1]["why"].startswith("ties the fastest, holds more memory")


def test_a_long_sequence_adds_context_layouts_with_the_rings_bytes():
  short, _ = autoplan.layouts(config.load(None, []), 8)  # T 128: no context axis
  assert all(len(lay.mesh) == 3 for lay in short)
  cfg = config.load(None, [f"model.seq_len={autoplan.CONTEXT_MIN_SEQ}", "train.batch_size=8"])
  lays, _ = autoplan.layouts(cfg, 8)
  meshes = {lay.mesh for lay in lays}
  assert {(4, 1, 1, 2), (2, 2, 1, 2), (1, 1, 1, 8), (2, 1, 1, 4)} <= meshes
  # with a pipeline too, each schedule (attention all-gathered inside the stages)
  piped = {(lay.mesh, lay.schedule) for lay in lays if len(lay.mesh) == 4 and lay.mesh[2] > 1}
  assert {((1, 1, 2, 4), s) for s in autoplan.SCHEDULES} <= piped
  assert {((2, 1, 2, 2), s) for s in autoplan.SCHEDULES} <= piped
  assert str(autoplan.Layout((2, 2, 1, 2), 3)) == "2x2x1x2 ZeRO-3"
  # the ring's bytes on top of data x tensor parallelism's: (6C - 4) x one device's k chunk
  facts = autoplan.ModelFacts.of(cfg)
  rates = autoplan.Rates(kind="test", flops=1e12, link=1e9, memory=1e12, source="test")
  mc = cfg.model
  plain = autoplan.estimate(cfg, autoplan.Layout((4, 2, 1), 0), facts, rates)
  ring = autoplan.estimate(cfg, autoplan.Layout((2, 2, 1, 2), 0), facts, rates)
  kv = 8 / 2 * mc.seq_len / 2 * mc.d_model / 2 * 4  # B/d x T/C x G K / M x float32
  tp = 4 * mc.n_layers * 2 * (2 - 1) / 2 * (8 / 2 * mc.seq_len / 2 * mc.d_model * 4)
  dp = 2 * (2 - 1) / 2 * facts.n_params / 2 * 4
  assert ring["link_bytes"] == pytest.approx(mc.n_layers * 8 * kv + tp + dp)
  assert plain["compute_s"] == pytest.approx(ring["compute_s"])
  # under a pipeline: the all-gather form's 6 (C - 1) x per layer of the device's stage, beside
  # the executor's activations and cotangents
  lay = autoplan.Layout((1, 1, 2, 4), 0, "gpipe", 2, 1)
  gathered = autoplan.estimate(cfg, lay, facts, rates)
  kv4 = 8 * mc.seq_len / 4 * mc.d_model * 4  # B x T/C x G K x float32
  act = 8 * mc.seq_len / 4 * mc.d_model * 4
  _, ticks = autoplan._bubble(lay)
  assert gathered["link_bytes"] == pytest.approx(mc.n_layers / 2 * 6 * 3 * kv4
                                                 + 2 * ticks * act / 2)
