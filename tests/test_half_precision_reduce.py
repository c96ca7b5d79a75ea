"""Half precision on layouts that sum over devices: every sum over `data` (all-reduce, and the
reduce-scatter that is the transpose of ZeRO-3's all-gather), over `pipeline`, and sequence
parallelism's reduce-scatters over `model` (forward and backward) runs in float32, and the first
step's loss and gradients match one device's.

A bfloat16 sum over many devices drops the small terms; XLA:CPU also aborted the process
compiling this step's bfloat16 all-reduce (`Invalid binary instruction opcode copy`), so the
program is checked before it is compiled.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_equivalence as eq

HALF = ["precision.param_dtype=bfloat16"]
LAYOUTS = {"2x1x1-zero0": ((2, 1, 1), ["parallel.zero_stage=0"]),
           "2x1x1-zero2": ((2, 1, 1), ["parallel.zero_stage=2"]),
           "2x2x1-zero3": ((2, 2, 1), ["parallel.zero_stage=3"]),
           "2x1x2-zero3-pipeline": ((2, 1, 2), ["parallel.zero_stage=3", "parallel.microbatches=2"])}
GRAD_RTOL = 2e-2  # bfloat16 gradients (8 bits of mantissa), summed in a different order


def half_reductions(text: str) -> list[str]:
  """The all-reduces and reduce-scatters of a lowered program whose result is bfloat16/float16."""
  lines, found = text.splitlines(), []
  for i, line in enumerate(lines):
    if "stablehlo.all_reduce" in line or "stablehlo.reduce_scatter" in line:
      end = next(j for j in range(i, len(lines)) if "}) :" in lines[j])  # after the sum's region
      if re.search(r"-> tensor<[^>]*(bf16|f16)>", lines[end]):
        found.append(line.strip()[:80])
  return found


def first_grads(shape, extra):
  cfg = eq.make_cfg(*HALF, *extra)
  t = eq.trainer(cfg, shape, expose_grads=True)
  batch = {"tokens": jnp.asarray(eq.batches(cfg, 1)[0])}
  state = t.init(cfg.train.seed)
  _, m = t.step(state, batch)
  order = None if t.layer_order is None else np.argsort(t.layer_order)
  return float(m["loss"]), jax.device_get(t._reorder(m["grads"], order))


@pytest.fixture(scope="module")
def one_device():
  return first_grads((1, 1, 1), [])


@pytest.mark.parametrize("name", LAYOUTS)
def test_half_precision_gradients_are_summed_in_float32(one_device, name):
  shape, extra = LAYOUTS[name]
  cfg = eq.make_cfg(*HALF, *extra)
  t = eq.trainer(cfg, shape)
  batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32)
  text = t.lower({"tokens": batch}).as_text()
  assert re.search(r"stablehlo\.(all_reduce|reduce_scatter)", text), "nothing summed: wrong layout"
  assert half_reductions(text) == []
  loss, grads = first_grads(shape, extra)
  want_loss, want_grads = one_device
  assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree_util.tree_leaves(grads))
  assert eq.rel_err(grads, want_grads) < GRAD_RTOL


# Sequence parallelism with bfloat16 activations: the row-parallel reduce-scatter along seq and the
# column-parallel backward's (the transpose of its all-gather) sum half-precision partial sums.
SP = ["parallel.sequence_parallel=true", "precision.compute_dtype=bfloat16"]
SP_LOSS_RTOL = 1e-3  # a bfloat16 forward (8 bits of mantissa) summed in another order; measured ~1e-5


def first_step(shape, extra, check=None):
  """(loss, grads) of one step; `check` sees the lowered program's text before it is compiled."""
  cfg = eq.make_cfg(*extra)
  t = eq.trainer(cfg, shape, expose_grads=True)
  batch = {"tokens": jnp.asarray(eq.batches(cfg, 1)[0])}
  lowered = t.lower(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
  if check:
    check(lowered.as_text())
  step = lowered.compile()
  with jax.set_mesh(t.mesh):
    _, m = step(t.init(cfg.train.seed), batch)
  return float(m["loss"]), jax.device_get(m["grads"])


@pytest.fixture(scope="module")
def one_device_bf16():
  return {kind: first_step((1, 1, 1), [f"model.kind={kind}", SP[1]]) for kind in ("gpt", "llama")}


def sums_seq_in_float32(text):
  assert "stablehlo.reduce_scatter" in text, "no reduce-scatter: sequence parallelism is off"
  assert half_reductions(text) == []


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("shape", [(1, 2, 1), (2, 2, 1)], ids=["1x2x1", "2x2x1"])
def test_sequence_parallel_bf16_sums_in_float32(one_device_bf16, kind, shape):
  loss, grads = first_step(shape, [f"model.kind={kind}", *SP], check=sums_seq_in_float32)
  want_loss, want_grads = one_device_bf16[kind]
  assert abs(loss - want_loss) <= SP_LOSS_RTOL * abs(want_loss)
  assert eq.rel_err(grads, want_grads) < GRAD_RTOL
