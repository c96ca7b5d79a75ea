"""Evaluation runs on the training step's sharded path: equal to one device, and never more
memory per device than the step (the old path gathered the whole layer stack on every device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import hlo

import test_equivalence as eq

LAYOUTS = [((2, 2, 2), ["parallel.zero_stage=3"]),
           ((4, 2, 1), ["parallel.zero_stage=3"]),
           ((1, 1, 2), ["parallel.schedule=circular", "parallel.virtual_stages=2",
                        "model.n_layers=4", "parallel.microbatches=2"])]


def eval_loss(cfg, shape, batch):
  t = eq.trainer(cfg, shape)
  state = t.init(cfg.train.seed)
  fn = t.eval_jitted(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
  with jax.set_mesh(t.mesh):
    return float(fn(state["params"], batch)["loss"])


@pytest.mark.parametrize("shape,extra", LAYOUTS, ids=["2x2x2-zero3", "4x2x1-zero3", "1x1x2-circular"])
def test_eval_loss_matches_one_device(shape, extra):
  cfg = eq.make_cfg(*extra)
  batch = {"tokens": jnp.asarray(eq.batches(cfg, 1)[0])}
  want = eval_loss(eq.make_cfg(*[e for e in extra if "n_layers" in e]), (1, 1, 1), batch)
  assert eval_loss(cfg, shape, batch) == pytest.approx(want, rel=eq.RTOL)


def test_eval_bytes_per_device_within_the_step_on_2x2x2_zero3():
  cfg = eq.make_cfg("parallel.zero_stage=3", "model.n_layers=8", "model.d_model=128",
                    "model.d_ff=512")
  t = eq.trainer(cfg, (2, 2, 2))
  batch = {"tokens": jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32)}
  with jax.set_mesh(t.mesh):
    step = hlo.memory(t.lower(batch).compile())
    ev = hlo.memory(t.eval_jitted(batch).lower(t.abstract_state["params"], batch).compile())
  used = lambda m: m["argument_bytes"] + m["temp_bytes"]
  assert used(ev) <= used(step), (ev, step)
  # and no device holds the stack whole: parameters per device are an eighth of the model's
  full = sum(np.prod(a.shape) * 4 for a in jax.tree_util.tree_leaves(t.abstract_state["params"]))
  assert ev["argument_bytes"] < full / 4 + batch["tokens"].size * 4
