"""Pipeline schedules: the tables themselves, equivalence with one device, and activation memory."""
import numpy as np
import pytest
import test_equivalence as eq

from jaxpar.parallel import pipeline as pl
from jaxpar.planning import plan as jplan

PIPE_BASE = ["model.n_layers=8", "parallel.microbatches=4"]


@pytest.mark.parametrize("name,V", [("gpipe", 1), ("1f1b", 1), ("circular", 2)])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_bubble_matches_textbook(name, V, M):
  sched = pl.build(name, 4, M, V)
  assert sched.bubble_fraction == pytest.approx(pl.forward_bubble(4, M, V), abs=1e-12)


@pytest.mark.parametrize("name,V", [("gpipe", 1), ("1f1b", 1), ("circular", 2), ("circular", 4)])
def test_table_runs_every_unit_once_in_dependency_order(name, V):
  P, M = 4, 8
  a = pl.build(name, P, M, V).actions
  when = {}
  for t in range(a.shape[0]):
    for s in range(P):
      k, i, c = a[t, s]
      if k != pl.IDLE:
        assert (k, s, i, c) not in when
        when[(k, s, i, c)] = t
  assert len(when) == 2 * P * M * V
  for (k, s, i, c), t in when.items():
    if k == pl.FWD and (s, c) != (0, 0):
      prev = (pl.FWD, s - 1, i, c) if s else (pl.FWD, P - 1, i, c - 1)
      assert when[prev] < t
    if k == pl.BWD:
      assert when[(pl.FWD, s, i, c)] < t
      if (s, c) != (P - 1, V - 1):
        nxt = (pl.BWD, s + 1, i, c) if s < P - 1 else (pl.BWD, 0, i, c + 1)
        assert when[nxt] < t


def test_1f1b_holds_at_most_p_microbatches():
  for M in (4, 8, 16, 32):
    sched = pl.build("1f1b", 4, M)
    for s in range(4):
      live = peak = 0
      for t in range(sched.ticks):
        k = sched.actions[t, s, 0]
        live += int(k == pl.FWD) - int(k == pl.BWD)
        peak = max(peak, live)
      assert peak <= 4 - s
    assert sched.slots <= 5  # buffers do not grow with M


def test_chart_shows_every_stage():
  chart = pl.build("1f1b", 2, 4).chart()
  assert chart.splitlines()[0].startswith("stage 0:") and "F3" in chart and "B3" in chart


# P = 2 alone is left to test_equivalence.py's 2x2x2 layouts and the other files' 1x1x2 ones.
# Each schedule alone on 4 stages and with data, tensor and ZeRO-3; ZeRO-1 with data on 4 stages
# under the circular schedule, whose layer order the state keeps (stage order) is the odd one.
PIPE_LAYOUTS = [(shape, stage, name) for name in ("gpipe", "1f1b", "circular")
                for shape, stage in (((1, 1, 4), 0), ((2, 2, 2), 3))] + [((2, 1, 4), 1, "circular")]


@pytest.fixture(scope="module")
def reference8():
  cfg = eq.make_cfg(*PIPE_BASE)
  data = eq.batches(cfg)
  return data, eq.train(cfg, (1, 1, 1), data)


@pytest.mark.parametrize("shape,stage,name", PIPE_LAYOUTS,
                         ids=[f"{n}-{'x'.join(map(str, s))}-zero{z}" for s, z, n in PIPE_LAYOUTS])
def test_pipeline_matches_single_device(reference8, shape, stage, name):
  data, (ref_losses, ref_params, ref_grads) = reference8
  cfg = eq.make_cfg(*PIPE_BASE, f"parallel.schedule={name}", f"parallel.zero_stage={stage}",
                    f"parallel.virtual_stages={2 if name == 'circular' else 1}")
  losses, params, grads = eq.train(cfg, shape, data)
  np.testing.assert_allclose(losses, ref_losses, rtol=eq.RTOL)
  eq.assert_trees_close(grads, ref_grads, "gradient")
  eq.assert_trees_close(params, ref_params, "parameter")


def temp_bytes(name, M):
  """Compiled temp bytes on 1x1x4 with microbatches of 4 samples."""
  cfg = eq.make_cfg(*PIPE_BASE, f"parallel.schedule={name}", f"parallel.microbatches={M}",
                    f"train.batch_size={4 * M}")
  report = jplan.plan(cfg, (1, 1, 4))
  return report["compiled"]["temp_bytes"], report


def test_1f1b_memory_flat_in_microbatches_gpipe_grows():
  f4, report = temp_bytes("1f1b", 4)
  f16, _ = temp_bytes("1f1b", 16)
  g4, _ = temp_bytes("gpipe", 4)
  g16, _ = temp_bytes("gpipe", 16)
  cfg = eq.make_cfg(*PIPE_BASE)
  stage_input = 4 * cfg.model.seq_len * cfg.model.d_model * 4  # one microbatch's (b, T, D) fp32
  assert f16 <= 1.25 * f4, (f4, f16)
  # GPipe stashes every microbatch's stage input until its backward (and recomputes the rest)
  assert g16 - g4 >= (16 - 4) * stage_input, (g4, g16)
  assert report["pipeline"]["bubble_fraction"] == pytest.approx(3 / 7)
