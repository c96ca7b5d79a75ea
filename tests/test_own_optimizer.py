"""A user's own optax transformation, frozen parameters and a user's own starting parameters, on
the layouts the README promises: the same training as plain JAX + optax on one device, frozen
parameters unchanged and stateless, the logged rate the transformation's own."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_equivalence as eq
from flax import nnx
from test_user_models import LM, B, batch, masked_loss

import jaxpar
from jaxpar.parallel import rules
from jaxpar.planning import plan
from jaxpar.train import checkpoint

STEPS = 10
FAST = optax.linear_schedule(1e-2, 1e-3, STEPS)  # changes every step: the logged rate must follow
frozen_emb = lambda path: path.startswith("emb/")


def user_tx():
  """Clipping over what it is given, then two learning rates: the head slower, on its own Adam."""
  label = lambda params: jax.tree_util.tree_map_with_path(
      lambda p, _: "slow" if rules.path_str(p).startswith("head/") else "fast", params)
  return optax.chain(
      optax.clip_by_global_norm(0.05),  # active from the first step (the gradient norm is ~1)
      optax.multi_transform({"fast": optax.inject_hyperparams(optax.adamw)(FAST, weight_decay=0.1),
                             "slow": optax.inject_hyperparams(optax.adam)(1e-3)}, label))


def trainer(mesh, *overrides, **kw):
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", *overrides])
  return jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), jaxpar.from_nnx(LM, masked_loss), **kw)


def reference():
  """Plain JAX + optax on one device: the embedding is a constant, not an optimizer input at all,
  so it neither changes nor counts in the clipping norm. -> (losses, rates, final params)."""
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(LM(nnx.Rngs(0)), nnx.Param)
  params = nnx.to_pure_dict(state)
  emb, train = params["emb"], {k: v for k, v in params.items() if k != "emb"}
  b = batch()

  def loss(train):
    model = nnx.merge(graphdef, {**train, "emb": emb})
    return masked_loss(model(b["x"]), b)[0]
  tx = user_tx()

  @jax.jit
  def step(train, opt):
    value, grads = jax.value_and_grad(loss)(train)
    updates, opt = tx.update(grads, opt, train)
    return optax.apply_updates(train, updates), opt, value
  opt = tx.init(train)
  losses, rates = [], []
  for i in range(STEPS):
    train, opt, value = step(train, opt)
    losses.append(float(value))
    rates.append(float(FAST(i)))
  return losses, rates, {**train, "emb": emb}


@pytest.fixture(scope="module")
def want():
  return reference()


@pytest.mark.parametrize("mesh,overrides", [
    ("1x1x1", ()), ("2x4x1", ()), ("8x1x1", ("parallel.zero_stage=3",))],
    ids=["1x1x1", "2x4x1", "8x1x1-zero3"])
def test_own_tx_with_a_frozen_embedding_trains_like_plain_optax(want, mesh, overrides):
  want_losses, want_rates, want_params = want
  t = trainer(mesh, *overrides, tx=user_tx(), frozen=frozen_emb)
  state = t.init(0)
  emb0 = np.asarray(jax.device_get(state["params"]["emb"]["embedding"]))
  losses, rates = [], []
  for _ in range(STEPS):
    state, m = t.step(state, batch())
    losses.append(float(m["loss"]))
    rates.append(float(m["learning_rate"]))
  params = jax.device_get(state["params"])
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert eq.rel_err(params, want_params) <= 1e-5
  assert np.asarray(params["emb"]["embedding"]).tobytes() == emb0.tobytes()
  # the first inject_hyperparams rate in the state (the 'fast' group), as it was applied
  np.testing.assert_allclose(rates, want_rates, rtol=1e-6)


def opt_bytes_per_device(state) -> int:
  """Bytes of the optimizer state held by the first device."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(state["opt"])
             for s in x.addressable_shards if s.device == dev)


