"""Rules a user extends or replaces: a model's own logical axis names, mapped to the mesh through
`jaxpar.Trainer(..., rules=jaxpar.rules.extended({...}))`, shard its parameters and activations
as asked and train the same numbers as one device; names no rule maps and tables that are not
tables are one sentence."""
import jax
import pytest
import test_equivalence as eq
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_user_models import B, V, batch, masked_loss

import jaxpar
from jaxpar.config import ConfigError

D, H = 16, 64
HIDDEN = jaxpar.rules.extended({"hidden": "model"})


class OwnNames(nnx.Module):
  """An MLP language model whose hidden layer is the user's own logical axis, `hidden`."""

  def __init__(self, rngs):
    part, init = nnx.with_partitioning, nnx.initializers.lecun_normal()
    self.emb = nnx.Embed(V, D, rngs=rngs, embedding_init=part(nnx.initializers.normal(0.02),
                                                               ("vocab", "embed")))
    self.up = nnx.Linear(D, H, rngs=rngs, kernel_init=part(init, ("embed", "hidden")),
                         bias_init=part(nnx.initializers.zeros, ("hidden",)))
    self.down = nnx.Linear(H, D, rngs=rngs, kernel_init=part(init, ("hidden", "embed")),
                           use_bias=False)
    self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs, kernel_init=part(init, ("embed", "vocab")))

  def __call__(self, x):
    h = self.emb(x)
    u = jaxpar.rules.constrain(self.up(h), ("batch", "seq", "hidden"))
    return self.head(h + self.down(jax.nn.gelu(u)))


def trainer(mesh, *overrides, rules=HIDDEN):
  cfg = jaxpar.config.load(None, [f"train.batch_size={B}", *overrides])
  return jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), jaxpar.from_nnx(OwnNames, masked_loss),
                        expose_grads=True, rules=rules)


def first_step(mesh, *overrides, rules=HIDDEN):
  t = trainer(mesh, *overrides, rules=rules)
  _, m = t.step(t.init(0), batch())
  return float(m["loss"]), jax.device_get(m["grads"]), t


@pytest.fixture(scope="module")
def one_device():
  return first_step("1x1x1")


@pytest.mark.parametrize("mesh,overrides", [("2x4x1", ()), ("8x1x1", ("parallel.zero_stage=3",)),
                                            ("2x2x1", ("parallel.sequence_parallel=true",))],
                         ids=["2x4x1", "8x1x1-zero3", "2x2x1-sp"])
def test_an_own_axis_name_is_split_as_its_rule_says_and_trains_like_one_device(one_device, mesh,
                                                                               overrides):
  want_loss, want_grads, _ = one_device
  loss, grads, t = first_step(mesh, *overrides)
  assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
  assert eq.rel_err(grads, want_grads) <= 1e-5
  assert t.specs["up"]["kernel"] == P(None, "model")
  assert t.specs["down"]["kernel"] == P("model", None)


def test_the_hidden_layer_is_split_over_model_in_the_compiled_step():
  t = trainer("1x4x1")
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch().items()}
  state = t.init(0)
  up = state["params"]["up"]["kernel"]
  assert up.sharding.spec == P(None, "model")
  assert {s.data.shape for s in up.addressable_shards} == {(D, H // 4)}
  assert t.lower(abstract).compile() is not None


def test_a_row_replaced_changes_only_that_row():
  rules = jaxpar.rules.extended({"hidden": "model", "vocab": None})
  assert dict(rules)["vocab"] is None and dict(rules)["mlp"] == "model"
  assert [k for k, _ in rules][:len(jaxpar.RULES)] == [k for k, _ in jaxpar.RULES]
  t = trainer("2x4x1", rules=rules)
  assert t.specs["emb"]["embedding"] == P(None, None)  # no longer vocab-parallel
  assert t.specs["up"]["kernel"] == P(None, "model")


def test_an_axis_no_rule_maps_is_one_sentence_naming_the_way_out():
  with pytest.raises(ConfigError, match=r"parameter (up|down)/kernel has the logical axis "
                                        r"'hidden', which no rule maps to the mesh \(known: batch, "
                                        r".*\); add one, e.g. .*rules\.extended\(\{'hidden': "
                                        r"'model'\}\)"):
    trainer("2x4x1", rules=None)


@pytest.mark.parametrize("rules,message", [
    ({"hidden": "tensor"}, r"rule \('hidden', 'tensor'\): a rule maps a logical axis name to one "
                           r"of the mesh axes data, model, pipeline"),
    ([("hidden", "model"), ("hidden", None)], r"rules give the logical axis 'hidden' two rows"),
    (["hidden"], r"rules must be \(logical axis, mesh axis\) pairs"),
], ids=["unknown-mesh-axis", "two-rows", "not-pairs"])
def test_a_table_that_is_not_one_is_one_sentence(rules, message):
  with pytest.raises(ConfigError, match=message):
    if isinstance(rules, dict):
      jaxpar.rules.extended(rules)
    else:
      trainer("1x1x1", rules=rules)


def test_an_own_axis_mapped_to_data_is_refused_like_jaxpars_own():
  with pytest.raises(ConfigError, match=r"parameter \S+ has logical axes \(.*'hidden'.*\), which "
                                        r"split it over the mesh axis 'data'"):
    trainer("1x1x1", rules=jaxpar.rules.extended({"hidden": "data"}))
