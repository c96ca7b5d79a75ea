"""Everything a user's own model may bring, at once: dropout, two inputs, a loss that sees the
parameters, a frozen layer and an own optax chain with two rates (multi_transform), for a Linen and
an NNX model, trained 10 steps on 1x1x1, 2x4x1 and 8x1x1 ZeRO-3: the same as plain JAX + optax on
one device drawing the same keys, and the frozen layer bit-identical."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_user_rng_inputs import (SEED, NNXMLP, LinenMLP, batch, ce, l2, linen_model, nnx_model)

import jaxpar
from jaxpar.parallel import rules

STEPS = 10
LAYOUTS = [("1x1x1", ()), ("2x4x1", ()), ("8x1x1", ("parallel.zero_stage=3",))]
frozen = lambda path: path == "up/kernel"  # the first layer's weights: fixed random features


def label(params):
  """down trains fast on Adam, up's bias slowly on SGD with momentum."""
  return jax.tree_util.tree_map_with_path(
      lambda p, _: "slow" if rules.path_str(p).startswith("up/") else "fast", params)


def tx():
  return optax.multi_transform({"fast": optax.adam(1e-2), "slow": optax.sgd(1e-2, momentum=0.9)},
                               label)


def run(model, mesh, overrides):
  cfg = jaxpar.config.load(None, [f"train.batch_size={len(batch()['x'])}", f"train.seed={SEED}",
                                  *overrides])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), model, tx=tx(), frozen=frozen)
  state = t.init(SEED)
  params0 = jax.device_get(state["params"])
  losses = []
  for _ in range(STEPS):
    state, m = t.step(state, batch())
    losses.append(float(m["loss"]))
  return params0, losses, jax.device_get(state["params"])


def reference(loss_of, params):
  """Plain JAX + optax on one device: up/kernel is a constant, not an optimizer input at all."""
  fixed = params["up"]["kernel"]
  train = {"up": {"bias": params["up"]["bias"]}, "down": params["down"]}
  whole = lambda p: {"up": {"kernel": fixed, "bias": p["up"]["bias"]}, "down": p["down"]}
  opt_tx = tx()
  opt = opt_tx.init(train)

  @jax.jit
  def step(train, opt, i):
    key = jax.random.fold_in(jax.random.key(SEED), i)
    value, grads = jax.value_and_grad(lambda p: loss_of(whole(p), key))(train)
    updates, opt = opt_tx.update(grads, opt, train)
    return optax.apply_updates(train, updates), opt, value
  losses = []
  for i in range(STEPS):
    train, opt, value = step(train, opt, i)
    losses.append(float(value))
  return losses, whole(train)


def linen_loss(p, key):
  b = batch()
  logits = LinenMLP().apply({"params": p}, b["x"], b["mask"], train=True, rngs={"dropout": key})
  return ce(logits, b) + l2(p)


def nnx_loss(p, key):
  b = batch()
  with nnx.use_eager_sharding(False):
    graphdef, _, streams = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param, nnx.RngState)
  model = nnx.merge(graphdef, p, streams)
  nnx.reseed(model, default=key)
  return ce(model(b["x"], b["mask"]), b) + l2(p)


MODELS = {"linen": (linen_model, linen_loss), "nnx": (nnx_model, nnx_loss)}


@pytest.mark.parametrize("mesh,overrides", LAYOUTS, ids=[m for m, _ in LAYOUTS])
@pytest.mark.parametrize("kind", MODELS)
def test_dropout_frozen_own_chain_two_inputs_train_like_plain_jax(kind, mesh, overrides):
  make, loss_of = MODELS[kind]
  params0, losses, params = run(make(), mesh, overrides)
  want_losses, want_params = reference(loss_of, params0)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params),
                               jax.tree_util.tree_leaves(want_params)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=rules.path_str(path))
  np.testing.assert_array_equal(params["up"]["kernel"], params0["up"]["kernel"])
  assert not np.array_equal(params["up"]["bias"], params0["up"]["bias"])  # the slow rate moved it
