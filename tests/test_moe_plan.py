"""Planning a mixture of experts (planning/plan.py's `experts`, planning/autoplan.py): only the
layouts mesh.check allows, and the expert weights, dispatch buffer and all-to-all bytes per device
read off the compiled program, checked against the state's shardings and the exchange's shapes.

Tiny shapes: 1 layer, d_model 16, 4 GELU experts of width 32, top-2, sequence 8, batch 8.
"""
import math

import jax
import pytest

from jaxpar import config
from jaxpar.parallel import mesh as jmesh
from jaxpar.planning import autoplan

SETS = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
        "model.seq_len=8", "train.batch_size=8", "model.n_experts=4",
        "model.experts_per_token=2", "precision.compute_dtype=float32"]


def make_cfg(*extra):
  return config.load(None, SETS + list(extra))


def test_moe_layouts_are_those_mesh_check_allows():
  moe = config.load(None, ["model.n_experts=2"])  # the default model's shapes, 2 experts
  lays, ruled_out = autoplan.layouts(moe, 8)
  dense = {lay.mesh for lay in autoplan.layouts(config.load(None, []), 8)[0]}
  meshes = {lay.mesh for lay in lays}
  # the dense model's meshes with the experts split evenly over data (pipelines as mesh.check
  # says), each passing mesh.check for the mixture
  assert meshes <= {(d, m, p) for d, m, p in dense if 2 % d == 0}
  assert meshes >= {(d, m, p) for d, m, p in dense if 2 % d == 0 and p == 1} >= {(2, 4, 1)}
  for lay in lays:
    jmesh.check(lay.mesh, lay.apply(moe), 8)
  assert {lay.zero_stage for lay in lays if lay.mesh == (2, 4, 1)} == {0, 1, 2, 3}
  assert any("model.n_experts=2 is not divisible by data=4" in w for w in ruled_out)
  assert any("model.n_experts=2 is not divisible by data=8" in w for w in ruled_out)


@pytest.fixture(scope="module")
def rows():
  """--auto's compiled rows for data 1, 2 and 4 (the experts split 1, 2 and 4 ways)."""
  cfg = make_cfg()
  r = autoplan.rates("cpu", 4)
  facts = autoplan.ModelFacts.of(cfg)
  out = {}
  for d in (1, 2, 4):
    lay = autoplan.Layout((d, 1, 1), 0)
    jmesh.check(lay.mesh, cfg, d)
    out[d] = autoplan.evaluate(cfg, lay, facts, r, jax.devices()[:d])
    jax.clear_caches()
  return cfg, out


def test_expert_bytes_come_from_the_compiled_program(rows):
  cfg, out = rows
  mc = cfg.model
  E, D, F, k = mc.n_experts, mc.d_model, mc.d_ff, mc.experts_per_token
  full = mc.n_layers * E * 2 * D * F * 4  # GELU experts' two float32 matrices, all experts
  for d, row in out.items():
    ex = row["experts"]
    assert (ex["n_experts"], ex["split"], ex["per_device"]) == (E, d, E // d)
    assert ex["weights_bytes"] == full // d, d  # the program's entry parameters
    assert ex["opt_state_bytes"] == 2 * full // d, d  # AdamW's two moments, as split
  # 1 / E_split from data=2 to data=4
  assert out[2]["experts"]["weights_bytes"] == 2 * out[4]["experts"]["weights_bytes"]

  assert out[1]["experts"]["all_to_all_bytes"] == 0
  assert out[1]["experts"]["dispatch_buffer_bytes"] == 0
  assert out[1]["collectives"]["all-to-all"] == 0
  rows_bytes = cfg.train.batch_size * mc.seq_len * k * D * 4  # every (token, expert) row
  for d in (2, 4):
    ex = out[d]["experts"]
    # dropless: each device's buffer holds d slots of all its B/d x T x k rows
    assert ex["dispatch_buffer_bytes"] == rows_bytes, d
    # per layer, rows out and back in the forward and in the backward (the backward keeps the
    # forward's exchanged rows, moe.SAVED, rather than exchanging again) and the per-expert
    # counts (int32) twice
    counts = 2 * mc.n_layers * E * 4
    assert ex["all_to_all_bytes"] == 4 * mc.n_layers * rows_bytes + counts, d
    assert out[d]["collectives"]["all-to-all"] == ex["all_to_all_bytes"]


def test_layouts_with_experts_split_rank_with_the_rest(rows):
  cfg, out = rows
  fit, over = autoplan.rank([dict(r) for r in out.values()], math.inf)
  assert not over and [r["rank"] for r in fit] == [1, 2, 3]
  assert sorted(r["step_s"] for r in fit) == [r["step_s"] for r in fit]
  # the all-to-all is in the link bytes the ranking predicts from
  assert out[2]["link_bytes"] > out[2]["collective_bytes"] - out[2]["collectives"]["all-to-all"] > 0
  text = autoplan.format_result({"mode": "auto", "devices": 4, "budget_bytes": math.inf,
                                 "device": autoplan.dataclasses.asdict(autoplan.rates("cpu", 4)),
                                 "layouts": 3, "ruled_out": [], "compiled": 3, "failed": [],
                                 "stopped_early": None, "seconds": 1.0, "ranked": fit,
                                 "over_budget": []})
  ex = out[4]["experts"]
  assert (f"experts: 1 of 4 per device, weights {autoplan._bytes(ex['weights_bytes'])}, "
          f"dispatch buffer {autoplan._bytes(ex['dispatch_buffer_bytes'])}") in text
  # the analytic prediction (which orders --auto's compiles) counts the same all-to-all bytes
  facts = autoplan.ModelFacts.of(cfg)
  r = autoplan.rates("cpu", 4)
  for d in (2, 4):
    lay = autoplan.Layout((d, 1, 1), 0)
    sent = out[d]["link_bytes"] - autoplan.estimate(cfg, lay, facts, r)["link_bytes"]
    assert abs(sent) < 0.2 * out[d]["link_bytes"], (d, sent)  # within a recomputed exchange
