"""Every layout against one device: same inputs, per-step losses, gradients and final parameters.

Tolerance (fp32): 1e-5 relative. Losses are compared step by step; gradients and parameters leaf
by leaf as ||a - b|| <= 1e-5 ||b|| (what "relative" means for a tensor), plus 1e-7 of the whole
tree's norm for leaves whose exact value is zero: the key bias's gradient is zero in exact
arithmetic (softmax ignores a shift shared by all keys), so only rounding noise is left to compare.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config, mesh as jmesh, model as jmodel
from jaxpar.data import synthetic_windows
from jaxpar.step import Trainer

RTOL = 1e-5
STEPS = 5
BASE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=8", "model.d_ff=256",
        "model.seq_len=16", "train.batch_size=16", "train.warmup_steps=2", "train.steps=5",
        "train.lr=1e-2", "precision.compute_dtype=float32"]


def make_cfg(*extra):
  return config.load(None, BASE + list(extra))


def batches(cfg, n=STEPS, seed=0):
  """Learnable token windows: on uniform noise every gradient is rounding-sized, and Adam turns
  rounding differences into whole-step differences, so a comparison there would measure noise."""
  w = synthetic_windows(cfg.model.seq_len, seed).astype(np.int32)
  b = cfg.train.batch_size
  return [w[i * b:(i + 1) * b] for i in range(n)]


def trainer(cfg, shape, expose_grads=False):
  jmesh.check(shape, cfg, int(np.prod(shape)))
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:int(np.prod(shape))]), jmodel.gpt(cfg),
                 expose_grads=expose_grads)


def train(cfg, shape, data):
  """Per-step losses, final params (host numpy, the model's layer order) and the first step's grads."""
  t = trainer(cfg, shape, expose_grads=True)
  state = t.init(cfg.train.seed)
  losses, grads = [], None
  for b in data:
    state, m = t.step(state, {"tokens": jnp.asarray(b)})
    losses.append(float(m["loss"]))
    if grads is None:
      grads = jax.device_get(t._reorder(m["grads"], None if t.layer_order is None
                                        else np.argsort(t.layer_order)))
  return np.array(losses), jax.device_get(t.to_logical(state)["params"]), grads


def assert_trees_close(got, want, what):
  flat_w = dict(jax.tree_util.tree_leaves_with_path(want))
  floor = 1e-7 * np.sqrt(sum(np.sum(np.square(w, dtype=np.float64)) for w in flat_w.values()))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = np.asarray(flat_w[path], np.float64)
    err, norm = np.linalg.norm(np.asarray(g, np.float64) - w), np.linalg.norm(w)
    assert err <= RTOL * norm + floor, (
        f"{what} {jax.tree_util.keystr(path)}: |a-b| = {err:.3e}, |b| = {norm:.3e}")


@pytest.fixture(scope="module")
def reference():
  cfg = make_cfg()
  data = batches(cfg)
  return data, train(cfg, (1, 1, 1), data)


LAYOUTS = [(s, z) for s in [(8, 1, 1), (2, 4, 1), (4, 2, 1), (1, 4, 1), (1, 8, 1)] for z in range(4)]


@pytest.mark.parametrize("shape,stage", LAYOUTS, ids=[f"{'x'.join(map(str, s))}-zero{z}" for s, z in LAYOUTS])
def test_layout_matches_single_device(reference, shape, stage):
  data, (ref_losses, ref_params, ref_grads) = reference
  losses, params, grads = train(make_cfg(f"parallel.zero_stage={stage}"), shape, data)
  assert ref_losses[-1] < 0.97 * ref_losses[0]  # the reference learns, so agreeing means something
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(grads, ref_grads, "gradient")
  assert_trees_close(params, ref_params, "parameter")


def test_grad_accum_matches_large_batch(reference):
  data, (ref_losses, ref_params, _) = reference
  losses, params, _ = train(make_cfg("train.grad_accum=4", "parallel.zero_stage=2"), (2, 2, 1), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(params, ref_params, "parameter")


def test_grouped_query_attention_tensor_parallel():
  cfg = make_cfg("model.n_kv_heads=4")
  data = batches(cfg, 2)
  ref, _, ref_grads = train(cfg, (1, 1, 1), data)
  got, _, grads = train(cfg, (2, 4, 1), data)
  np.testing.assert_allclose(got, ref, rtol=RTOL)
  assert_trees_close(grads, ref_grads, "gradient")


def test_offload_optimizer_matches():
  cfg = make_cfg()
  data = batches(cfg, 2)
  ref, ref_params, _ = train(cfg, (1, 1, 1), data)
  got, params, _ = train(make_cfg("parallel.offload_optimizer=true", "parallel.zero_stage=1"),
                         (8, 1, 1), data)
  np.testing.assert_allclose(got, ref, rtol=RTOL)
  assert_trees_close(params, ref_params, "parameter")
