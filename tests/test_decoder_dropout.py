"""`model.dropout`: the decoders' residual dropout is applied in training only, follows each step's
key, and draws the same masks on every layout, so the first step's loss and gradients on a data
split, tensor parallelism (with and without sequence parallelism), ZeRO-3 and a sequence split over
`context` (each device numbering its bits by its tokens' global positions) equal one device's.

Tolerance (fp32): 1e-5 relative, as in test_equivalence.py; the masks themselves must be equal bit
for bit, or a dropped element would differ by its whole value and the error would be O(rate).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_equivalence as eq

from jaxpar import config, kinds
from jaxpar.config import ConfigError
from jaxpar.models import base
from jaxpar.models import registry as jmodel
from jaxpar.models import ring
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

RTOL = 1e-5
SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
         "model.seq_len=16", "model.vocab_size=256", "train.batch_size=8", "data.source=synthetic",
         "precision.compute_dtype=float32"]


def make_cfg(*extra):
  return kinds.check(config.load(None, SMALL + list(extra)))


def tokens(cfg):
  w = eq.batches(cfg, 1)[0]
  return jnp.asarray(w)


def first_step(cfg, shape):
  """(loss, grads in the model's layer order) of the first training step on `shape`."""
  n = int(np.prod(shape))
  jmesh.check(shape, cfg, n)
  t = Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.build_model(cfg),
              expose_grads=True)
  state = t.init(cfg.train.seed)
  _, m = t.step(state, {"tokens": tokens(cfg)})
  order = None if t.layer_order is None else np.argsort(t.layer_order)
  return float(m["loss"]), jax.device_get(t._reorder(m["grads"], order))


def one_device_loss(cfg, key):
  """The model's loss on one device with `key` (None: evaluation), the trainer's initial params."""
  model = jmodel.build_model(cfg)
  params = model.init(jax.random.key(cfg.train.seed))
  return float(model.loss(params, {"tokens": tokens(cfg)}, rng=key)[0])


def step_key(cfg, step):
  return base.at_rows(base.train_key(cfg.train.seed, step), 0)


@pytest.fixture(scope="module")
def references():
  """Per kind: the one-device first step with dropout 0.1."""
  return {kind: first_step(make_cfg(f"model.kind={kind}", "model.dropout=0.1"), (1, 1, 1))
          for kind in ("gpt", "llama")}


LAYOUTS = [("gpt", (2, 4, 1), ["parallel.zero_stage=3"]),
           ("gpt", (2, 4, 1), ["parallel.sequence_parallel=true"]),
           ("gpt", (2, 2, 1), ["parallel.remat=full", "train.grad_accum=2"]),
           ("llama", (2, 2, 1), ["parallel.zero_stage=3"]),
           # the sequence split over context: each device draws its positions' bits
           ("gpt", (2, 1, 1, 2), ["parallel.zero_stage=2", "train.grad_accum=2"]),
           ("llama", (1, 2, 1, 4), ["parallel.sequence_parallel=true"])]


@pytest.mark.parametrize("kind,shape,extra", LAYOUTS,
                         ids=[f"{k}-{jmesh.spec_str(s)}-{'-'.join(e)}" for k, s, e in LAYOUTS])
def test_first_step_with_dropout_matches_one_device(references, kind, shape, extra):
  ref_loss, ref_grads = references[kind]
  loss, grads = first_step(make_cfg(f"model.kind={kind}", "model.dropout=0.1", *extra), shape)
  err = eq.rel_err(grads, ref_grads)
  print(f"{kind} {shape} {extra}: loss rel {abs(loss - ref_loss) / abs(ref_loss):.2e}, "
        f"grads rel {err:.2e}")
  assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
  assert err <= RTOL, err


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_dropout_is_applied_per_step_and_not_in_eval(references, kind):
  cfg, plain = make_cfg(f"model.kind={kind}", "model.dropout=0.1"), make_cfg(f"model.kind={kind}")
  step0, step1 = (one_device_loss(cfg, step_key(cfg, s)) for s in (0, 1))
  without = one_device_loss(plain, None)
  assert step0 != without and step1 != without and step0 != step1
  assert abs(step0 - without) < 0.2 * without  # a tenth of the stream dropped, not nonsense
  # the trainer's first step is the step-0 key's loss
  assert abs(references[kind][0] - step0) <= RTOL * step0
  # evaluation: no dropout, the same every time, today's number
  assert one_device_loss(cfg, None) == one_device_loss(cfg, None) == without


def test_eval_on_a_mesh_is_deterministic():
  cfg = make_cfg("model.dropout=0.1")
  t = Trainer(cfg, jmesh.make((2, 4, 1), jax.devices()), jmodel.build_model(cfg))
  params = t.init(cfg.train.seed)["params"]
  batch = {"tokens": tokens(cfg)}
  a, b = (float(t.eval_loss(params, batch)[0]) for _ in range(2))
  assert a == b == pytest.approx(one_device_loss(make_cfg(), None), rel=RTOL)


def test_dropout_zero_is_todays_step():
  """dropout=0 takes no key: the same program, so the same numbers bit for bit."""
  cfg = make_cfg()
  assert not jmodel.build_model(cfg).takes_rng
  assert one_device_loss(cfg, step_key(cfg, 0)) == one_device_loss(cfg, None)


