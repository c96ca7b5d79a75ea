"""A user's model with dropout, several inputs and a loss that sees the parameters, the step's key
and the model's sown intermediates: the same training as plain JAX + optax on one device drawing
the same keys (fold_in(key(train.seed), step)), on every layout, with eval deterministic."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar

B, D, H, K, STEPS, SEED, L2 = 16, 8, 32, 4, 5, 3, 1e-3
LAYOUTS = [("1x1x1", ()), ("2x4x1", ()), ("8x1x1", ("parallel.zero_stage=3",)),
           ("4x1x1", ("train.grad_accum=2",))]
IDS = ["1x1x1", "2x4x1", "8x1x1-zero3", "4x1x1-accum2"]


def batch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, D)).astype(np.float32)
  mask = (rng.random((B, D)) > 0.3).astype(np.float32)
  return {"x": x, "mask": mask, "y": (x[:, :K].argmax(-1)).astype(np.int32)}


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x, mask, train: bool):
    h = nn.relu(nn.Dense(H, name="up")(x * mask))
    h = nn.Dropout(0.5, deterministic=not train)(h)
    self.sow("intermediates", "hidden", h)
    return nn.Dense(K, name="down")(h)


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    part, init = nnx.with_partitioning, nnx.initializers.lecun_normal()
    self.up = nnx.Linear(D, H, rngs=rngs, kernel_init=part(init, ("embed", "mlp")),
                         bias_init=part(nnx.initializers.zeros, ("mlp",)))
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.down = nnx.Linear(H, K, rngs=rngs, kernel_init=part(init, ("mlp", "embed")),
                           bias_init=part(nnx.initializers.zeros, ("embed",)))

  def __call__(self, x, mask):
    return self.down(self.drop(jax.nn.relu(self.up(x * mask))))


LINEN_RULES = [(r"up/kernel", ("embed", "mlp")), (r"up/bias", ("mlp",)),
               (r"down/kernel", ("mlp", "embed")), (r"down/bias", ("embed",))]


def ce(logits, b):
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def l2(params):
  return L2 * sum(jnp.sum(p ** 2) for p in jax.tree_util.tree_leaves(params))


def loss_with_l2(logits, b, params):
  return ce(logits, b) + l2(params), {}


def linen_model(**kw):
  kw = {"loss_fn": loss_with_l2, "loss_takes": ("params",), **kw}
  return jaxpar.from_linen(LinenMLP(), batch(), input_key=("x", "mask"), path_rules=LINEN_RULES,
                           train_kwarg="train", **kw)


def nnx_model():
  return jaxpar.from_nnx(NNXMLP, loss_with_l2, inputs=lambda b: (b["x"], b["mask"]),
                         loss_takes=("params",))


def run(model, mesh, overrides=(), tx=None, steps=STEPS):
  """-> (initial params, per-step losses, eval loss at the end, twice)."""
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", f"train.seed={SEED}", *overrides])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), model, tx=tx or optax.adam(1e-2))
  state = t.init(SEED)
  params0 = jax.device_get(state["params"])
  losses = []
  for _ in range(steps):
    state, m = t.step(state, batch())
    losses.append(float(m["loss"]))
  ev = t.eval_jitted(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch()))
  with jax.set_mesh(t.mesh):
    evals = [float(ev(state["params"], batch())["loss"]) for _ in range(2)]
  return params0, losses, evals, jax.device_get(state["params"])


def reference(loss_of, params):
  """Plain JAX + optax.adam on one device; loss_of(params, key) with key = fold_in(key(seed), i)."""
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, i):
    value, grads = jax.value_and_grad(loss_of)(params, jax.random.fold_in(jax.random.key(SEED), i))
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value
  losses = []
  for i in range(STEPS):
    params, opt, value = step(params, opt, i)
    losses.append(float(value))
  return losses, params


def linen_reference(params):
  b, module = batch(), LinenMLP()

  def loss_of(p, key):
    logits = module.apply({"params": p}, b["x"], b["mask"], train=True, rngs={"dropout": key})
    return ce(logits, b) + l2(p)
  return reference(loss_of, params)


def nnx_reference(params):
  b = batch()

  def loss_of(p, key):
    with nnx.use_eager_sharding(False):  # built in the trace: its streams may be reseeded there
      graphdef, _, streams = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param, nnx.RngState)
    model = nnx.merge(graphdef, p, streams)
    nnx.reseed(model, default=key)  # nnx.Rngs(0)'s one stream, which Dropout forks
    return ce(model(b["x"], b["mask"]), b) + l2(p)
  return reference(loss_of, params)


def no_dropout_loss(apply, params):
  b = batch()
  return float(ce(apply(params, b), b) + l2(params))


@pytest.fixture(scope="module")
def linen_one_device():
  return run(linen_model(), "1x1x1")


@pytest.fixture(scope="module")
def nnx_one_device():
  return run(nnx_model(), "1x1x1")


def test_linen_with_dropout_trains_like_plain_jax(linen_one_device):
  params0, losses, evals, final = linen_one_device
  want, want_final = linen_reference(params0)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  # eval is deterministic: the same twice, and the loss without dropout
  module, b = LinenMLP(), batch()
  plain = no_dropout_loss(lambda p, b: module.apply({"params": p}, b["x"], b["mask"], train=False),
                          final)
  assert evals[0] == evals[1] == pytest.approx(plain, rel=1e-5)


def test_nnx_with_dropout_trains_like_plain_jax(nnx_one_device):
  params0, losses, evals, final = nnx_one_device
  want, _ = nnx_reference(params0)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  with nnx.use_eager_sharding(False):
    graphdef, _, streams = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param, nnx.RngState)

  def apply(p, b):
    model = nnx.merge(graphdef, p, streams)
    model.eval()
    return model(b["x"], b["mask"])
  assert evals[0] == evals[1] == pytest.approx(no_dropout_loss(apply, final), rel=1e-5)


@pytest.mark.parametrize("mesh,overrides", LAYOUTS[1:], ids=IDS[1:])
def test_dropout_masks_do_not_depend_on_the_layout(linen_one_device, nnx_one_device, mesh, overrides):
  for make, (_, want, want_evals, _) in ((linen_model, linen_one_device),
                                         (nnx_model, nnx_one_device)):
    _, losses, evals, _ = run(make(), mesh, overrides)
    np.testing.assert_allclose(losses, want, rtol=1e-6 if not overrides else 1e-5)
    np.testing.assert_allclose(evals, want_evals, rtol=1e-5)


def test_masks_differ_between_steps_and_the_loss_sees_the_key():
  # lr 0: the parameters never change, so only the masks (the step's key) move the loss
  seen = []

  def loss_fn(logits, b, rng, aux):
    seen.append(rng)
    hidden = aux["hidden"][0]  # sown after dropout: about half its units are zero
    return ce(logits, b), {"dropped": jnp.mean(hidden == 0)}
  model = linen_model(loss_fn=loss_fn, loss_takes=("rng", "aux"))
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", f"train.seed={SEED}"])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh("2x1x1"), model, tx=optax.sgd(0.0))
  state = t.init(SEED)
  losses, dropped = [], []
  for _ in range(3):
    state, m = t.step(state, batch())
    losses.append(float(m["loss"]))
    dropped.append(float(m["dropped"]))
  assert len(set(losses)) == 3
  assert all(0.4 < d < 0.8 for d in dropped)  # relu's zeros and dropout's
  assert seen and all(k is not None for k in seen)


def test_whole_batch_input_and_bad_loss_takes():
  class TakesDict(nn.Module):
    @nn.compact
    def __call__(self, b):
      return nn.Dense(K, name="down")(b["x"] * b["mask"])
  model = jaxpar.from_linen(TakesDict(), batch(), lambda o, b: (ce(o, b), {}), input_key=None,
                            path_rules=[(r"kernel", ("mlp", "embed")), (r"bias", ("embed",))])
  _, losses, _, _ = run(model, "2x1x1", steps=2)
  assert all(np.isfinite(losses))
  with pytest.raises(jaxpar.ConfigError, match=r"loss_takes names 'grads'; it may name"):
    jaxpar.from_nnx(NNXMLP, loss_with_l2, loss_takes=("grads",))
  with pytest.raises(jaxpar.ConfigError, match=r"the batch has no key 'z'"):
    run(jaxpar.from_nnx(NNXMLP, lambda o, b: (ce(o, b), {}), input_key=("x", "z")), "1x1x1", steps=1)
