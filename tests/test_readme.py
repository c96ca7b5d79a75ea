"""The own-model examples of docs/own-model.md, run exactly as written, and checked against one
device."""
import pathlib
import re

import numpy as np
import pytest

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "own-model.md"


def example(name: str) -> str:
  text = GUIDE.read_text()
  m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", text, re.S)
  assert m, f"docs/own-model.md has no example {name!r}"
  return m.group(1)


@pytest.mark.parametrize("name", ["nnx", "linen"])
def test_readme_example_trains_and_matches_one_device(name):
  code = example(name)
  assert 'make_mesh("2x4x1")' in code
  sharded = {}
  exec(compile(code, f"own-model:{name}", "exec"), sharded)
  single = {}
  exec(compile(code.replace('make_mesh("2x4x1")', 'make_mesh("1x1x1")'), f"own-model:{name}:1x1x1",
               "exec"), single)
  losses = np.array(sharded["losses"])
  assert losses[-1] < 0.5 * losses[0]
  # fp32, 1e-5 relative; the absolute floor covers the last steps, where the loss is near zero
  np.testing.assert_allclose(losses, single["losses"], rtol=1e-5, atol=1e-6)
  assert "'model'" in str(sharded["trainer"].layout.params)  # the hidden units really are split


def test_unmatched_parameter_is_an_error():
  import flax.linen as nn

  import jaxpar

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(x)
  with pytest.raises(ValueError, match=r"Dense_0/bias.*shape \(4,\)"):
    jaxpar.from_linen(M(), np.zeros((1, 8), np.float32), lambda o, b: (o.sum(), {}),
                      path_rules=[(r"kernel", ("embed", "mlp"))])


def test_indivisible_dimension_is_an_error():
  from flax import nnx

  import jaxpar

  class M(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(nnx.initializers.zeros(rngs.params(), (8, 6)), out_sharding=("embed", "mlp"))

    def __call__(self, x):
      return x @ self.w
  model = jaxpar.from_nnx(M, lambda o, b: (o.sum(), {}))
  with pytest.raises(jaxpar.ConfigError, match=r"w of shape \(8, 6\): dimension 6 is not divisible by model=4"):
    jaxpar.Trainer(jaxpar.config.load(), jaxpar.make_mesh("2x4x1"), model)


@pytest.mark.parametrize("name", ["nnx-checkpoint", "linen-checkpoint"])
def test_readme_end_to_end_example_continues_the_run_and_exports_a_users_model(name):
  """Evaluate, save on 2x4x1, load onto 8x1x1 ZeRO-3, export: the six losses are six unbroken
  steps' on 2x4x1, and the export says the model is the user's own."""
  import jax
  scope = {}
  exec(compile(example(name), f"own-model:{name}", "exec"), scope)
  assert scope["trainer"].layout.stage == 3 and scope["trainer"].mesh.shape["data"] == 8
  unbroken = scope["make_trainer"]("2x4x1")
  state, losses = unbroken.init(seed=0), []
  for _ in range(6):
    state, metrics = unbroken.step(state, scope["batch"])
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(scope["losses"], losses, rtol=1e-6, atol=1e-6)
  assert losses[-1] < losses[0]
  model = scope["info"]["model"]
  assert model["origin"] == "user" and model["params"] == {
      "up/kernel": {"shape": [32, 64], "dtype": "float32"},
      "down/kernel": {"shape": [64, 10], "dtype": "float32"}}
  assert scope["info"]["step"] == 3 and jax.device_get(scope["state"]["step"]) == 6
