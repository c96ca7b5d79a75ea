"""A user's stack of blocks (jaxpar.from_stack) through the pipeline: GPipe, 1F1B and the circular
schedule with ZeRO-3 give one device's plain-JAX loss and gradients, NNX and Linen blocks alike,
and what a stack cannot be is refused in one sentence."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_equivalence as eq
from flax import nnx

import jaxpar

V, D, F, T, B, L = 32, 16, 32, 8, 16, 4
RTOL = 1e-5
part, lecun = nnx.with_partitioning, nnx.initializers.lecun_normal()


class Embed(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(V, D, rngs=rngs,
                         embedding_init=part(nnx.initializers.normal(0.5), ("vocab", "embed")))

  def __call__(self, x):
    return self.emb(x)


class Block(nnx.Module):
  """A pre-norm MLP with a residual: x (B, T, D) -> x."""

  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs, scale_init=part(nnx.initializers.ones, ("embed",)),
                            bias_init=part(nnx.initializers.zeros, ("embed",)))
    self.up = nnx.Linear(D, F, rngs=rngs, kernel_init=part(lecun, ("embed", "mlp")),
                         bias_init=part(nnx.initializers.zeros, ("mlp",)))
    self.down = nnx.Linear(F, D, rngs=rngs, kernel_init=part(lecun, ("mlp", "embed")),
                           bias_init=part(nnx.initializers.zeros, ("embed",)))

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class Head(nnx.Module):
  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.out = nnx.Linear(D, V, use_bias=False, rngs=rngs, kernel_init=lecun)

  def __call__(self, x):
    return self.out(self.ln(x))


class LinenBlock(nn.Module):
  """Block in Linen, its kernels annotated, its biases matched by the path rules."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.Dense(F, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                             ("embed", "mlp")))(h)
    return x + nn.Dense(D, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "embed")))(jax.nn.gelu(h))


PATH_RULES = [(r"head/ln/(scale|bias)$", ("embed",)), (r"head/out/kernel$", ("embed", "vocab")),
              (r"layers/.*LayerNorm_0/(scale|bias)$", ("embed",)),
              (r"layers/Dense_0/bias$", ("mlp",)), (r"layers/Dense_1/bias$", ("embed",)),
              (r"layers/lin/kernel$", ("embed", "mlp")), (r"layers/lin/bias$", ("mlp",))]


def loss_fn(logits, batch):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
  return ce.mean(), {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def stack(block=Block, **kw):
  return jaxpar.from_stack(Embed, block, Head, L, loss_fn, path_rules=PATH_RULES, **kw)


def batch():
  x = np.random.default_rng(0).integers(0, V, size=(B, T)).astype(np.int32)
  return {"x": x, "y": np.roll(x, -1, axis=1)}


def first_step(model, mesh, *overrides, evaluate=False):
  """Initial params, the first step's loss and gradients (the model's layer order) [, eval loss]."""
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", "precision.compute_dtype=float32",
                                  *overrides])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), model, expose_grads=True)
  state = t.init(0)
  params = jax.device_get(t.to_logical(state)["params"])
  b = batch()
  evaluated = None
  if evaluate:
    ev = t.eval_jitted(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), b))
    with jax.set_mesh(t.mesh):
      evaluated = float(ev(state["params"], b)["loss"])
  _, m = t.step(state, b)
  grads = jax.device_get(t._reorder(m["grads"], None if t.layer_order is None
                                    else np.argsort(t.layer_order)))
  return params, (float(m["loss"]), float(m["accuracy"])), grads, evaluated


def graph(cls):
  with nnx.use_eager_sharding(False):
    return nnx.graphdef(nnx.eval_shape(lambda: cls(nnx.Rngs(0))))


