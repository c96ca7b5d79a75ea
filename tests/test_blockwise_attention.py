"""Blockwise (flash-style) attention against the matmul form: outputs and gradients, the per-block
contract a ring attention will use, the GPT and Llama training steps at long sequences, and the
compiled step's temporaries growing linearly in T.

Tolerance (fp32): 1e-5 relative, as ||a - b|| <= 1e-5 ||b|| per tensor (tests/test_equivalence.py).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config
from jaxpar.analysis import hlo
from jaxpar.data import synthetic_windows
from jaxpar.models import blockwise, gpt
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

RTOL = 1e-5


def assert_close(got, want, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err, norm = np.linalg.norm(got - want), np.linalg.norm(want)
  assert err <= RTOL * norm, f"{what}: |a-b| = {err:.3e}, |b| = {norm:.3e}"


def qkv_do(B, T, H, G, K, seed=0):
  """Random q (B, T, H, K), k and v (B, T, G, K) and an output cotangent (B, T, H, K)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (B, T, H, K)), jax.random.normal(ks[1], (B, T, G, K)),
          jax.random.normal(ks[2], (B, T, G, K)), jax.random.normal(ks[3], (B, T, H, K)))


def value_and_grads(fn, q, k, v, do):
  """fn's output and the gradients (dq, dk, dv) of <fn(q, k, v), do>, in one compiled program."""
  def both(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)
  return jax.jit(both)(q, k, v, do)


def dot_product_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


