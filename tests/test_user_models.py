"""A user's own Flax model through the library API, on the layouts the README promises: its
activation constraints inside the step's shard_map, a masked loss whose pieces weigh what they
hold, and clear errors for batches and models the trainer cannot take."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_equivalence as eq
from flax import nnx

import jaxpar
from jaxpar.parallel import rules

V, D, F, T, B = 32, 16, 64, 8, 16


class LM(nnx.Module):
  """Embedding, one pre-norm MLP block with activation constraints, LM head."""

  def __init__(self, rngs):
    part, init = nnx.with_partitioning, nnx.initializers.lecun_normal()
    self.emb = nnx.Embed(V, D, rngs=rngs, embedding_init=part(nnx.initializers.normal(0.02),
                                                               ("vocab", "embed")))
    self.ln = nnx.LayerNorm(D, rngs=rngs, scale_init=part(nnx.initializers.ones, ("embed",)),
                            bias_init=part(nnx.initializers.zeros, ("embed",)))
    self.up = nnx.Linear(D, F, rngs=rngs, kernel_init=part(init, ("embed", "mlp")),
                         bias_init=part(nnx.initializers.zeros, ("mlp",)))
    self.down = nnx.Linear(F, D, rngs=rngs, kernel_init=part(init, ("mlp", "embed")),
                           bias_init=part(nnx.initializers.zeros, ("embed",)))
    self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs, kernel_init=part(init, ("embed", "vocab")))

  def __call__(self, x):
    h = rules.constrain(self.emb(x), ("batch", "seq", "embed"))
    u = rules.constrain(self.up(self.ln(h)), ("batch", "seq", "mlp"))
    return self.head(h + self.down(jax.nn.gelu(u)))


def masked_loss(logits, batch):
  """Mean cross-entropy and accuracy over the unmasked tokens; their count is the loss's weight
  (a piece with none is kept finite: max(count, 1))."""
  m = batch["m"]
  mean = lambda v: (v * m).sum() / jnp.maximum(m.sum(), 1)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return mean(ce), {"loss_weight": m.sum(), "accuracy": mean(logits.argmax(-1) == batch["y"])}


def batch():
  x = np.random.default_rng(0).integers(0, V, size=(B, T)).astype(np.int32)
  m = np.ones((B, T), np.float32)
  m[:B // 2, 2:] = 0  # the first half of the batch is mostly padding: the shards' counts differ
  m[B // 2:B // 2 + 3, 5:] = 0
  return {"x": x, "y": np.roll(x, 1, axis=1), "m": m}


def empty_shard_batch():
  """batch() with its first quarter all padding: on data=4 one shard holds no token at all."""
  b = batch()
  b["m"][:B // 4] = 0
  return b


def first_step(mesh, *overrides, make_batch=batch):
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", *overrides])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), jaxpar.from_nnx(LM, masked_loss), expose_grads=True)
  state = t.init(0)
  b = make_batch()
  ev = t.eval_jitted(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), b))
  with jax.set_mesh(t.mesh):
    evaluated = ev(state["params"], b)
  params = jax.device_get(state["params"])
  _, m = t.step(state, b)
  return (params, float(m["loss"]), float(evaluated["loss"]), float(m["loss_weight"]),
          jax.device_get(m["grads"]), (float(m["accuracy"]), float(evaluated["accuracy"])))


@pytest.fixture(scope="module")
def one_device():
  return first_step("1x1x1")


def test_the_one_device_loss_is_the_global_masked_mean(one_device):
  params, loss, eval_loss, weight, _, accuracy = one_device
  b = batch()
  with nnx.use_eager_sharding(False):
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: LM(nnx.Rngs(0)))), params)
  logits = model(b["x"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
  want = float((ce * b["m"]).sum() / b["m"].sum())
  assert loss == pytest.approx(want, rel=1e-6) and eval_loss == pytest.approx(want, rel=1e-6)
  assert weight == b["m"].sum()
  want_acc = float(((logits.argmax(-1) == b["y"]) * b["m"]).sum() / b["m"].sum())
  assert accuracy == pytest.approx((want_acc, want_acc), rel=1e-6)


# data x model with the model's own constraints; ZeRO-2 and -3; accumulation over microbatches
# whose weights differ, alone and with data shards
@pytest.mark.parametrize("mesh,overrides", [
    ("2x4x1", ()),
    ("8x1x1", ("parallel.zero_stage=3",)),
    ("4x2x1", ("parallel.zero_stage=2", "train.grad_accum=2")),
    ("1x1x1", ("train.grad_accum=2",)),
], ids=["2x4x1", "8x1x1-zero3", "4x2x1-zero2-accum2", "1x1x1-accum2"])
def test_a_weighted_loss_and_its_gradients_match_one_device(one_device, mesh, overrides):
  _, want_loss, _, want_weight, want_grads, want_acc = one_device
  _, loss, eval_loss, weight, grads, accuracy = first_step(mesh, *overrides)
  assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
  assert abs(eval_loss - want_loss) <= 1e-5 * abs(want_loss)
  assert weight == want_weight
  assert eq.rel_err(grads, want_grads) <= 1e-5
  # other metrics combine like the loss: the whole batch's masked accuracy
  assert accuracy == pytest.approx(want_acc, rel=1e-6)


@pytest.mark.parametrize("mesh,overrides", [("4x1x1", ()), ("1x1x1", ("train.grad_accum=4",)),
                                            ("4x1x1", ("parallel.zero_stage=3",))],
                         ids=["4x1x1", "1x1x1-accum4", "4x1x1-zero3"])
def test_a_piece_with_no_weight_adds_nothing(mesh, overrides):
  _, want_loss, _, want_weight, want_grads, want_acc = first_step("1x1x1", make_batch=empty_shard_batch)
  _, loss, eval_loss, weight, grads, accuracy = first_step(mesh, *overrides,
                                                           make_batch=empty_shard_batch)
  assert np.isfinite(loss) and abs(loss - want_loss) <= 1e-5 * abs(want_loss)
  assert abs(eval_loss - want_loss) <= 1e-5 * abs(want_loss)
  assert weight == want_weight
  assert eq.rel_err(grads, want_grads) <= 1e-5
  assert accuracy == pytest.approx(want_acc, rel=1e-6)


def test_batches_the_mesh_cannot_split_are_one_sentence():
  model = jaxpar.from_nnx(LM, masked_loss)
  b = batch()
  cases = [("4x2x1", [], {k: v[:6] for k, v in b.items()},
            r"batch leaf 'm' has 6 examples, not divisible by data=4"),
           ("8x1x1", ["train.grad_accum=4"], b,
            r"batch leaf 'm' has 16 examples, not divisible by data=8 x grad_accum=4"),
           ("2x1x1", [], {**b, "n": np.float32(3)}, r"batch leaf 'n' is a scalar")]
  for mesh, overrides, bad, message in cases:
    t = jaxpar.Trainer(jaxpar.config.load(None, [f"train.batch_size={B}", *overrides]),
                       jaxpar.make_mesh(mesh), model)
    with pytest.raises(jaxpar.ConfigError, match=message):
      t.step(t.init(0), bad)


def test_a_batch_of_another_shape_compiles_its_own_step():
  t = jaxpar.Trainer(jaxpar.config.load(None, [f"train.batch_size={B}"]), jaxpar.make_mesh("2x1x1"),
                     jaxpar.from_nnx(LM, masked_loss))
  state, m16 = t.step(t.init(0), batch())
  short = {k: v[:8] for k, v in batch().items()}  # e.g. a last, shorter batch
  state, m8 = t.step(state, short)
  assert np.isfinite(float(m8["loss"])) and int(state["step"]) == 2


def one_param(axes):
  """An NNX model of one (8, 8) parameter `w` with the logical `axes`."""
  class OneParam(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.zeros((8, 8)), out_sharding=axes)

    def __call__(self, x):
      return x @ self.w
  return OneParam


def test_model_errors_name_the_parameter():
  import flax.linen as nn

  with pytest.raises(jaxpar.ConfigError, match=r"parameter w has logical axes \('heads', 'mlp'\)"):
    jaxpar.Trainer(jaxpar.config.load(), jaxpar.make_mesh("2x4x1"),
                   jaxpar.from_nnx(one_param(("heads", "mlp")), lambda o, b: (o.sum(), {})))

  class WithBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
  with pytest.raises(ValueError, match=r"from_linen supports models whose variables are 'params' "
                                       r"only; found batch_stats"):
    jaxpar.from_linen(WithBatchNorm(), np.zeros((1, 8), np.float32), lambda o, b: (o.sum(), {}),
                      path_rules=[(r"kernel", ("embed", "mlp")), (r".", ("mlp",))])

  with pytest.raises(jaxpar.ConfigError, match=r"parameter w .* split it over the mesh axis 'data'"):
    jaxpar.Trainer(jaxpar.config.load(), jaxpar.make_mesh("2x1x1"),
                   jaxpar.from_nnx(one_param(("batch", "mlp")), lambda o, b: (o.sum(), {})))


def test_a_metric_named_like_the_steps_own_is_refused():
  shadowing = lambda logits, b: (masked_loss(logits, b)[0], {"grad_norm": jnp.float32(-1)})
  t = jaxpar.Trainer(jaxpar.config.load(None, [f"train.batch_size={B}"]), jaxpar.make_mesh("1x1x1"),
                     jaxpar.from_nnx(LM, shadowing))
  with pytest.raises(jaxpar.ConfigError, match=r"loss_fn returns the metric\(s\) 'grad_norm'"):
    t.step(t.init(0), batch())


def test_a_state_used_twice_is_a_clear_error():
  # the step donates its input state; on several CPU devices running it again crashed the process
  t = jaxpar.Trainer(jaxpar.config.load(None, [f"train.batch_size={B}"]), jaxpar.make_mesh("2x1x1"),
                     jaxpar.from_nnx(LM, masked_loss))
  state = t.init(0)
  t.step(state, batch())
  with pytest.raises(ValueError, match=r"this state was consumed by an earlier step"):
    t.step(state, batch())
  with pytest.raises(ValueError, match=r"the state is NoneType, not the dict Trainer.init"):
    t.step(None, batch())


def test_param_dtype_is_the_storage_of_a_users_model_too():
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", "precision.param_dtype=bfloat16"])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh("2x1x1"), jaxpar.from_nnx(LM, masked_loss))
  state = t.init(0)
  assert {x.dtype for x in jax.tree_util.tree_leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
  state, m = t.step(state, batch())
  assert {x.dtype for x in jax.tree_util.tree_leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
  assert np.isfinite(float(m["loss"]))