def reference(params, block_apply):
  """Plain JAX on one device: the parts merged from `params`, the blocks in a Python loop."""
  embed, head = graph(Embed), graph(Head)

  def loss(p):
    x = nnx.merge(embed, p["embed"])(batch()["x"])
    for i in range(L):
      x = block_apply(jax.tree_util.tree_map(lambda a: a[i], p["layers"]), x)
    return loss_fn(nnx.merge(head, p["head"])(x), batch())
  (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return (float(value), float(metrics["accuracy"])), grads


def nnx_block(p, x):
  return nnx.merge(graph(Block), p)(x)


def linen_block(p, x):
  return LinenBlock().apply({"params": p}, x)


PIPE = ["parallel.microbatches=4"]
LAYOUTS = [
    ("1x1x1", ()),
    ("1x1x2", ("parallel.schedule=1f1b", *PIPE)),
    ("1x1x2", ("parallel.schedule=gpipe", *PIPE, "parallel.remat=full")),
    ("2x1x2", ("parallel.schedule=circular", "parallel.virtual_stages=2", "parallel.zero_stage=3",
               *PIPE)),
]
IDS = ["1x1x1", "1x1x2-1f1b", "1x1x2-gpipe-remat", "2x1x2-zero3-circular"]


@pytest.mark.parametrize("mesh,overrides", LAYOUTS, ids=IDS)
def test_nnx_stack_matches_plain_jax(mesh, overrides):
  params, (loss, accuracy), grads, evaluated = first_step(stack(), mesh, *overrides,
                                                          evaluate=True)
  (want_loss, want_accuracy), want_grads = reference(params, nnx_block)
  assert accuracy == pytest.approx(want_accuracy, rel=1e-6)  # loss_fn's metric, pipeline or not
  assert abs(loss - want_loss) <= RTOL * abs(want_loss)
  assert abs(evaluated - want_loss) <= RTOL * abs(want_loss)
  eq.assert_trees_close(grads, want_grads, "gradient")
  print(f"\nnnx {mesh} {overrides}: loss {abs(loss - want_loss) / abs(want_loss):.2e} grads "
        f"{eq.rel_err(grads, want_grads):.2e}")


@pytest.mark.parametrize("mesh,overrides", LAYOUTS[2:], ids=IDS[2:])
def test_linen_block_matches_plain_jax(mesh, overrides):
  model = stack(LinenBlock(), example_input=batch()["x"])
  params, (loss, _), grads, _ = first_step(model, mesh, *overrides)
  (want_loss, _), want_grads = reference(params, linen_block)
  assert abs(loss - want_loss) <= RTOL * abs(want_loss)
  eq.assert_trees_close(grads, want_grads, "gradient")
  print(f"\nlinen {mesh} {overrides}: loss {abs(loss - want_loss) / abs(want_loss):.2e} grads "
        f"{eq.rel_err(grads, want_grads):.2e}")


def test_stack_layout_and_logical_axes():
  model = stack()
  assert model.abstract["layers"]["up"]["kernel"].shape == (L, D, F)
  assert model.logical["layers"]["up"]["kernel"] == ("layers", "embed", "mlp")
  assert model.logical["head"]["out"]["kernel"] == ("embed", "vocab")
  assert model.pipeline is not None


def one_sentence(excinfo):
  message = str(excinfo.value)
  assert ". " not in message and "\n" not in message, message


class DropoutBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.lin(x))


class NormBlock(nnx.Module):
  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(D, rngs=rngs)

  def __call__(self, x):
    return self.bn(x)


class Widening(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, 2 * D, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


@pytest.mark.parametrize("make,message", [
    (lambda: stack(DropoutBlock), r"from_stack's block holds RNG streams .*, but a stack's blocks "
                                  r"run without a key"),
    (lambda: stack(NormBlock), r"from_stack's block holds state other than nnx.Param"),
    (lambda: stack(LinenBlock()), r"from_stack needs example_input="),
    (lambda: jaxpar.from_stack(Embed, Block, Head, 0, loss_fn), r"n_layers=0 must be a positive"),
], ids=["dropout", "batch-stats", "linen-without-example", "no-layers"])
def test_what_a_stack_cannot_hold_is_one_sentence(make, message):
  with pytest.raises(jaxpar.ConfigError, match=message) as excinfo:
    make()
  one_sentence(excinfo)


def trainer(model, mesh="1x1x2", *overrides):
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", *PIPE, *overrides])
  return jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), model)