# (B, T, H, G, K, block): several key blocks per query block, grouped-query (H = 2G) and
# multi-query (G = 1), T not a multiple of the block, and a block longer than T.
SHAPES = [(2, 48, 4, 4, 8, 16), (2, 40, 4, 2, 8, 16), (1, 37, 6, 1, 16, 8), (2, 24, 2, 2, 8, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_H{}_G{}_K{}_b{}".format(*s))
def test_outputs_and_gradients_equal_the_reference(shape):
  B, T, H, G, K, block = shape
  q, k, v, do = qkv_do(B, T, H, G, K)
  out, grads = value_and_grads(lambda q, k, v: blockwise.attention(q, k, v, block), q, k, v, do)
  for name, ref in (("_attention_matmuls", gpt._attention_matmuls),
                    ("dot_product_attention", dot_product_attention)):
    want_out, want_grads = value_and_grads(ref, q, k, v, do)
    assert_close(out, want_out, f"out vs {name}")
    for d, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
      assert_close(g, w, f"{d} vs {name}")


def test_refuses_query_heads_not_a_multiple_of_kv_heads():
  q, k, v, _ = qkv_do(1, 8, 3, 2, 4)
  with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
    blockwise.attention(q, k, v)


def test_fold_in_any_order_with_masked_pairs_and_gradient_pieces():
  """The ring-attention contract: a query block folds its kv blocks in any order, a pair wholly
  above the diagonal (folded first, when the state is empty) changes nothing, and the pairs'
  fold_grad pieces sum to the gradients."""
  B, T, H, G, K, b = 1, 24, 4, 2, 8, 8
  q, k, v, do = qkv_do(B, T, H, G, K, seed=1)
  # compiled once each: the block offsets are traced, as a ring attention's would be
  fold = jax.jit(blockwise.fold, static_argnums=6)
  fold_grad = jax.jit(blockwise.fold_grad, static_argnums=8)
  want_out, (dq_want, dk_want, dv_want) = value_and_grads(gpt._attention_matmuls, q, k, v, do)
  scale = 1 / math.sqrt(K)
  qg, dog = blockwise.grouped_q(q, G), blockwise.grouped_q(do, G)  # (B, G, R, T, K)
  kg, vg = blockwise.grouped_kv(k), blockwise.grouped_kv(v)  # (B, G, T, K)
  n = T // b
  qs = lambda x, i: x[:, :, :, i * b:(i + 1) * b]
  ks = lambda x, j: x[:, :, j * b:(j + 1) * b]
  outs, dq, dk, dv = [], [], jnp.zeros_like(kg), jnp.zeros_like(vg)
  for i in range(n):
    state = blockwise.init_state(qs(qg, i), kg, vg)
    for j in reversed(range(n)):  # the last block first: for i < n - 1 wholly masked
      assert blockwise.visible(i * b, b, j * b) == (j <= i)
      state = fold(state, qs(qg, i), ks(kg, j), ks(vg, j), i * b, j * b, scale)
    out, lse = blockwise.finish(state)
    assert np.isfinite(np.asarray(lse)).all()
    outs.append(out)
    delta = (qs(dog, i) * out).sum(-1)
    dq_i = 0
    for j in range(n):
      dq_p, dk_p, dv_p = fold_grad(qs(qg, i), ks(kg, j), ks(vg, j), qs(dog, i), lse, delta,
                                   i * b, j * b, scale)
      if j > i:
        assert not np.asarray(dq_p).any() and not np.asarray(dk_p).any()
      dq_i = dq_i + dq_p
      dk, dv = dk.at[:, :, j * b:(j + 1) * b].add(dk_p), dv.at[:, :, j * b:(j + 1) * b].add(dv_p)
    dq.append(dq_i)
  assert_close(blockwise.ungrouped_q(jnp.concatenate(outs, 3)), want_out, "out")
  assert_close(blockwise.ungrouped_q(jnp.concatenate(dq, 3)), dq_want, "dq")
  assert_close(dk.transpose(0, 2, 1, 3), dk_want, "dk")
  assert_close(dv.transpose(0, 2, 1, 3), dv_want, "dv")


def test_a_row_that_sees_no_key_is_zero_not_nan():
  q, k, v, do = qkv_do(1, 8, 2, 2, 4)
  qg, dog = blockwise.grouped_q(q, 2), blockwise.grouped_q(do, 2)
  kg, vg = blockwise.grouped_kv(k), blockwise.grouped_kv(v)
  # queries at 0..7 against keys at 8..15: no query sees any key
  state = blockwise.fold(blockwise.init_state(qg, kg, vg), qg, kg, vg, 0, 8, 0.5)
  out, lse = blockwise.finish(state)
  assert (np.asarray(out) == 0).all() and np.isposinf(np.asarray(lse)).all()
  grads = blockwise.fold_grad(qg, kg, vg, dog, lse, (dog * out).sum(-1), 0, 8, 0.5)
  assert all((np.asarray(g) == 0).all() for g in grads)


def test_inside_shard_map():
  """Under shard_map (pipeline stages, sequence parallelism) the loops' carries vary over the
  manual axes like the inputs; batch split over two devices, forward and backward."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v, do = qkv_do(2, 20, 4, 2, 8, seed=2)
  spec = jax.sharding.PartitionSpec("data")
  sharded = jax.shard_map(lambda q, k, v: blockwise.attention(q, k, v, 8), mesh=mesh,
                          in_specs=(spec,) * 3, out_specs=spec)
  out, grads = value_and_grads(sharded, q, k, v, do)
  want_out, want_grads = value_and_grads(gpt._attention_matmuls, q, k, v, do)
  assert_close(out, want_out, "out")
  for d, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
    assert_close(g, w, d)


LONG = 1024
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=128",
         f"model.seq_len={LONG}", "train.batch_size=2", "precision.compute_dtype=float32"]


def first_step(cfg):
  """(loss, gradients) of the first training step on a one-device mesh."""
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg), expose_grads=True)
  w = synthetic_windows(cfg.model.seq_len, 0).astype(np.int32)[:cfg.train.batch_size]
  _, m = t.step(t.init(cfg.train.seed), {"tokens": jnp.asarray(w)})
  return float(m["loss"]), jax.device_get(m["grads"])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_training_step_at_long_seq_equals_the_matmul_form(kind, monkeypatch):
  extra = ["model.n_kv_heads=2"] if kind == "llama" else []  # Llama with grouped-query attention
  cfg = config.load(None, SMALL + [f"model.kind={kind}"] + extra)
  assert cfg.model.seq_len >= gpt.BLOCKWISE_MIN_SEQ  # the step below takes the blockwise form
  loss, grads = first_step(cfg)
  monkeypatch.setattr(gpt, "BLOCKWISE_MIN_SEQ", 1 << 30)  # the matmul form at every length
  want_loss, want_grads = first_step(cfg)
  assert abs(loss - want_loss) <= RTOL * abs(want_loss), (loss, want_loss)
  flat_w = dict(jax.tree_util.tree_leaves_with_path(want_grads))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert_close(g, flat_w[path], f"grad {jax.tree_util.keystr(path)}")


def temp_bytes(seq_len: int) -> int:
  """Compiled temporaries of the default model's training step at `seq_len`, batch 2, 1x1x1."""
  cfg = config.load(None, [f"model.seq_len={seq_len}", "train.batch_size=2"])
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg))
  batch = {"tokens": jax.ShapeDtypeStruct((2, seq_len + 1), jnp.int32)}
  return hlo.memory(t.lower(batch).compile())["temp_bytes"]


def test_default_model_temporaries_grow_linearly_in_seq_len():
  # The matmul form's (B, H, T, T) scores made them grow 4x per doubling (406 MiB at T 1024,
  # 1.53 GiB at 2048, 5.94 GiB at 4096); blockwise they grow as the activations do, 2x.
  seqs = [1024, 2048, 4096, 8192]
  temps = [temp_bytes(T) for T in seqs]
  ratios = [b / a for a, b in zip(temps, temps[1:])]
  assert max(ratios) <= 2.2, dict(zip(seqs, temps))
  assert temps[-1] < 1 << 30, dict(zip(seqs, temps))  # 8192 fits in what 2048 took before
