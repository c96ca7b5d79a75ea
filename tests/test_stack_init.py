"""`from_stack` initialises each of a stack's layers with its own key: the stacked parameters equal,
bit for bit, blocks built one at a time in plain Flax with the keys
`jax.random.split(k_layers, n_layers)` (k_embed, k_layers, k_head = jax.random.split(key, 3)), and
no two layers are alike. The embedding and the head are checked the same way."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_user_pipeline import PATH_RULES, Block, Embed, Head, LinenBlock, loss_fn

import jaxpar

L, B, T, D = 4, 2, 8, 16


def nnx_params(factory, key):
  with nnx.use_eager_sharding(False):
    return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(key)), nnx.Param))


def linen_params(key):
  return nn.unbox(LinenBlock().init(key, jnp.zeros((B, T, D), jnp.float32))["params"])


@pytest.mark.parametrize("linen", [False, True], ids=["nnx-block", "linen-block"])
def test_each_layer_is_initialised_with_its_own_key(linen):
  block = LinenBlock() if linen else Block
  kw = {"example_input": jnp.zeros((B, T), jnp.int32)} if linen else {}
  model = jaxpar.from_stack(Embed, block, Head, L, loss_fn, path_rules=PATH_RULES, **kw)
  key = jax.random.key(7)
  got = jax.device_get(model.init(key))

  k_embed, k_layers, k_head = jax.random.split(key, 3)
  one = linen_params if linen else (lambda k: nnx_params(Block, k))
  layers = [one(k) for k in jax.random.split(k_layers, L)]
  want = {"embed": nnx_params(Embed, k_embed),
          "layers": jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers),
          "head": nnx_params(Head, k_head)}
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
  # the randomly drawn leaves (kernels) differ between every two layers
  for path, x in jax.tree_util.tree_leaves_with_path(got["layers"]):
    if "kernel" in jax.tree_util.keystr(path):
      for i in range(L):
        for j in range(i):
          assert not np.array_equal(x[i], x[j]), (jax.tree_util.keystr(path), i, j)
