import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import checkpoint
from jaxpar.train.step import Trainer

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=128",
        "model.seq_len=16", "train.batch_size=8", "train.warmup_steps=1", "train.steps=5"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(shape, stage, *overrides):
  cfg = config.load(None, TINY + [f"parallel.zero_stage={stage}", *overrides])
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:int(np.prod(shape))]), jmodel.gpt(cfg))


def batches(n):
  rng = np.random.default_rng(0)
  return [{"tokens": jnp.asarray(rng.integers(0, 256, (8, 17), dtype=np.int32))} for _ in range(n)]


def as_numpy(tree):
  return jax.tree_util.tree_map(np.asarray, tree)


def assert_tree_equal(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A 2x4x1 ZeRO-3 run saved after 2 steps, plus the loss of its third step."""
  directory = str(tmp_path_factory.mktemp("run") / "checkpoints")
  t = trainer((2, 4, 1), 3)
  b = batches(3)
  state = t.init(0)
  for batch in b[:2]:
    state, _ = t.step(state, batch)
  ckpt = checkpoint.Checkpointer(directory, keep=2, every=2)
  assert not os.path.exists(directory)  # nothing on disk before the first save
  assert ckpt.latest_step() is None
  assert not ckpt.maybe_save(1, state, {})
  assert not os.path.exists(directory)
  extra = {"data": {"position": 16}, "config": config.to_dict(t.cfg), "seed": 0}
  assert ckpt.maybe_save(2, state, extra)
  params = as_numpy(state["params"])  # before the step below donates `state`
  _, metrics = t.step(state, b[2])  # runs while the async save writes
  ckpt.close()
  assert not ckpt.maybe_save(2, state, extra, force=True)  # step 2 exists already
  return {"dir": directory, "params": params, "extra": extra, "batch": b[2],
          "loss": float(metrics["loss"])}


@pytest.mark.parametrize("shape,stage", [((8, 1, 1), 1), ((1, 1, 1), 0)])
def test_restore_onto_other_mesh_and_stage(saved, shape, stage):
  t = trainer(shape, stage)
  with checkpoint.Checkpointer(saved["dir"], keep=2, every=2) as ckpt:
    assert ckpt.latest_step() == 2
    state, extra = ckpt.restore(2, t.abstract_state, t.state_shardings)
  assert extra == saved["extra"]
  assert int(state["step"]) == 2
  assert_tree_equal(state["params"], saved["params"])
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(t.abstract_state)
  for leaf, sharding in zip(jax.tree_util.tree_leaves(state),
                            jax.tree_util.tree_leaves(t.state_shardings)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  _, metrics = t.step(state, saved["batch"])
  np.testing.assert_allclose(float(metrics["loss"]), saved["loss"], rtol=1e-5)


def test_restore_into_offloaded_optimizer(saved):
  assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
  t = trainer((8, 1, 1), 1, "parallel.offload_optimizer=true")
  with checkpoint.Checkpointer(saved["dir"], keep=2, every=2) as ckpt:
    state, _ = ckpt.restore(2, t.abstract_state, t.state_shardings)
  assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(state["opt"])} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(state["params"])} == {"device"}
  assert_tree_equal(state["params"], saved["params"])
  plain = checkpoint.read_state(saved["dir"], 2)
  mu = plain["opt"][1][0]["mu"]  # clip_by_global_norm, then adamw's ScaleByAdamState
  assert_tree_equal(state["opt"][1][0].mu, mu)
  # An offloaded state saves as it is and restores onto devices.
  directory = os.path.join(os.path.dirname(saved["dir"]), "from_offloaded")
  with checkpoint.Checkpointer(directory, keep=1, every=0) as ckpt:
    assert ckpt.maybe_save(2, state, {}, force=True)
    assert ckpt.latest_step() == 2  # waits for the save in flight
    t0 = trainer((1, 1, 1), 0)
    again, _ = ckpt.restore(2, t0.abstract_state, t0.state_shardings)
  assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(again)} == {"device"}
  assert_tree_equal(again, state)


def test_shape_mismatch_names_the_parameter(saved):
  t = trainer((1, 1, 1), 0, "model.n_layers=4")
  with checkpoint.Checkpointer(saved["dir"], keep=2, every=2) as ckpt:
    with pytest.raises(ConfigError, match=r"checkpoint parameter layers/\w+ has shape \(2, .*\) "
                                          r"but the config makes \(4, "):
      ckpt.restore(2, t.abstract_state, t.state_shardings)


def test_read_state_with_plain_orbax(saved):
  state = checkpoint.read_state(saved["dir"])
  t = trainer((1, 1, 1), 0)
  for path, want in jax.tree_util.tree_leaves_with_path(t.abstract_state["params"]):
    got = state["params"]
    for k in path:
      got = got[k.key]
    assert isinstance(got, np.ndarray) and got.shape == want.shape
  assert_tree_equal(state["params"], saved["params"])
  assert int(state["step"]) == 2
  assert checkpoint.read_extra(saved["dir"]) == saved["extra"]


KILLED_SAVE = """
import os, time
import jax.numpy as jnp
from jaxpar.train import checkpoint
directory = {directory!r}
ckpt = checkpoint.Checkpointer(directory, keep=3, every=1)
ckpt.maybe_save(1, {{"step": jnp.int32(1), "params": {{"w": jnp.ones((256, 256))}}}}, {{"step": 1}})
ckpt.wait()
# Large enough that writing it outlasts the poll below by far.
ckpt.maybe_save(2, {{"step": jnp.int32(2), "params": {{"w": jnp.ones((4096, 4096))}}}}, {{"step": 2}})
tmp = os.path.join(directory, "2.orbax-checkpoint-tmp")
deadline = time.time() + 60
while not os.path.isdir(tmp) and time.time() < deadline:  # orbax creates it in the background
  time.sleep(0.0005)
os._exit(0)  # killed while step 2 is being written
"""


def test_incomplete_save_is_ignored(tmp_path):
  directory = str(tmp_path / "checkpoints")
  subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE.format(directory=directory))],
                 cwd=ROOT, check=True, timeout=120, capture_output=True)
  assert "2.orbax-checkpoint-tmp" in os.listdir(directory)
  # A complete step under the tmp name older orbax versions used must not count either.
  old_style = os.path.join(directory, "7.orbax-checkpoint-tmp-1700000000")
  shutil.copytree(os.path.join(directory, "1"), old_style)

  ckpt = checkpoint.Checkpointer(directory, keep=3, every=1)
  assert ckpt.latest_step() == 1
  assert ckpt.all_steps() == [1]
  assert "2.orbax-checkpoint-tmp" in os.listdir(directory)  # reading deletes nothing
  assert float(checkpoint.read_state(directory)["params"]["w"][0, 0]) == 1.0

  state = {"step": jnp.int32(2), "params": {"w": jnp.full((256, 256), 3.0)}}
  assert ckpt.maybe_save(2, state, {"step": 2})
  ckpt.wait()
  assert ckpt.latest_step() == 2
  assert sorted(os.listdir(directory)) == ["1", "2"]  # the first save removed both leftovers
  assert float(checkpoint.read_state(directory, 2)["params"]["w"][0, 0]) == 3.0
  assert checkpoint.read_extra(directory) == {"step": 2}
  ckpt.close()
  assert checkpoint.Checkpointer(directory, keep=3, every=1).latest_step() == 2


def test_keep_and_interval(tmp_path):
  directory = str(tmp_path / "checkpoints")
  with checkpoint.Checkpointer(directory, keep=2, every=3, async_save=False) as ckpt:
    saved = [s for s in range(1, 10) if ckpt.maybe_save(s, {"x": jnp.float32(s)}, {})]
    assert saved == [3, 6, 9]
    assert ckpt.maybe_save(10, {"x": jnp.float32(10)}, {}, force=True)
    assert ckpt.all_steps() == [9, 10]