@pytest.mark.parametrize("value", ["1.0", "-0.1", "1.5"])
def test_bad_rates_are_one_sentence(value):
  with pytest.raises(ConfigError, match=r"model.dropout=.* must be in \[0, 1\)"):
    make_cfg(f"model.dropout={value}")


def test_cnn_refuses_dropout():
  with pytest.raises(ConfigError, match="model.dropout=0.1 is for the decoders"):
    make_cfg("model.kind=cnn", "model.dropout=0.1")


def test_pipeline_with_dropout_is_refused():
  cfg = make_cfg("model.dropout=0.1")
  with pytest.raises(ConfigError, match="model.dropout=0.1 is not supported with a pipeline"):
    jmesh.check((2, 1, 2), cfg, 4)
  with pytest.raises(ConfigError, match="model.dropout=0.1 is not supported with a pipeline"):
    t = Trainer(cfg, jmesh.make((2, 1, 2), jax.devices()[:4]), jmodel.build_model(cfg))
    t.step(t.init(0), {"tokens": tokens(cfg)})
  jmesh.check((2, 1, 2), make_cfg(), 4)  # without dropout the pipeline is fine


def test_a_ring_key_draws_one_devices_bits_at_its_positions():
  """Device i of C on a context axis draws, for its (b, n, ...) piece, the bits the one-device
  (b, C n, ...) draw holds at its positions (chunks i and 2C-1-i); other shapes are refused."""
  key, C, shape = base.train_key(0, 3), 4, (2, 16, 3)
  whole = jax.random.bits(base.at_rows(key, 5), shape)
  order = ring.balanced(shape[1], C).reshape(C, -1)
  for i in range(C):
    piece = jax.random.bits(base.at_rows(key, 5, ring=(i, C)), (2, shape[1] // C, 3))
    np.testing.assert_array_equal(piece, whole[:, order[i]])
  with pytest.raises(ConfigError, match="must have the batch, then the sequence"):
    jax.random.bits(base.at_rows(key, 0, ring=(0, C)), (5,))


# -- the keys against a plain-JAX reference ---------------------------------------------------------
# The layout tests above compare jaxpar with jaxpar, so a key that is wrong the same way on every
# layout cannot show there. Here a GPT written out in plain JAX draws its own masks from the step's
# key as the docstrings promise: the embedding's from fold_in(fold_in(key, L), 0), layer i's
# attention and MLP branches' from fold_in(fold_in(key, i), 0) and (..., 1).

def _layer_norm(x, scale, bias):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + 1e-5) * scale \
      + bias


def reference_gpt_loss(params, tokens, key, rate, mc):
  """Next-token loss of a pre-norm GPT with residual dropout, in plain JAX (float32)."""
  L, H = mc.n_layers, mc.n_heads

  def drop(x, k):
    keep = jax.random.bernoulli(k, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  B, T = inputs.shape
  x = params["wte"][inputs] + params["wpe"][:T][None]  # (B, T, D)
  x = drop(x, jax.random.fold_in(jax.random.fold_in(key, L), 0))
  for i in range(L):
    p = {k: v[i] for k, v in params["layers"].items()}
    k_i = jax.random.fold_in(key, i)
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q = (h @ p["wq"] + p["bq"]).reshape(B, T, H, -1)
    k = (h @ p["wk"]).reshape(B, T, H, -1)
    v = (h @ p["wv"] + p["bv"]).reshape(B, T, H, -1)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, -1)
    x = x + drop(a @ p["wo"] + p["bo"], jax.random.fold_in(k_i, 0))
    h = jax.nn.gelu(_layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w1"] + p["b1"])
    x = x + drop(h @ p["w2"] + p["b2"], jax.random.fold_in(k_i, 1))
  logits = _layer_norm(x, params["lnf_scale"], params["lnf_bias"]) @ params["head"]
  picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def test_dropout_keys_follow_the_layers_and_the_embedding_has_its_own():
  """The model's first-step loss and gradients with the step's key equal the plain-JAX
  reference's, which draws each layer's masks from its own key and the embedding's from one no
  layer has. A wrong key changes masks, so the error would be O(rate), not rounding."""
  cfg = make_cfg("model.dropout=0.1")
  model = jmodel.build_model(cfg)
  params = model.init(jax.random.key(cfg.train.seed))
  batch = {"tokens": tokens(cfg)}
  key = jax.random.fold_in(jax.random.key(cfg.train.seed), 0)  # step 0's (base.train_key), threefry
  got_loss, got_grads = jax.jit(jax.value_and_grad(
      lambda p: model.loss(p, batch, rng=step_key(cfg, 0))[0]))(params)
  want_loss, want_grads = jax.jit(jax.value_and_grad(
      lambda p: reference_gpt_loss(p, batch["tokens"], key, cfg.model.dropout, cfg.model)))(params)
  err = eq.rel_err(got_grads, want_grads)
  print(f"loss {float(got_loss):.7f} vs reference {float(want_loss):.7f}, grads rel {err:.2e}")
  assert float(got_loss) == pytest.approx(float(want_loss), rel=RTOL)
  assert err <= RTOL, err
