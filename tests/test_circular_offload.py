"""The circular schedule with the optimizer offloaded to host memory: checkpoints save and resume.

Under the circular schedule the state keeps the layer stack in stage order and checkpoints hold
the model's own order, so every save and resume reorders the stack, offloaded moments included.
All runs are in-process on conftest's 8 devices as 4x1x2 and go to step 4, saving at 2 and 4: a
resume then compiles the same step as the unbroken run (train.steps is part of the program).
"""
import os
import shutil

import jax
import numpy as np
import pytest
from test_resume import TINY, run

from jaxpar import config
from jaxpar.analysis import hlo
from jaxpar.train import checkpoint, loop

MESH = (4, 1, 2)
STEPS = 4
SHAPE = ["model.n_layers=4", "parallel.microbatches=2", "checkpoint.every=2"]
CIRCULAR = SHAPE + ["parallel.schedule=circular", "parallel.virtual_stages=2"]
GPIPE = SHAPE + ["parallel.schedule=gpipe"]
OFFLOAD = ["parallel.offload_optimizer=true"]
LAYOUTS = {
    "circular-offload-zero1": CIRCULAR + OFFLOAD + ["parallel.zero_stage=1"],
    "circular-offload-zero3": CIRCULAR + OFFLOAD + ["parallel.zero_stage=3"],
    "gpipe-zero1": GPIPE + ["parallel.zero_stage=1"],
}
# Another schedule or ZeRO stage sums the same numbers in another order.
RTOL = 1e-5


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
  """layout -> (workdir, {step: loss}) of a run of STEPS steps, trained once per module."""
  done = {}

  def get(layout):
    if layout not in done:
      workdir = tmp_path_factory.mktemp(layout)
      result, _ = run(workdir, *LAYOUTS[layout], mesh=MESH, steps=STEPS)
      assert sorted(result.losses) == list(range(1, STEPS + 1))
      done[layout] = workdir, result.losses
    return done[layout]
  return get


def saved(workdir, step):
  """The checkpoint of `step` in `workdir`, as full numpy arrays in the model's layer order."""
  return checkpoint.read_state(os.path.join(workdir, "checkpoints"), step)


def resume(saved_in, workdir, layout):
  """Copies the step-2 checkpoint of `saved_in` to `workdir` and trains `layout` on to STEPS ->
  {step: loss} of this run."""
  shutil.copytree(os.path.join(saved_in, "checkpoints", "2"),
                  os.path.join(workdir, "checkpoints", "2"))
  result, log = run(workdir, *LAYOUTS[layout], mesh=MESH, steps=STEPS)
  assert "resuming from the checkpoint at step 2" in log
  assert sorted(result.losses) == [3, 4]
  return result.losses


def assert_close(got, want, rtol, what):
  """Every leaf of `got` equal to `want`'s within `rtol` (0: bit for bit), paths included."""
  got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(got)}
  want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(want)}
  assert sorted(got) == sorted(want), what
  for path, leaf in want.items():
    np.testing.assert_allclose(np.asarray(got[path]), np.asarray(leaf), rtol=rtol, atol=1e-7 * (rtol > 0),
                               err_msg=f"{what}: {path}")


def assert_losses(got, want, rtol):
  for s in got:
    np.testing.assert_allclose(got[s], want[s], rtol=rtol, err_msg=f"step {s}")


@pytest.mark.parametrize("zero", [1, 3])
def test_save_and_resume_continue_the_unbroken_run(unbroken, tmp_path, zero):
  """Saved by the circular schedule with offload at ZeRO-1, resumed at ZeRO `zero`, which saves
  again at step 4. (A ZeRO-3 circular step loaded from the compilation cache corrupts memory on
  XLA:CPU, so the ZeRO-3 layout runs only here, compiled once.)"""
  workdir, losses = unbroken("circular-offload-zero1")
  rtol = 0 if zero == 1 else RTOL
  assert_losses(resume(workdir, tmp_path, f"circular-offload-zero{zero}"), losses, rtol)
  # the optimizer state trained on from the restored one, and everything else
  assert_close(saved(tmp_path, 4), saved(workdir, 4), rtol, f"zero {zero} from zero 1")


@pytest.mark.parametrize("zero", [1, 3])
def test_a_restored_state_is_in_stage_order_with_the_moments_in_host_memory(unbroken, zero):
  """The reorder on the way in (and back out) against numpy's, leaf by leaf."""
  workdir, _ = unbroken("circular-offload-zero1")
  cfg = config.load(None, TINY + LAYOUTS[f"circular-offload-zero{zero}"] + [f"train.steps={STEPS}"])
  trainer = loop.prepare(cfg, MESH)
  with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=3, every=0) as ckpt:
    logical, _ = trainer.restore(ckpt, 2)
  staged = trainer.from_logical(logical)
  order = trainer.layer_order
  assert order is not None and not (order == np.arange(len(order))).all()

  def by_numpy(path, x):
    x = np.asarray(x)
    stack = any(getattr(k, "key", None) == "layers" for k in path) and x.ndim and len(x) == len(order)
    return x[order] if stack else x
  assert_close(staged, jax.tree_util.tree_map_with_path(by_numpy, logical), 0, "from_logical")
  kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(staged["opt"])}
  assert kinds == {"pinned_host"}
  assert_close(trainer.to_logical(staged), logical, 0, "to_logical")
  # Each stage receives only its own layers: no stage gathers the whole stack.
  with jax.set_mesh(trainer.mesh):
    for inverse, state in ((False, logical), (True, staged)):
      sent = hlo.collective_bytes(trainer._reorder_fns[inverse].lower(state).compile().as_text())
      assert sent.get("all-to-all", 0) > 0 and sent.get("all-gather", 0) == 0, (inverse, sent)


def test_a_circular_offloaded_checkpoint_resumes_without_the_circular_schedule(unbroken, tmp_path):
  """Saved with the moments in host memory and in stage order, resumed by a schedule that keeps
  the model's order, with the moments on the device."""
  circular, losses = unbroken("circular-offload-zero1")
  assert_losses(resume(circular, tmp_path, "gpipe-zero1"), losses, RTOL)
  assert_close(saved(tmp_path, 4), saved(circular, 4), RTOL, "gpipe from circular")


def test_a_checkpoint_without_the_circular_schedule_resumes_with_it_and_offload(unbroken, tmp_path):
  """The other way round: the moments arrive in the model's order and go to host memory."""
  gpipe, losses = unbroken("gpipe-zero1")
  assert_losses(unbroken("circular-offload-zero1")[1], losses, RTOL)
  assert_losses(resume(gpipe, tmp_path, "circular-offload-zero1"), losses, RTOL)
  assert_close(saved(tmp_path, 4), saved(gpipe, 4), RTOL, "circular from gpipe")
