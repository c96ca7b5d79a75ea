"""Device memory of ZeRO-3 (one layer unsharded at a time) and of optimizer offload, on 8x1x1.

Every figure comes from the compiled step (`memory_analysis()` through `hlo.memory`) and from the
state's shardings; nothing runs except the offload loss comparison. The model is one where
parameters dominate: 8 layers, d_model 256, d_ff 1024, one 32-token sequence per device.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config, hlo, plan
from jaxpar import mesh as jmesh
from jaxpar import model as jmodel
from jaxpar.step import Trainer

L, D, F, H, T, V = 8, 256, 1024, 4, 32, 256
N_DATA = 8
BIG = [f"model.n_layers={L}", f"model.d_model={D}", f"model.n_heads={H}", f"model.d_ff={F}",
       f"model.seq_len={T}", f"model.vocab_size={V}", "precision.compute_dtype=float32"]
F32 = 4


def make_trainer(*overrides: str, batch: int = N_DATA) -> tuple[Trainer, dict]:
  cfg = config.load(None, BIG + [f"train.batch_size={batch}", *overrides])
  shape = (N_DATA, 1, 1)
  jmesh.check(shape, cfg, N_DATA)
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:N_DATA]), jmodel.gpt(cfg)), \
      plan._batch_abstract(cfg)


@functools.lru_cache(maxsize=None)
def compiled(*overrides: str, batch: int = N_DATA):
  """(trainer, compiled step) of the big model on 8x1x1."""
  t, batch_abstract = make_trainer(*overrides, batch=batch)
  return t, t.lower(batch_abstract).compile()


def nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
             for a in jax.tree_util.tree_leaves(tree))


def sharded_bytes(abstract, shardings) -> int:
  """Bytes one device holds of `abstract` under `shardings`."""
  return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda a, s: plan.shard_bytes(a.shape, a.dtype, s), abstract, shardings)))


# -- ZeRO-3 ----------------------------------------------------------------------------------------

def activation_bound(b: int) -> int:
  """Bytes a step may keep for the backward on `b` sequences per device, whatever the sharding.

  Per layer a pre-norm block keeps at most 16 (b, T, D) tensors (block input, norms, q, k, v,
  attention output, residual sums and their statistics), 8 (b, T, F) ones (the MLP's input and
  output and GELU's intermediates) and 4 (b, H, T, T) ones (scores, probabilities, mask); the loss
  keeps 4 (b, T, V) logits-sized ones. All float32.
  """
  per_layer = 16 * T * D + 8 * T * F + 4 * H * T * T
  return F32 * b * (L * per_layer + 4 * T * V)


def test_zero3_holds_about_two_layers_unsharded():
  t, c = compiled("parallel.zero_stage=3")
  mem = hlo.memory(c)
  params = t.model.abstract
  layer = nbytes(params["layers"]) // L  # one layer's weights, unsharded
  top = nbytes({k: v for k, v in params.items() if k != "layers"})  # embeddings, head, final norm
  # Model state per device at stage 3: params, grads and both Adam moments, each 1/8 (measured
  # from the shardings, so leaves that do not divide by 8 count whole).
  shard = sharded_bytes(params, t.state_shardings["params"])
  assert abs(N_DATA * shard - nbytes(params)) <= 0.01 * nbytes(params)
  state = 4 * shard
  # Activations, measured: the same stage-3 step on 2 sequences per device less the one on 1;
  # weights and model state do not grow with the batch. The analytic bound keeps it honest.
  _, c2 = compiled("parallel.zero_stage=3", batch=2 * N_DATA)
  activations = hlo.memory(c2)["temp_bytes"] - mem["temp_bytes"]
  assert 0 < activations <= activation_bound(1), (activations, activation_bound(1))
  # Bound: model state + 2 layers whole (the gathered layer and its unreduced gradient) + the
  # small non-layer weights whole with their gradient + activations.
  bound = state + 2 * layer + 2 * top + activations
  used = mem["temp_bytes"] + mem["argument_bytes"]
  # Keeping every layer's gathered weights for the backward (what autodiff of the scan does
  # without re-gathering) would need 6 more layers than this.
  assert used <= bound, (f"temp {mem['temp_bytes']:,} + arguments {mem['argument_bytes']:,} = "
                         f"{used:,} > {bound:,} (layer {layer:,}, activations {activations:,})")


def test_zero3_gathers_inside_the_layer_loops():
  t, c = compiled("parallel.zero_stage=3")
  text = c.as_text()
  stack = nbytes(t.model.abstract["layers"])
  in_loops = hlo.collective_bytes_in_loops(text)["all-gather"]
  total = hlo.collective_bytes(text)["all-gather"]
  # Each layer is gathered once in the forward and once more in the backward, one layer per
  # iteration of the scans; a gather hoisted out of a loop would move the whole stack at once.
  assert in_loops == pytest.approx(2 * stack, rel=0.01), (in_loops, stack)
  top = nbytes({k: v for k, v in t.model.abstract.items() if k != "layers"})
  assert total - in_loops <= top, (total, in_loops, top)


def test_zero3_remat_also_regathers():
  t, c = compiled("parallel.zero_stage=3", "parallel.remat=true")
  stack = nbytes(t.model.abstract["layers"])
  assert hlo.collective_bytes_in_loops(c.as_text())["all-gather"] == pytest.approx(2 * stack,
                                                                                   rel=0.01)
  _, plain = compiled("parallel.zero_stage=3")
  assert hlo.memory(c)["temp_bytes"] <= hlo.memory(plain)["temp_bytes"]


def test_zero3_regather_with_grad_accum_matches_single_device():
  # Re-gathering sits inside the accumulation scan's body; the result must not change.
  import test_equivalence as eq
  data = eq.batches(eq.make_cfg(), 3)
  ref, ref_params, _ = eq.train(eq.make_cfg(), (1, 1, 1), data)
  got, params, _ = eq.train(eq.make_cfg("train.grad_accum=2", "parallel.zero_stage=3"),
                            (N_DATA, 1, 1), data)
  np.testing.assert_allclose(got, ref, rtol=eq.RTOL)
  eq.assert_trees_close(params, ref_params, "parameter")