@pytest.mark.parametrize("tx", [None, "own"], ids=["config-adamw", "own-tx"])
def test_frozen_parameters_hold_no_optimizer_state_and_the_rest_is_sharded(tx):
  kw = {} if tx is None else {"tx": user_tx()}
  with_all = trainer("8x1x1", "parallel.zero_stage=1", **kw).init(0)
  t = trainer("8x1x1", "parallel.zero_stage=1", frozen=frozen_emb, **kw)
  without_emb = t.init(0)
  emb = t.model.abstract["emb"]["embedding"]
  emb_bytes = int(np.prod(emb.shape)) * emb.dtype.itemsize
  n_params = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                 for a in jax.tree_util.tree_leaves(t.model.abstract))
  # Adam's two moments of the embedding, each split over the 8 data shards, are gone ...
  assert opt_bytes_per_device(with_all) - opt_bytes_per_device(without_emb) == 2 * emb_bytes // 8
  # ... and the others are split too (multi_transform's masked moments included): two moments
  # of every parameter over 8 shards, plus counts and hyperparameters (under 100 bytes)
  assert opt_bytes_per_device(with_all) < 2 * n_params / 8 + 100
  frozen_leaves = jax.tree_util.tree_leaves(without_emb["opt"], is_leaf=lambda x: x is None)
  assert not any(np.shape(x) == emb.shape for x in frozen_leaves)


def test_plan_reports_the_optimizer_bytes_frozen_parameters_do_not_take():
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", "parallel.zero_stage=1"])
  model = jaxpar.from_nnx(LM, masked_loss)
  every = plan.plan(cfg, "8x1x1", model=model, batch=batch())
  report = plan.plan(cfg, "8x1x1", model=model, batch=batch(), frozen=frozen_emb)
  emb = next(p for p in report["parameters"] if p["path"] == "emb/embedding")
  emb_bytes = int(np.prod(emb["shape"])) * 4
  # AdamW's two moments of the embedding, each split over the 8 data shards, are not there
  assert (every["bytes_per_device"]["opt_state"] - report["bytes_per_device"]["opt_state"]
          == 2 * emb_bytes // 8)
  assert every["bytes_per_device"]["params"] == report["bytes_per_device"]["params"]


def test_frozen_with_the_configs_adamw_keeps_them_bit_identical_and_out_of_the_norm():
  t = trainer("2x1x1", "train.lr=1e-2", "train.warmup_steps=0", frozen=frozen_emb)
  full = trainer("1x1x1", "train.lr=1e-2", "train.warmup_steps=0", expose_grads=True)
  before = jax.tree_util.tree_map(np.array, jax.device_get(full.init(0)["params"]))  # writable
  # -0.0 stays negative. This does not show the step's restore of frozen leaves at work: without
  # it they get p + 0 (with_frozen's zero update), which XLA folds to p, so -0.0, NaN payloads and
  # denormals all came through unchanged with the restore removed (1x1x1, 2x1x1, 8x1x1 ZeRO-3).
  # What keeps them is that zero update, checked on its own below.
  before["emb"]["embedding"][0] = -0.0
  ref, state = full.init_with(before), t.init_with(before)
  _, m_ref = full.step(ref, batch())
  for _ in range(3):
    state, m = t.step(state, batch())
    if int(state["step"]) == 1:
      g = m_ref["grads"]
      without_emb = np.sqrt(sum(float(jnp.sum(x ** 2)) for k, v in g.items() if k != "emb"
                                for x in jax.tree_util.tree_leaves(v)))
      assert float(m["grad_norm"]) == pytest.approx(without_emb, rel=1e-5)
  after = jax.device_get(state["params"])
  assert after["emb"]["embedding"].tobytes() == before["emb"]["embedding"].tobytes()
  assert not np.array_equal(after["head"]["kernel"], before["head"]["kernel"])
  # the optimizer itself: given gradients of ones (the step zeroes a frozen leaf's, so these are
  # what it would see if that went wrong), AdamW with its weight decay moves every trainable
  # leaf and gives the frozen embedding an update of exactly zero
  params = jax.device_get(t.init_with(before)["params"])
  ones = jax.tree_util.tree_map(np.ones_like, params)
  updates, _ = t.tx.update(ones, t.tx.init(params), params)
  for path, u in jax.tree_util.tree_leaves_with_path(jax.device_get(updates)):
    if jax.tree_util.keystr(path).startswith("['emb']"):
      assert not np.any(u), path
    else:
      assert np.all(u != 0), path


def test_frozen_parameters_with_the_optimizer_offloaded_train_like_one_device():
  """The config's AdamW, its clipping active, with a frozen embedding and the optimizer in host
  memory on 4x1x1 ZeRO-3: one device's losses and parameters, the embedding bit-identical."""
  keys = ("train.lr=1e-2", "train.warmup_steps=0", "train.clip_norm=0.05")
  ref = trainer("1x1x1", *keys, frozen=frozen_emb)
  t = trainer("4x1x1", *keys, "parallel.zero_stage=3", "parallel.offload_optimizer=true",
              frozen=frozen_emb)
  a, b = ref.init(0), t.init(0)
  emb = np.array(jax.device_get(b["params"]["emb"]["embedding"]))
  for _ in range(2):
    a, m_ref = ref.step(a, batch())
    b, m = t.step(b, batch())
    assert float(m["loss"]) == pytest.approx(float(m_ref["loss"]), rel=1e-5)
  for x, y in zip(jax.tree_util.tree_leaves(jax.device_get(b["params"])),
                  jax.tree_util.tree_leaves(jax.device_get(a["params"]))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  assert np.asarray(jax.device_get(b["params"]["emb"]["embedding"])).tobytes() == emb.tobytes()
  assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(b["opt"])} == {"pinned_host"}


def traced_bytes(jaxpr, acc=None) -> dict:
  """{primitive name: bytes of its results} over a jaxpr and every jaxpr inside it (shard_map's,
  custom_vjp's, scan's bodies), each counted once."""
  import jax.extend.core as jcore
  acc = {} if acc is None else acc
  subs = lambda v: ([v.jaxpr] if isinstance(v, jcore.ClosedJaxpr) else [v] if isinstance(
      v, jcore.Jaxpr) else [j for x in v for j in subs(x)] if isinstance(v, (list, tuple)) else [])
  for e in jaxpr.eqns:
    acc[e.primitive.name] = acc.get(e.primitive.name, 0) + sum(
        int(np.prod(o.aval.shape)) * o.aval.dtype.itemsize for o in e.outvars
        if hasattr(o.aval, "shape"))
    for v in e.params.values():
      for j in subs(v):
        traced_bytes(j, acc)
  return acc


def test_no_backward_into_a_frozen_embedding_at_zero3():
  """At ZeRO-3 the step's program (its jaxpr, before XLA) has no backward into a frozen embedding:
  its reduce-scatter (the transpose of its all-gather) and the embedding's scatter-add gradient
  are gone, and the compiled step moves one embedding shard less. XLA would drop that gradient
  anyway, since the step zeroes it, so the compiled bytes alone cannot tell; the jaxpr can."""
  from jaxpar.analysis import hlo
  b = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch())
  traced, compiled = {}, {}
  for name, frozen in (("all", None), ("frozen", frozen_emb)):
    t = trainer("8x1x1", "parallel.zero_stage=3", frozen=frozen)
    state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   t.abstract_state, t.state_shardings)
    with jax.set_mesh(t.mesh):
      traced[name] = traced_bytes(t.jitted(b).trace(state, b).jaxpr.jaxpr)
    compiled[name] = hlo.collective_bytes(t.lower(b).compile().as_text())["reduce-scatter"]
  emb = t.model.abstract["emb"]["embedding"]
  emb_bytes = int(np.prod(emb.shape)) * emb.dtype.itemsize  # (V, D) float32
  print({k: {p: v[p] for p in ("reduce_scatter", "scatter-add")} for k, v in traced.items()},
        compiled)
  assert traced["all"]["reduce_scatter"] - traced["frozen"]["reduce_scatter"] == emb_bytes // 8
  # the embedding lookup's gradient: one (V, D) scatter-add per data shard
  assert traced["all"]["scatter-add"] - traced["frozen"]["scatter-add"] == emb_bytes
  assert compiled["all"] - compiled["frozen"] == emb_bytes // 8


