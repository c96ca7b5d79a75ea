"""Every distinct layout against one device: same inputs, per-step losses, gradients and final
parameters.

Tolerance (fp32): 1e-5 relative. Losses are compared step by step; gradients and parameters leaf
by leaf as ||a - b|| <= 1e-5 ||b||, which is what "relative" means for a tensor. No absolute floor:
every leaf of the decoder has a nonzero gradient (the key bias, whose exact gradient is zero, is
not a parameter).

Layouts are distinct programs only: with data = 1 the ZeRO stages shard nothing and compile to the
same step, so tensor parallelism alone is run once per mesh, and the stages are run where `data`
splits something (4x2x1 with tensor parallelism, 2x2x2 with a pipeline, 8x1x1 pure data).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config
from jaxpar.data import synthetic_windows
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import zero
from jaxpar.train.step import Trainer

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


def rel_err(got, want):
  """|got - want| / |want| over all leaves of two trees, as one float64 vector each."""
  g, w = (np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree_util.tree_leaves(t)])
          for t in (got, want))
  return np.linalg.norm(g - w) / np.linalg.norm(w)


def assert_trees_close(got, want, what):
  flat_w = dict(jax.tree_util.tree_leaves_with_path(want))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = np.asarray(flat_w[path], np.float64)
    err, norm = np.linalg.norm(np.asarray(g, np.float64) - w), np.linalg.norm(w)
    assert err <= RTOL * norm, (
        f"{what} {jax.tree_util.keystr(path)}: |a-b| = {err:.3e}, |b| = {norm:.3e}")


@pytest.fixture(scope="module")
def reference():
  cfg = make_cfg()
  data = batches(cfg)
  return data, train(cfg, (1, 1, 1), data)


# (mesh, ZeRO stage): every stage where `data` > 1 splits state; tensor parallelism alone once.
LAYOUTS = ([((4, 2, 1), z) for z in range(4)] + [((2, 2, 2), z) for z in range(4)]
           + [((8, 1, 1), 0), ((8, 1, 1), 3), ((1, 8, 1), 0)])


def layout_id(shape, stage):
  d, m, p = shape
  return f"data{d}-model{m}-pipeline{p}-zero{stage}-vs-1x1x1"


@pytest.mark.parametrize("shape,stage", LAYOUTS, ids=[layout_id(s, z) for s, z in LAYOUTS])
def test_layout_matches_single_device(reference, shape, stage):
  data, (ref_losses, ref_params, ref_grads) = reference
  losses, params, grads = train(make_cfg(f"parallel.zero_stage={stage}"), shape, data)
  assert ref_losses[-1] < 0.97 * ref_losses[0]  # the reference learns, so agreeing means something
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(grads, ref_grads, "gradient")
  assert_trees_close(params, ref_params, "parameter")


def test_grad_accum_4_2x2x1_zero2_vs_large_batch_1x1x1(reference):
  data, (ref_losses, ref_params, _) = reference
  losses, params, _ = train(make_cfg("train.grad_accum=4", "parallel.zero_stage=2"), (2, 2, 1), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(params, ref_params, "parameter")


def test_grouped_query_attention_2x4x1_zero3_vs_1x1x1():
  """Grouped-query attention whose heads are twice d_model / n_heads wide (model.head_dim=16):
  the q/k/v matmul joined by kv head and split over `model` with a width that is not d_model."""
  keys = ("model.n_kv_heads=4", "model.head_dim=16")
  cfg = make_cfg(*keys)
  data = batches(cfg, 2)
  ref, _, ref_grads = train(cfg, (1, 1, 1), data)
  assert ref_grads["layers"]["wq"].shape == (2, 64, 128)
  got, _, grads = train(make_cfg(*keys, "parallel.zero_stage=3"), (2, 4, 1), data)
  np.testing.assert_allclose(got, ref, rtol=RTOL)
  assert_trees_close(grads, ref_grads, "gradient")


def test_offload_optimizer_8x1x1_zero3_vs_1x1x1(reference):
  """Against the module's one-device run (its 5 steps: no second reference of the same model)."""
  data, (ref, ref_params, _) = reference
  got, params, _ = train(make_cfg("parallel.offload_optimizer=true", "parallel.zero_stage=3"),
                         (8, 1, 1), data)
  np.testing.assert_allclose(got, ref, rtol=RTOL)
  assert_trees_close(params, ref_params, "parameter")


@pytest.mark.parametrize("combine", [False, True], ids=["each-weight-alone", "weights-combined"])
def test_zero3_gathers_each_weight_alone_or_a_layer_at_once_and_matches_single_device(
    reference, monkeypatch, combine):
  """Stage 3's two ways to gather a layer (zero.gather): each weight in its own all-gather (GPUs
  and TPUs, whose compilers combine collectives) or the layer's weights in one (the CPU's). The
  layouts above run the backend's choice; here both, on 8x1x1 (data on a weight's first or second
  dimension), and the combined program has one all-gather per layer loop."""
  monkeypatch.setattr(zero, "COMBINE", combine)
  data, (ref_losses, ref_params, ref_grads) = reference
  cfg = make_cfg("parallel.zero_stage=3")
  losses, params, grads = train(cfg, (8, 1, 1), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(grads, ref_grads, "gradient")
  assert_trees_close(params, ref_params, "parameter")
  t = trainer(cfg, (8, 1, 1))
  tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32)
  text = t.lower({"tokens": tokens}).compile().as_text()
  in_loops = [line for line in text.splitlines() if " all-gather(" in line and "/while/body/" in line]
  sharded = sum(d >= 0 for d in jax.tree_util.tree_leaves(t.layout.dims["layers"]))
  assert sharded > 1
  # A layer's weights are gathered in the forward loop and again in the backward's (regather;
  # alone, the weights the backward does not read, biases, are not gathered there).
  forward = [line for line in in_loops if "transpose(" not in line]
  assert len(forward) == (1 if combine else sharded), (len(forward), sharded)
  backward = len(in_loops) - len(forward)
  assert (backward == 1) if combine else (1 < backward <= sharded), (backward, sharded)