def test_a_model_without_a_stack_or_a_stack_the_stages_do_not_divide_is_one_sentence():
  with pytest.raises(jaxpar.ConfigError, match=r"this model has no pipeline form \(give "
                                               r"jaxpar its stack of blocks with "
                                               r"jaxpar.from_stack\)") as e:
    trainer(jaxpar.from_nnx(Block, lambda out, b: (out.mean(), {})))
  one_sentence(e)
  three = jaxpar.from_stack(Embed, Block, Head, 3, loss_fn, path_rules=PATH_RULES)
  with pytest.raises(jaxpar.ConfigError, match=r"the model's 3 layers are not divisible by its 2 "
                                               r"pipeline stages") as e:
    trainer(three)
  one_sentence(e)
  with pytest.raises(jaxpar.ConfigError, match=r"4 pipeline stages \(pipeline=2 x "
                                               r"parallel.virtual_stages=2\)") as e:
    trainer(three, "1x1x2", "parallel.schedule=circular", "parallel.virtual_stages=2")
  one_sentence(e)


def test_what_the_step_finds_is_one_sentence():
  t = trainer(stack(Widening))
  with pytest.raises(jaxpar.ConfigError, match=r"block maps x of shape .* a stack's blocks must "
                                               r"keep their input's shape") as e:
    t.step(t.init(0), batch())
  one_sentence(e)
  weighted = lambda logits, b: (loss_fn(logits, b)[0], {"loss_weight": jnp.float32(B * T)})
  t = trainer(jaxpar.from_stack(Embed, Block, Head, L, weighted, path_rules=PATH_RULES))
  with pytest.raises(jaxpar.ConfigError, match=r"loss_fn's 'loss_weight' metric weighs") as e:
    t.step(t.init(0), batch())
  one_sentence(e)


@pytest.mark.parametrize("mesh,overrides", LAYOUTS[1:4:2], ids=IDS[1:4:2])
def test_ten_steps_with_an_own_optimizer_and_a_frozen_embedding_match_plain_jax(mesh, overrides):
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", "precision.compute_dtype=float32",
                                  *overrides])
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), stack(), tx=optax.adam(1e-2),
                     frozen=lambda path: path.startswith("embed/"))
  state = t.init(0)
  params0 = jax.device_get(t.to_logical(state)["params"])
  losses = []
  for _ in range(10):
    state, m = t.step(state, batch())
    losses.append(float(m["loss"]))
  embed, head, tx = graph(Embed), graph(Head), optax.adam(1e-2)

  def loss(train):
    x = nnx.merge(embed, params0["embed"])(batch()["x"])
    for i in range(L):
      x = nnx_block(jax.tree_util.tree_map(lambda a: a[i], train["layers"]), x)
    return loss_fn(nnx.merge(head, train["head"])(x), batch())[0]

  @jax.jit
  def step(train, opt):
    value, grads = jax.value_and_grad(loss)(train)
    updates, opt = tx.update(grads, opt, train)
    return optax.apply_updates(train, updates), opt, value
  train = {"layers": params0["layers"], "head": params0["head"]}
  opt, want = tx.init(train), []
  for _ in range(10):
    train, opt, value = step(train, opt)
    want.append(float(value))
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  final = jax.device_get(t.to_logical(state)["params"])
  eq.assert_trees_close({"layers": final["layers"], "head": final["head"]}, train, "parameter")
  np.testing.assert_array_equal(jax.tree_util.tree_leaves(final["embed"]),
                                jax.tree_util.tree_leaves(params0["embed"]))
