"""Ring attention (models/ring.py) over a `context` mesh axis of C = 2 and 4 devices, the
sequence in the balanced chunk order: outputs and gradients equal one device's blockwise causal
attention on the whole sequence (fp32, 1e-5), also where a chunk is folded a key block at a
time, and the compiled forward moves exactly the K/V ring's bytes in collective-permutes, with no
all-gather. The all-gather form (`gather=True`, what runs inside a pipeline stage) gives the same
numbers and moves the same keys and values in one all-gather each, no permute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo
from jaxpar.models import blockwise, gpt, ring

B, T, H, G, K = 2, 64, 4, 2, 16  # grouped-query attention: 2 query heads per kv head


def inputs():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k = rng.normal(size=(B, T, G, K)).astype(np.float32)
  v = rng.normal(size=(B, T, G, K)).astype(np.float32)
  w = rng.normal(size=(B, T, H, K)).astype(np.float32)  # a cotangent that weighs every output
  return q, k, v, w


def on_ring(C: int, gather: bool = False):
  mesh = jax.make_mesh((C,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])
  spec = P(None, "context")
  return mesh, jax.shard_map(lambda q, k, v: ring.ring_attention(q, k, v, "context", gather),
                             mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


@pytest.mark.parametrize("C,gather", [(2, False), (4, False), (2, True), (4, True)])
def test_outputs_and_gradients_equal_one_devices_attention(C, gather):
  q, k, v, w = inputs()
  order = ring.balanced(T, C)
  back = np.argsort(order)
  _, attend = on_ring(C, gather)

  def ring_loss(q, k, v):  # in the model's order: laid out for the ring and back
    out = attend(q[:, order], k[:, order], v[:, order])[:, back]
    return (out * w).sum(), out

  def one_device_loss(q, k, v):
    out = blockwise.attention(q, k, v)
    return (out * w).sum(), out

  (_, got), got_grads = jax.jit(jax.value_and_grad(ring_loss, argnums=(0, 1, 2), has_aux=True))(
      q, k, v)
  (_, want), want_grads = jax.jit(jax.value_and_grad(one_device_loss, argnums=(0, 1, 2),
                                                     has_aux=True))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for name, a, b in zip("qkv", got_grads, want_grads):
    err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
    assert err <= 1e-5, f"d{name}: {err:.2e}"


@pytest.mark.parametrize("C", [2, 4])
def test_the_forward_sends_the_kv_ring_bytes_and_gathers_nothing(C):
  q, k, v, _ = inputs()
  _, attend = on_ring(C)
  text = jax.jit(attend).lower(q, k, v).compile().as_text()
  moved = hlo.collective_bytes(text)
  # each device sends its k and v chunks (B, T/C, G, K) float32 to its neighbour C - 1 times
  assert moved["collective-permute"] == 2 * (C - 1) * B * (T // C) * G * K * 4
  assert not moved["all-gather"] and not moved["all-reduce"]


def test_the_gather_form_gathers_the_same_bytes_and_permutes_nothing():
  C = 4
  q, k, v, _ = inputs()
  _, attend = on_ring(C, gather=True)
  text = jax.jit(attend).lower(q, k, v).compile().as_text()
  moved, sent = hlo.collective_bytes(text), hlo.sent_bytes(text, C)
  # k and v gathered whole (C chunk pairs each); a ring all-gather sends C - 1 chunk pairs of each
  assert moved["all-gather"] == 2 * B * T * G * K * 4, moved
  assert sent["all-gather"] == 2 * (C - 1) * B * (T // C) * G * K * 4, sent
  assert not moved["collective-permute"] and not moved["all-reduce"]


def test_the_balanced_order_gives_each_device_an_early_and_a_late_chunk():
  order = ring.balanced(16, 4)  # 8 chunks of 2
  assert order.reshape(4, 2, 2)[:, :, 0].tolist() == [[0, 14], [2, 12], [4, 10], [6, 8]]
  with pytest.raises(ValueError, match="does not split into 2 x 3 equal chunks"):
    ring.balanced(16, 3)


@pytest.mark.parametrize("C,block,gather", [(2, 8, False), (4, 4, False), (4, 4, True)])
def test_chunks_longer_than_a_block_fold_a_block_at_a_time(C, block, gather, monkeypatch):
  """A chunk of T/2C keys is folded blockwise.BLOCK keys at a time (scores (T/2C) x BLOCK, not
  (T/2C)^2), forward and backward, with the same results."""
  monkeypatch.setattr(blockwise, "BLOCK", block)
  assert ring._block_size(T // (2 * C)) == block < T // (2 * C)
  test_outputs_and_gradients_equal_one_devices_attention(C, gather)


def segment_ids():
  """(B, T) packed documents' ids: row 0 three documents, row 1 three and padding (0)."""
  seg = np.zeros((B, T), np.int32)
  for r, lengths in enumerate([[20, 30, 14], [5, 40, 10]]):
    at = 0
    for d, n in enumerate(lengths, start=1):
      seg[r, at:at + n] = d
      at += n
  return seg


@pytest.mark.parametrize("C,block,gather", [(2, 128, False), (4, 4, False), (4, 4, True)])
def test_packed_documents_attend_within_themselves_around_the_ring(C, block, gather, monkeypatch):
  """With segment ids (the ring's order, travelling with their keys) the ring gives one device's
  blockwise attention with the same ids, which gives the matmul form's (B, T, T) mask, outputs
  and gradients (1e-5); chunks folded a block at a time too. Changing one document's q, k and v
  leaves every other token's output bitwise the same."""
  monkeypatch.setattr(blockwise, "BLOCK", block)
  q, k, v, w = inputs()
  seg = segment_ids()
  order, back = ring.balanced(T, C), np.argsort(ring.balanced(T, C))
  mesh = jax.make_mesh((C,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])
  spec = P(None, "context")
  attend = jax.shard_map(lambda q, k, v, s: ring.ring_attention(q, k, v, "context", gather, s),
                         mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)

  def ring_loss(q, k, v):
    out = attend(q[:, order], k[:, order], v[:, order], seg[:, order])[:, back]
    return (out * w).sum(), out

  def reference(form):
    def loss(q, k, v):
      out = form(q, k, v)
      return (out * w).sum(), out
    return loss
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  (_, got), got_grads = grad(ring_loss)(q, k, v)
  for form in (lambda q, k, v: blockwise.attention(q, k, v, segments=seg),
               lambda q, k, v: gpt._attention_matmuls(q, k, v, seg)):
    (_, want), want_grads = grad(reference(form))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got_grads, want_grads):
      err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
      assert err <= 1e-5, f"d{name}: {err:.2e}"
  doc = (np.arange(B)[:, None] == 1) & (seg == 2)  # row 1's second document, 40 tokens
  moved = [np.where(doc[..., None, None], x + 1.0, x) for x in (q, k, v)]
  (_, after), _ = grad(ring_loss)(*moved)
  assert np.abs(np.asarray(after)[doc] - np.asarray(got)[doc]).max() > 1e-3
  np.testing.assert_array_equal(np.asarray(after)[~doc], np.asarray(got)[~doc])
