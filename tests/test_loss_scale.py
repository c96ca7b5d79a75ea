"""Dynamic loss scaling with float16 compute: an overflow is skipped and backs the scale off,
finite steps grow it, the same on a pipeline with ZeRO-3 as on one device, through the loop's
metrics and checkpoints, and float16 training tracks float32's loss.

The overflow is made by the scale itself: with these 16 x 16-token batches the backward
overflows float16 from a scale near 2**19 (measured), so 2**24 overflows and 2**14-2**16 do not,
each with a margin of 8x or more.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_equivalence as eq

from jaxpar import config
from jaxpar.train import loop

FP16 = ["precision.compute_dtype=float16", "precision.loss_scale=dynamic"]
# one overflow at 2**24 backs off to 2**14; then two finite steps in a row double the scale
SCHEDULE = FP16 + ["precision.initial_scale=16777216", "precision.backoff=0.0009765625",
                   "precision.growth_interval=2"]
SKIPPED = [1, 0, 0, 0, 0]
is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
SCALES = [2.0 ** 24, 2.0 ** 14, 2.0 ** 14, 2.0 ** 15, 2.0 ** 15]  # the scale each step ran with


def scaled_run(shape, *extra):
  """Five steps under SCHEDULE -> (per-step records, the state before and after step 1, the
  gradients of step 2 (the first finite one, still from the initial parameters), the final loss
  scale state, the final parameters)."""
  cfg = eq.make_cfg(*SCHEDULE, *extra)
  t = eq.trainer(cfg, shape, expose_grads=True)
  state = t.init(cfg.train.seed)
  rows, states, grads = [], [], []
  for b in eq.batches(cfg):
    if not states:
      states.append(jax.device_get(t.to_logical(state)))  # the step donates the state
    state, m = t.step(state, {"tokens": jnp.asarray(b)})
    rows.append({k: float(m[k]) for k in ("loss", "skipped", "loss_scale", "learning_rate")})
    if len(states) == 1:
      states.append(jax.device_get(t.to_logical(state)))
    grads.append(m["grads"])
  order = None if t.layer_order is None else np.argsort(t.layer_order)
  return (rows, tuple(states), jax.device_get(t._reorder(grads[1], order)),
          jax.device_get(state["loss_scale"]), jax.device_get(t.to_logical(state)["params"]))


@pytest.fixture(scope="module")
def reference():
  return scaled_run((1, 1, 1))


def test_overflow_is_skipped_and_backs_the_scale_off(reference):
  rows, (before, after), _, _, _ = reference
  assert rows[0]["skipped"] == 1 and rows[0]["loss_scale"] == 2.0 ** 24
  assert np.isfinite(rows[0]["loss"])  # the loss is finite: only the scaled backward overflowed
  # nothing moved, bit for bit, but the schedule's count: it follows the step (optim.keep_unless)
  jax.tree_util.tree_map(np.testing.assert_array_equal, after["params"], before["params"])
  for a, b in zip(*(jax.tree_util.tree_leaves(s["opt"], is_leaf=is_sched) for s in (after, before))):
    if is_sched(a):
      assert int(a.count) == int(b.count) + 1 == int(after["step"]) == 1
    else:
      np.testing.assert_array_equal(a, b)
  assert float(after["loss_scale"]["scale"]) == 2.0 ** 14
  assert int(after["loss_scale"]["good_steps"]) == 0


def test_scale_doubles_after_growth_interval_finite_steps(reference):
  rows, _, _, final, params = reference
  assert [r["skipped"] for r in rows] == SKIPPED
  assert [r["loss_scale"] for r in rows] == SCALES
  assert float(final["scale"]) == 2.0 ** 16 and int(final["good_steps"]) == 0
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))
  # the schedule follows the step, skipped steps included: step 2 ran at schedule(1)
  t_cfg = eq.make_cfg(*SCHEDULE).train
  from jaxpar.train import optim
  assert rows[1]["learning_rate"] == pytest.approx(float(optim.schedule(t_cfg)(1)))


def test_pipeline_with_zero3_2x1x2_matches_one_device(reference):
  """The scale reaches the pipeline's backward (it seeds each microbatch's cotangent) and ZeRO-3's
  reduce-scatter: the same steps overflow, the scale moves the same, and losses, gradients and
  parameters agree to float16 rounding (measured: gradients 1.2e-3 apart, as float16 and float32
  gradients on one device are; Adam makes that about 1e-2 in the parameters after 4 updates)."""
  ref_rows, _, ref_grads, _, ref_params = reference
  rows, (before, after), grads, final, params = scaled_run((2, 1, 2), "parallel.zero_stage=3")
  assert [r["skipped"] for r in rows] == SKIPPED
  assert [r["loss_scale"] for r in rows] == SCALES and float(final["scale"]) == 2.0 ** 16
  jax.tree_util.tree_map(np.testing.assert_array_equal, after["params"], before["params"])
  np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref_rows], rtol=2e-3)
  assert eq.rel_err(grads, ref_grads) < 5e-3
  assert eq.rel_err(params, ref_params) < 2e-2


def test_float16_50_steps_tracks_float32():
  """Default dynamic scaling (2**16, growth every 2000): within 2% of float32's loss every step."""
  extra = ["train.steps=50", "train.warmup_steps=5"]
  data = eq.batches(eq.make_cfg(*extra), 50)

  def losses(cfg):
    t = eq.trainer(cfg, (1, 1, 1))
    state, out = t.init(cfg.train.seed), []
    for b in data:
      state, m = t.step(state, {"tokens": jnp.asarray(b)})
      out.append(m)
    return np.array([float(m["loss"]) for m in out]), [int(m.get("skipped", 0)) for m in out]
  l32, _ = losses(eq.make_cfg(*extra))
  l16, skipped = losses(eq.make_cfg(*extra, *FP16))
  assert l32[-1] < 0.6 * l32[0]  # it learns, so tracking means something
  assert sum(skipped) == 0
  gap = np.abs(l16 - l32) / l32
  assert gap.max() < 0.02, gap.max()


