"""The loss-spike guard as an object: the exact sequences it judges, what a rollback forgets, and
its use in a loop of one's own (jaxpar.SpikeGuard with jaxpar.Trainer). The loop's use of it:
test_goodput.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
import test_equivalence as eq
from jaxpar.train.guard import SpikeGuard


def state(value: float) -> dict:
  return {"params": {"w": jnp.full((4,), value, jnp.float32)}}


def value_of(s: dict) -> float:
  return float(s["params"]["w"][0])


def test_a_high_loss_between_normal_ones_is_no_spike_and_the_guard_is_clear_again():
  g = SpikeGuard(factor=2.0, steps=2, window=10)
  for step in range(1, 6):
    assert g.judge(step, 1.0, 1.0) is None
  assert g.judge(6, 5.0, 1.0) is None and not g.clear  # high, waiting for a second
  assert g.judge(7, 1.0, 1.0) is None and g.clear  # a normal loss ends the run of highs
  assert g.judge(8, 5.0, 1.0) is None and not g.clear  # one high again, not two in a row
  assert g.judge(9, 5.0, 1.0) is not None  # two in a row: a spike
  assert g.high == [8, 9]


def test_a_rollback_returns_to_the_judged_state_and_forgets_every_loss_after_it():
  g = SpikeGuard(factor=2.0, steps=1, window=10)
  g.start(0, state(0.0))
  for step in range(1, 9):
    assert g.judge(step, 1.0, 1.0) is None
    if step % 2 == 0:  # a log step every 2
      g.keep(step, state(float(step)))
  # Kept at 6 and at 8: the state after step 8 is judged by no loss yet, the one after 6 by 7-8.
  assert (g.good.step, g.candidate.step) == (6, 8)
  assert g.judge(9, float("nan"), 1.0) is not None
  good = g.roll_back()
  assert good.step == 6 and value_of(good.copy.restore()) == 6.0 and g.candidate is None
  assert [s for s, _ in g.history] == [1, 2, 3, 4, 5, 6] and g.clear and g.rollbacks == 1
  # After a rollback the guard keeps from the good state on: the next copy is a candidate.
  g.keep(8, state(80.0))
  assert (g.good.step, g.candidate.step) == (6, 8)


def test_nan_weights_from_the_start_say_there_is_no_good_state(tmp_path):
  """The state a run starts from is NaN (a model folder or checkpoint with NaN weights): the
  guard rolls back once, sees that state give a non-finite loss on other batches too, and stops
  saying the run holds no good state, rather than rolling back to it max_rollbacks times; the
  run's sentence then says what its checkpoints hold (hooks.kept), here nothing."""
  from jaxpar.train import checkpoint, hooks
  g = SpikeGuard(factor=2.0, max_rollbacks=3)
  g.start(0, state(float("nan")))
  nan = {"loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(jnp.nan)}
  restored, step = g.watch(1, state(float("nan")), nan)  # a bad batch? roll back once
  assert step == 0 and g.rollbacks == 1
  with pytest.raises(FloatingPointError) as e:
    g.watch(1, restored, nan)  # the same state, the next batch: the state is bad
  assert str(e.value) == (
      "loss spike at step 1 (loss nan and gradient norm nan) right after rolling back to step 0: "
      "the state of step 0 (the state the run started from) gives a non-finite loss on other "
      "batches too, so the run holds no good state to roll back to; stopping without saving")
  assert g.rollbacks == 1
  with checkpoint.Checkpointer(str(tmp_path / "ckpt"), keep=1, every=0) as ckpt:
    assert hooks.kept(ckpt) == (f"and no checkpoint has been written in {tmp_path / 'ckpt'}: "
                                f"there is none to resume from")
  # A rollback to a good state whose next loss is finite goes on as before
  g = SpikeGuard(factor=2.0, steps=1, max_rollbacks=1)
  g.start(0, state(1.0))
  g.watch(1, state(1.0), {"loss": 1.0, "grad_norm": 1.0})
  assert g.watch(2, state(2.0), nan)[1] == 0
  g.watch(1, state(1.0), {"loss": 1.0, "grad_norm": 1.0})
  with pytest.raises(FloatingPointError, match="after 1 rollbacks, the most "
                     "train.max_rollbacks=1 allows; stopping without saving$"):
    g.watch(2, state(2.0), nan)


def test_the_guard_checks_its_settings_and_its_order_of_calls():
  with pytest.raises(ValueError, match="factor must be above 1"):
    SpikeGuard(factor=1.0)
  g = SpikeGuard(factor=2.0)
  with pytest.raises(ValueError, match="before start"):
    g.watch(1, state(1.0), {"loss": 1.0, "grad_norm": 1.0})


def test_a_loop_of_ones_own_rolls_a_harmful_update_back_with_the_guard():
  # jaxpar.Trainer's step on 4x2x1 ZeRO-3; the state after step 6 is made harmful by hand
  # (every weight x 50) while step 6's own loss is normal. The guard returns to the state of step
  # 5 and the loop trains on with the batches after the ones it skipped.
  cfg = eq.make_cfg("parallel.zero_stage=3")
  data = eq.batches(cfg, n=14)
  t = eq.trainer(cfg, (4, 2, 1))
  guard = jaxpar.SpikeGuard(factor=3.0, steps=1, window=4, max_rollbacks=1)
  s, step, it = t.init(0), 0, iter(data)
  guard.start(step, s)
  seen, rolled, poisoned = [], [], False
  while step < 8:
    s, m = t.step(s, {"tokens": jnp.asarray(next(it))})
    if step + 1 == 6 and not poisoned:
      poisoned = True
      s = {**s, "params": jax.tree_util.tree_map(lambda p: p * 50, s["params"])}
    seen.append(float(m["loss"]))
    s, new = guard.watch(step + 1, s, m)
    if new != step + 1:
      rolled.append((step + 1, new))
    step = new
  assert rolled == [(7, 5)] and guard.rollbacks == 1
  assert np.isfinite(seen).all() and seen[6] > 3 * np.median(seen[:6])
  # Steps 6 and 7 again, on batches 8 and 9: as a run that never saw batches 6 and 7.
  ref, s2 = t.init(0), None
  for b in data[:5] + data[7:10]:
    ref, m2 = t.step(ref, {"tokens": jnp.asarray(b)})
    s2 = float(m2["loss"])
  assert abs(seen[-1] - s2) <= 1e-5 * abs(s2)