def test_decay_mask_overrides_the_logical_axes():
  params = jax.tree_util.tree_map(jnp.ones_like, trainer("1x1x1").model.abstract)  # biases too
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  for mask, decayed in [(None, {"emb/embedding", "up/kernel", "down/kernel", "head/kernel"}),
                        (lambda path: path.endswith("bias"), {"ln/bias", "up/bias", "down/bias"})]:
    tx = trainer("1x1x1", "train.weight_decay=0.1", "train.warmup_steps=0", decay_mask=mask).tx
    updates, _ = tx.update(zeros, tx.init(params), params)  # zero gradients: decay only
    moved = {rules.path_str(p) for p, u in jax.tree_util.tree_leaves_with_path(updates)
             if float(jnp.abs(u).max()) > 0}
    assert moved == decayed


def test_the_logged_rate_is_nan_without_an_injected_one_and_offload_is_refused():
  t = trainer("1x1x1", tx=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2)))
  _, m = t.step(t.init(0), batch())
  assert np.isnan(float(m["learning_rate"])) and np.isfinite(float(m["loss"]))
  with pytest.raises(jaxpar.ConfigError, match=r"offload_optimizer .* cannot take a tx of your own"):
    trainer("2x1x1", "parallel.offload_optimizer=true", tx=optax.sgd(1e-2))
  # the offloaded update applies the config's decay mask, so one of your own is refused, not dropped
  with pytest.raises(jaxpar.ConfigError, match=r"offload_optimizer .* cannot take a decay_mask"):
    trainer("2x1x1", "parallel.offload_optimizer=true", decay_mask=lambda path: False)
  with pytest.raises(jaxpar.ConfigError, match=r"decay_mask chooses what the config's AdamW decays"):
    trainer("1x1x1", tx=optax.sgd(1e-2), decay_mask=lambda path: False)


