"""Context parallelism: the sequence split over the mesh's fourth axis, attention around the ring.

Every layout runs the same batches as one device at T = 1024 (two chunks of T/2C per device):
first-step loss and gradients, and the next steps' losses and final parameters, within 1e-5
relative (fp32), for GPT and Llama, alone and with data x tensor parallelism, ZeRO-2/3, gradient
accumulation, sequence parallelism with full remat, and a pipeline (1F1B and GPipe, where
attention takes its all-gather form). A checkpoint written at context=2 continues at context=1
and 4 with the losses context=2 itself goes on to. Bad layouts are one sentence.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_equivalence import assert_trees_close

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.data import synthetic_windows
from jaxpar.models import registry as jmodel
from jaxpar.models import ring
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

RTOL = 1e-5
T, B, STEPS = 1024, 4, 2
BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        f"model.seq_len={T}", f"train.batch_size={B}", "train.warmup_steps=1", "train.steps=4",
        "train.lr=1e-2", "precision.compute_dtype=float32"]


def make_cfg(kind, *extra):
  return config.load(None, BASE + [f"model.kind={kind}", *extra])


def trainer(cfg, shape):
  n = int(np.prod(shape))
  jmesh.check(shape, cfg, n)
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.decoder(cfg),
                 expose_grads=True)


def batches(n=STEPS, seq=T, seed=0):
  w = synthetic_windows(seq, seed).astype(np.int32)
  return [jnp.asarray(w[i * B:(i + 1) * B]) for i in range(n)]


def train(cfg, shape, data):
  """Per-step losses, the first step's gradients and the final parameters (the model's layer
  order: the circular schedule keeps its stack in stage order)."""
  t = trainer(cfg, shape)
  state = t.init(cfg.train.seed)
  losses, grads = [], None
  back = None if t.layer_order is None else np.argsort(t.layer_order)
  for b in data:
    state, m = t.step(state, {"tokens": b})
    losses.append(float(m["loss"]))
    grads = jax.device_get(t._reorder(m["grads"], back)) if grads is None else grads
  return np.array(losses), grads, jax.device_get(t.to_logical(state)["params"])


@pytest.fixture(scope="module")
def references():
  data = batches()
  return data, {kind: train(make_cfg(kind), (1, 1, 1), data) for kind in ("gpt", "llama")}


LAYOUTS = [("gpt", (1, 1, 1, 4), ["train.grad_accum=2"]),
           ("gpt", (2, 2, 1, 2), ["parallel.zero_stage=3"]),
           ("gpt", (1, 2, 1, 2), ["parallel.sequence_parallel=true", "parallel.remat=full"]),
           # a pipeline: attention all-gathered inside the stages (context_attention=auto)
           ("gpt", (1, 1, 2, 2), ["parallel.schedule=1f1b", "parallel.microbatches=2"]),
           ("llama", (1, 1, 1, 4), []),
           ("llama", (2, 2, 1, 2), ["parallel.zero_stage=3", "model.n_kv_heads=2"]),
           # the circular schedule (its stage-order stack): 4 layers, 2 virtual stages
           ("llama", (1, 1, 2, 2), ["parallel.context_attention=allgather", "model.n_layers=4",
                                    "parallel.schedule=circular", "parallel.virtual_stages=2",
                                    "parallel.microbatches=2"])]


@pytest.mark.parametrize("kind,shape,extra", LAYOUTS,
                         ids=[f"{k}-{jmesh.spec_str(s)}-{'-'.join(e) or 'plain'}"
                              for k, s, e in LAYOUTS])
def test_context_split_matches_one_device(references, kind, shape, extra):
  data, refs = references
  if "model.n_kv_heads=2" in extra or "model.n_layers=4" in extra:  # its own one-device reference
    ref = train(make_cfg(kind, *extra), (1, 1, 1), data)
  else:
    ref = refs[kind]
  losses, grads, params = train(make_cfg(kind, *extra), shape, data)
  np.testing.assert_allclose(losses, ref[0], rtol=RTOL)
  assert_trees_close(grads, ref[1], "gradient")
  assert_trees_close(params, ref[2], "parameter")


def test_zero3_on_a_context_mesh_gathers_one_layer_at_a_time():
  """ZeRO-3 beside a context axis (4x1x1x2) gathers each layer inside the layer scans, as without
  one (test_zero_memory.py): read from the compiled step, each layer's shards all-gathered once in
  the forward's loop and once in the backward's, and outside the loops nothing but the parameters
  outside the stack (embeddings, head, final norm). Gathering the stack before the scan would move
  the same bytes outside the loops."""
  from jaxpar.analysis import hlo
  from jaxpar.planning import plan
  cfg = make_cfg("gpt", "parallel.zero_stage=3", "model.seq_len=32")
  t = trainer(cfg, (4, 1, 1, 2))
  text = t.lower(plan._batch_abstract(cfg)).compile().as_text()
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))
  stack = nbytes(t.model.abstract["layers"])
  top = nbytes({k: v for k, v in t.model.abstract.items() if k != "layers"})
  in_loops = hlo.collective_bytes_in_loops(text)["all-gather"]
  total = hlo.collective_bytes(text)["all-gather"]
  print(f"all-gather bytes: {in_loops:,} in loops, {total - in_loops:,} outside; stack {stack:,}, "
        f"top {top:,}")
  assert in_loops == pytest.approx(2 * stack, rel=0.01), (in_loops, stack)
  assert total - in_loops <= top, (total, in_loops, top)


def test_local_positions_are_the_balanced_layout():
  C, n = 4, 16
  mesh = jax.make_mesh((C,), ("context",), devices=jax.devices()[:C])
  got = jax.shard_map(lambda _: ring.local_positions(n // C, "context"), mesh=mesh,
                      in_specs=jax.sharding.PartitionSpec(),
                      out_specs=jax.sharding.PartitionSpec("context"))(jnp.zeros(()))
  np.testing.assert_array_equal(np.asarray(got), ring.balanced(n, C))


def test_checkpoint_from_context_2_continues_on_context_1_and_4(tmp_path):
  """Parameters and optimizer state do not depend on the context split: a checkpoint written at
  context=2 continues on context=1 and context=4 with the losses context=2 goes on to."""
  seq = 256
  cfg = make_cfg("gpt", f"model.seq_len={seq}")
  data = batches(4, seq)
  t2 = trainer(cfg, (1, 1, 1, 2))
  state = t2.init(cfg.train.seed)
  for b in data[:2]:
    state, _ = t2.step(state, {"tokens": b})
  t2.save(str(tmp_path), state)
  want = []
  for b in data[2:]:
    state, m = t2.step(state, {"tokens": b})
    want.append(float(m["loss"]))
  for shape in ((1, 1, 1), (1, 1, 1, 4)):
    t = trainer(cfg, shape)
    state = t.load(str(tmp_path))
    got = []
    for b in data[2:]:
      state, m = t.step(state, {"tokens": b})
      got.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=jmesh.spec_str(shape))
  # and it generates on a mesh without a context axis, as the parameters it holds do
  from jaxpar.interop import generate
  sampler = generate.Sampler(str(tmp_path), (2, 4, 1))
  params = jax.device_get(t2.to_logical(t2.load(str(tmp_path)))["params"])
  same = generate.Sampler.from_params(cfg, (1, 1, 1), params)
  got = sampler.sample("def ", max_new_tokens=8, temperature=0)
  np.testing.assert_array_equal(got, same.sample("def ", max_new_tokens=8, temperature=0))
  with pytest.raises(ConfigError, match="generation runs without a context axis"):
    generate.Sampler(str(tmp_path), (1, 1, 1, 2))


@pytest.mark.parametrize("shape,extra,message", [
    ((1, 1, 1, 3), ["model.seq_len=128"], "model.seq_len=128 is not divisible by 2 x context=6"),
    ((1, 1, 2, 2), ["model.seq_len=128", "parallel.context_attention=ring"],
     "parallel.context_attention=ring cannot run inside a pipeline (pipeline=2)"),
    ((1, 1, 1, 2), ["model.kind=cnn"], "model.kind=cnn has no context-parallel attention"),
    ((1, 1, 1, 2), ["model.seq_len=128"], "needs 2 devices, found 8"),
])
def test_bad_context_layouts_are_one_sentence(shape, extra, message):
  cfg = config.load(None, extra)
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    jmesh.check(shape, cfg, 8 if "found 8" in message else int(np.prod(shape)))


def test_a_model_without_seq_split_is_refused():
  cfg = make_cfg("gpt", "model.seq_len=64")
  from dataclasses import replace
  model = replace(jmodel.decoder(cfg), seq_split=None)
  with pytest.raises(ConfigError, match="has no context-parallel attention"):
    Trainer(cfg, jmesh.make((1, 1, 1, 2), jax.devices()[:2]), model)


def test_parse_four_numbers():
  assert jmesh.parse("2x2x1x2") == (2, 2, 1, 2)
  assert jmesh.parse("2x4x1") == (2, 4, 1, 1)
  assert jmesh.spec_str((2, 4, 1, 1)) == "2x4x1"
  assert jmesh.spec_str((2, 2, 1, 2)) == "2x2x1x2"
  with pytest.raises(ConfigError, match="DxMxP or DxMxPxC"):
    jmesh.parse("1x1x1x0")


def test_the_launcher_counts_a_four_number_mesh():
  """jaxpar-launch splits the mesh's devices over its processes (2 processes on 2x2x1x2 trained
  the single process's losses, 5.57855 -> 5.2714 in 3 steps, when checked by hand)."""
  from jaxpar.commands import launch
  assert launch.mesh_devices(["train.py", "--mesh", "2x2x1x2"]) == 8
  assert launch.mesh_devices(["train.py", "--mesh=2x4x1"]) == 8