def test_loop_counts_overflows_logs_the_scale_and_resumes_it(tmp_path):
  """Through loop.run: overflows do not stop the run, are counted in skipped_steps and logged as
  loss_scale; the scale is checkpointed, so a resumed run continues it; an overflow with the
  scale at precision.min_scale stops the run."""
  tiny = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
          "model.seq_len=16", "train.batch_size=8", "train.log_every=1", "data.source=synthetic",
          *FP16, "precision.initial_scale=1099511627776"]  # 2**40: overflows every step here
  wd, metrics = str(tmp_path / "wd"), tmp_path / "metrics.jsonl"
  run = lambda steps, *extra: loop.run(config.load(None, tiny + list(extra)), (8, 1, 1), wd,
                                       str(metrics), steps=steps, progress=False,
                                       log=lambda *a: None)
  r = run(2)
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [(row["step"], row["skipped"], row["loss_scale"]) for row in rows[:-1]] == [
      (1, 1, 2.0 ** 40), (2, 1, 2.0 ** 39)]
  assert r.summary["skipped_steps"] == 2 and r.summary["loss_scale"] == 2.0 ** 38
  # resumed, step 3 runs at the saved 2**38 (not initial_scale), which is now the floor
  with pytest.raises(FloatingPointError, match=f"step 3 with the loss scale at its minimum "
                                               f"{2.0 ** 38}"):
    run(3, f"precision.min_scale={2.0 ** 38}")


def test_checkpoint_without_a_scale_restores_under_dynamic_scaling_and_back(tmp_path):
  """A checkpoint saved under a static scale resumes under a dynamic one from
  precision.initial_scale; one saved with a scale resumes under a static scale without it."""
  from jaxpar.train import checkpoint
  static = eq.trainer(eq.make_cfg("precision.compute_dtype=float16"), (1, 1, 1))
  dynamic = eq.trainer(eq.make_cfg(*SCHEDULE), (1, 1, 1))
  with checkpoint.Checkpointer(str(tmp_path), keep=2, every=0, async_save=False) as ckpt:
    state = static.init(0)
    want = jax.device_get(state["params"])
    ckpt.maybe_save(1, state, {}, force=True)
    state, _ = dynamic.restore(ckpt, 1)
    assert float(state["loss_scale"]["scale"]) == 2.0 ** 24
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state["params"]), want)
    ckpt.maybe_save(2, state, {}, force=True)
    state, _ = static.restore(ckpt, 2)
    assert set(state) == {"step", "params", "opt"}