def test_checkpoints_of_an_own_tx_restore_on_another_mesh(tmp_path):
  a = trainer("2x4x1", "parallel.zero_stage=2", tx=user_tx(), frozen=frozen_emb)
  state, _ = a.step(a.init(0), batch())
  saved = jax.device_get(state)
  with checkpoint.Checkpointer(str(tmp_path), keep=1, every=1, async_save=False) as ckpt:
    ckpt.maybe_save(1, state, {}, force=True)
  b = trainer("8x1x1", "parallel.zero_stage=3", tx=user_tx(), frozen=frozen_emb)
  with checkpoint.Checkpointer(str(tmp_path), keep=1, every=1) as ckpt:
    restored, _ = b.restore(ckpt, 1)
  assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(saved)
  for x, y in zip(jax.tree_util.tree_leaves(jax.device_get(restored)), jax.tree_util.tree_leaves(saved)):
    assert np.array_equal(x, y)
  _, m = b.step(restored, batch())  # and trains on from there
  assert np.isfinite(float(m["loss"])) and float(m["learning_rate"]) == pytest.approx(float(FAST(1)))


@pytest.mark.parametrize("mesh,overrides", [("2x4x1", ()), ("8x1x1", ("parallel.zero_stage=3",))],
                         ids=["2x4x1", "8x1x1-zero3"])
def test_init_with_numpy_or_one_device_parameters(mesh, overrides):
  t = trainer(mesh, *overrides)
  params = jax.tree_util.tree_map(np.asarray, t.model.init(jax.random.key(1)))
  # numpy, and jax arrays committed to one device (a jit of the state's shardings refused those)
  for given in (params, jax.device_put(params, jax.devices()[0])):
    state = t.init_with(given)
    for path, x in jax.tree_util.tree_leaves_with_path(state["params"]):
      assert x.sharding.is_equivalent_to(_at(t.state_shardings["params"], path), x.ndim)
    got = jax.tree_util.tree_leaves(jax.device_get(state["params"]))
    assert all(np.array_equal(x, y) for x, y in zip(got, jax.tree_util.tree_leaves(params)))
  _, m = t.step(state, batch())
  assert np.isfinite(float(m["loss"]))


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def test_init_with_a_wrong_tree_is_one_sentence():
  t = trainer("2x1x1")
  params = jax.tree_util.tree_map(np.asarray, t.model.init(jax.random.key(1)))
  wrong = {**params, "up": {**params["up"], "kernel": np.zeros((3, 3), np.float32)}}
  with pytest.raises(jaxpar.ConfigError, match=r"^parameter up/kernel has shape \(3, 3\), the "
                                               r"model's is \(16, 64\)$"):
    t.init_with(wrong)
  with pytest.raises(jaxpar.ConfigError, match=r"^the parameters are not the model's tree: missing "
                                               r"head/kernel; not in the model lm_head/kernel$"):
    t.init_with({**{k: v for k, v in params.items() if k != "head"}, "lm_head": params["head"]})


def test_readme_example_runs():
  # test_readme.py runs the nnx and linen examples; this one is run here, as written
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  code = re.search(r"<!-- example: own-optimizer -->\s*```python\n(.*?)```", text, re.S).group(1)
  scope = {}
  exec(compile(code, "README:own-optimizer", "exec"), scope)
  assert scope["losses"][-1] < 0.5 * scope["losses"][0]
  assert float(scope["metrics"]["learning_rate"]) == pytest.approx(
      float(optax.cosine_decay_schedule(1e-2, 40)(39)), rel=1e-5)
