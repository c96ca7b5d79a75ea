"""LoRA (train.lora_rank, models/lora.py): the adapters' gradients are the merged weight's
gradient times the other factor and alpha/r; layouts (ZeRO-3 with tensor parallelism and the
optimizer offloaded, a pipeline, a context split) train them like one device (fp32: losses and
adapters within 1e-5, the base weights bit-identical) and their checkpoints resume on one device
where the unbroken run goes on; the adapters export as a PEFT folder that `peft` loads onto the
original Hugging Face folder, and merged as a folder `transformers` loads, both with jaxpar's
logits (1e-5 relative); the optimizer state is the adapters' alone; bad input is one sentence,
exit 2, nothing written."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_hf import B, T, V, gpt2_folder, hf_logits, llama_folder, rel, tokens
from test_own_optimizer import traced_bytes

from jaxpar import config
from jaxpar.commands import export as export_cmd
from jaxpar.commands import plan as plan_cmd
from jaxpar.commands import train as train_cmd
from jaxpar.interop import generate, hf
from jaxpar.models import decoder, lora
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.planning import plan
from jaxpar.train.step import Trainer

PLAIN = ["model.kind=llama", "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
         "model.d_ff=64", f"model.vocab_size={V}", f"model.seq_len={T}", f"train.batch_size={B}",
         "precision.compute_dtype=float32", "train.lr=2e-3", "train.warmup_steps=0",
         "train.clip_norm=0"]
TINY = PLAIN + ["train.lora_rank=4", "train.lora_alpha=8"]
# a mixture every other layer: adapters on attention, the dense layer's MLP and the experts
MOE = ["model.n_experts=4", "model.experts_per_token=2", "model.moe_every=2",
       "train.lora_targets=wq,wo,mlp,experts"]


def cfg_of(*extra):
  return config.load(None, [*TINY, *extra])


def trainer(cfg, shape, **kw):
  n = int(np.prod(shape))
  jmesh.check(shape, cfg, n)
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.decoder(cfg), **kw)


def random_adapters(params, seed=1):
  """params with every adapter random (B too: a zero B would hide the scale and B's path)."""
  rng = np.random.default_rng(seed)
  return {**params, "layers": {n: (0.1 * rng.standard_normal(np.shape(v)).astype(np.float32)
                                   if lora.is_adapter(n) else v)
                               for n, v in params["layers"].items()}}


def merged_by_hand(params, s):
  """W + s * A @ B for every adapted W (numpy, not models/lora.py), the adapters dropped."""
  layers = params["layers"]
  return {**params, "layers": {n: np.asarray(w) + s * np.matmul(layers[n + lora.A], layers[n + lora.B])
                               if n + lora.A in layers else w
                               for n, w in layers.items() if not lora.is_adapter(n)}}


def test_adapter_gradients_are_the_merged_weights_gradient_times_the_other_factor():
  """d/dA = s dW B^T and d/dB = s A^T dW, dW the plain model's gradient at W + s A @ B, s = alpha/r;
  the base weights get none."""
  cfg = cfg_of("train.lora_targets=attention,mlp")
  model, plain = jmodel.decoder(cfg), jmodel.decoder(config.load(None, PLAIN))
  params = random_adapters(jax.device_get(jax.jit(model.init)(jax.random.key(0))))
  batch = {"tokens": jnp.asarray(tokens())}
  g = jax.jit(jax.grad(lambda p: model.loss(p, batch)[0]))(params)["layers"]
  s = 8 / 4
  merged = merged_by_hand(params, s)
  dw = jax.jit(jax.grad(lambda p: plain.loss(p, batch)[0]))(merged)["layers"]
  layers = params["layers"]
  for name in lora.targets(cfg.train, layers):
    a, b = layers[name + lora.A], layers[name + lora.B]
    want_a = s * np.einsum("lio,lro->lir", dw[name], b)
    want_b = s * np.einsum("lir,lio->lro", a, dw[name])
    assert rel(g[name + lora.A], want_a) < 1e-5, name
    assert rel(g[name + lora.B], want_b) < 1e-5, name
    assert not np.any(g[name]), name  # the base weight: no gradient (stop_gradient in the merge)
  ours = lora.merge_params(params, cfg.train)["layers"]  # what export and generation use
  for name, w in merged["layers"].items():
    np.testing.assert_allclose(ours[name], w, rtol=1e-6, atol=1e-7)


def test_a_mixture_every_other_layer_merges_each_layers_own_adapters():
  """model.moe_every=2: the dense layers' and the mixtures' adapters ride their own stacks
  (decoder.in_groups' pick); the loss is the plain model's at the merged weights."""
  moe = ["model.n_experts=4", "model.moe_every=2"]
  cfg = cfg_of(*moe, "train.lora_targets=attention,mlp,experts")
  model, plain = jmodel.decoder(cfg), jmodel.decoder(config.load(None, PLAIN + moe))
  params = random_adapters(jax.device_get(jax.jit(model.init)(jax.random.key(0))))
  batch = {"tokens": jnp.asarray(tokens())}
  got = jax.jit(lambda p: model.loss(p, batch)[0])(params)
  want = jax.jit(lambda p: plain.loss(p, batch)[0])(merged_by_hand(params, 8 / 4))
  assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))


def batch(i):
  return {"tokens": np.roll(tokens(), i, axis=0)}


def run(cfg, shape, steps=2, **kw):
  """(trainer, state, the starting parameters, the losses, the parameters after each step)."""
  t = trainer(cfg, shape, **kw)
  state = t.init(0)
  first = jax.device_get(state["params"])
  losses, after = [], []
  for i in range(steps):
    state, m = t.step(state, batch(i))
    losses.append(float(m["loss"]))
    after.append(jax.device_get(t.to_logical(state)["params"]))
  return t, state, first, losses, after


LAYOUTS = {  # (mesh, extra keys)
    # the mixture (its experts split over data) with remat and the optimizer offloaded: the
    # adapters' moments in host memory, updated a piece at a time
    "2x4x1-zero3-remat-offload": ((2, 4, 1), ["parallel.zero_stage=3", "parallel.remat=offload",
                                              "parallel.offload_optimizer=true"]),
    "2x1x2-pipeline-zero2": ((2, 1, 2), ["parallel.zero_stage=2", "parallel.microbatches=2",
                                         "parallel.remat=full"]),
    "1x2x1x2-context": ((1, 2, 1, 2), ["parallel.sequence_parallel=true"]),
}
CASES = [("moe", "2x4x1-zero3-remat-offload"), ("dense", "2x1x2-pipeline-zero2"),
         ("dense", "1x2x1x2-context")]


def at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def check_adapters(got, want, first):
  """The adapters within 1e-5 of `want`'s, B off zero; the base weights bit-identical to `first`."""
  for path, x in jax.tree_util.tree_leaves_with_path(got):
    key = "/".join(str(getattr(k, "key", k)) for k in path)
    if lora.is_adapter(key):
      assert rel(x, at(want, path)) < 1e-5, key
      if key.endswith(lora.B):
        assert np.any(x), key  # B moved off zero
    else:  # the base weights: bit-identical to their start, on every layout
      assert np.array_equal(x, at(first, path)), key


@pytest.fixture(scope="module")
def references():
  """One unbroken three-step run on one device per model, shared by its layouts."""
  out = {}

  def get(name):
    if name not in out:
      cfg = cfg_of(*(MOE if name == "moe" else ["train.lora_targets=attention,mlp"]))
      t, _, first, losses, after = run(cfg, (1, 1, 1), steps=3)
      out[name] = (t, first, losses, after)
    return out[name]
  return get


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_layouts_train_the_adapters_like_one_device(references, name, layout, tmp_path, capsys):
  """Two steps on the layout, its checkpoint resumed on one device for the third: the losses
  and adapters of the unbroken one-device run."""
  ref, first, ref_losses, ref_after = references(name)
  shape, extra = LAYOUTS[layout]
  cfg = cfg_of(*(MOE if name == "moe" else ["train.lora_targets=attention,mlp"]), *extra)
  t, state, _, losses, after = run(cfg, shape)
  np.testing.assert_allclose(losses, ref_losses[:2], rtol=1e-5)
  assert losses[-1] < losses[0]  # the adapters learn
  got = after[-1]
  check_adapters(got, ref_after[1], first)
  # the optimizer holds the adapters' moments only
  opt_leaves = jax.tree_util.tree_leaves(state["opt"])
  n_adapter = sum(np.size(x) for p, x in jax.tree_util.tree_leaves_with_path(got)
                  if lora.is_adapter(jax.tree_util.keystr(p)[:-2]))
  assert sum(x.size for x in opt_leaves if x.ndim) == 2 * n_adapter
  if t.cfg.parallel.offload_optimizer:  # and they stay in host memory
    assert {x.sharding.memory_kind for x in opt_leaves} == {"pinned_host"}
  # its checkpoint resumes on one device: the same adapters, and the third step of the
  # unbroken run (the moments and step count came along)
  t.save(str(tmp_path), state)
  back = ref.load(str(tmp_path))
  for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(back["params"])),
                  jax.tree_util.tree_leaves(got)):
    assert np.array_equal(a, b)
  back, m = ref.step(back, batch(2))
  np.testing.assert_allclose(float(m["loss"]), ref_losses[2], rtol=1e-5)
  check_adapters(jax.device_get(ref.to_logical(back)["params"]), ref_after[2], first)
  if name == "moe":  # the experts' adapters have no PEFT layout: one sentence, nothing written
    out = tmp_path / "adapter"
    capsys.readouterr()
    assert export_cmd.main(["--workdir", str(tmp_path), "--peft", str(out)]) == 2
    assert "(a mixture's experts) have no PEFT layout" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora")
  return {"gpt2": gpt2_folder(root / "gpt2"), "llama": llama_folder(root / "llama", 8, 2, 64)}


# GPT-2: q and v of the joined c_attn (its adapter of rank 2r), attention's and the MLP's c_proj
TARGETS = {"gpt2": "wq,wv,wo,w2", "llama": "attention,mlp"}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_peft_and_merged_exports_give_jaxpars_logits(folders, tmp_path, name):
  import peft as hf_peft  # the PEFT library itself (the test extra installs it)
  folder = folders[name]
  cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}",
                           f"train.batch_size={B}", "precision.compute_dtype=float32",
                           "train.lora_rank=4", "train.lora_alpha=8",
                           f"train.lora_targets={TARGETS[name]}"], base=hf.model_overrides)
  t = trainer(cfg, (1, 1, 1))
  shardings = t.state_shardings["params"]
  base = hf.load_params(folder, cfg.model, lora.base_only(t.model.abstract),
                        lora.base_only(shardings))
  fresh = lora.add_adapters(base, t.model, cfg.train, shardings, 0)  # what init_from trains from
  params = random_adapters(jax.device_get(fresh))
  toks = tokens()[:, :-1]
  parts = lora.wrap_parts(jmodel.decoder_parts(cfg.model), cfg.train)
  logits = np.asarray(jax.jit(lambda p, x: decoder.forward(parts, p, x))(params, toks))
  plain = np.asarray(jax.jit(lambda p, x: decoder.forward(parts, p, x))(fresh, toks))
  want_base = hf_logits(folder, toks)
  assert rel(plain, want_base) < 1e-5  # B starts at zero: the folder's model as it is
  work = str(tmp_path / "run")
  t.save(work, t.init_with(params))
  out = str(tmp_path / "adapter")
  assert export_cmd.main(["--workdir", work, "--peft", out]) == 0
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  base_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model = hf_peft.PeftModel.from_pretrained(base_model, out).eval()
  with torch.no_grad():
    got = model(torch.from_numpy(toks.astype(np.int64))).logits.numpy()
  assert rel(got, logits) < 1e-5
  assert rel(want_base, logits) > 1e-3  # the adapters change the logits
  merged = str(tmp_path / "merged")
  assert export_cmd.main(["--workdir", work, "--hf", merged]) == 0
  assert rel(hf_logits(merged, toks), logits) < 1e-5
  # generation samples from the merged weights too (its decoder has no adapters of its own)
  sampler = generate.Sampler.from_params(cfg, (1, 1, 1), params)
  want = lora.merge_params(params, cfg.train)
  assert sorted(sampler.params["layers"]) == sorted(lora.base_only(params)["layers"])
  for name, x in sampler.params["layers"].items():
    np.testing.assert_array_equal(x, want["layers"][name])


def test_optimizer_state_falls_to_the_adapters_share():
  """plan's opt_state bytes, from the compiled step's state: the adapters' two moments, plus
  Adam's step counts."""
  cfg = cfg_of("train.lora_targets=attention,mlp")
  with_lora = plan.plan(cfg, "2x1x1")
  adapters = sum(int(np.prod(a.shape)) * 4 for n, a in
                 jmodel.decoder(cfg).abstract["layers"].items() if lora.is_adapter(n))
  opt = with_lora["bytes_per_device"]["opt_state"]
  assert 2 * adapters <= opt <= 2 * adapters + 64  # (without LoRA: 2 x 4 x param_count)
  assert with_lora["bytes_per_device"]["grads"] == adapters
  assert with_lora["collectives"]["all-reduce"] <= adapters + 64
  # no gradient of a frozen weight is reduced, already in the step's jaxpr (XLA would drop a
  # reduction of zeros, so the compiled bytes alone cannot tell): the adapters' and scalars'
  t = trainer(cfg, (2, 1, 1))
  b = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                 t.abstract_state, t.state_shardings)
  with jax.set_mesh(t.mesh):
    traced = traced_bytes(t.jitted(b).trace(state, b).jaxpr.jaxpr)
  summed = traced.get("psum", 0) + traced.get("psum_invariant", 0)
  assert adapters <= summed <= adapters + 64, traced


@pytest.mark.parametrize("keys,words", [
    (["train.lora_rank=-1"], "train.lora_rank=-1 must not be negative"),
    (["train.lora_rank=4", "train.lora_targets=q_proj"], "names none of this model's layer"),
    (["train.lora_rank=4", "train.lora_targets=experts"], "the group 'experts' names none"),
    (["train.lora_rank=4", "train.lora_alpha=0"], "must be positive"),
    (["train.lora_targets=mlp"], "needs train.lora_rank > 0"),
])
def test_bad_lora_keys_are_one_sentence_and_exit_2(keys, words, capsys, tmp_path):
  assert plan_cmd.main(["--mesh", "1x1x1", "--set", *keys]) == 2
  err = capsys.readouterr().err
  assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
  work = tmp_path / "run"  # train writes nothing either
  assert train_cmd.main(["--mesh", "8x1x1", "--workdir", str(work), "--steps", "1",
                         "--set", "data.source=synthetic", *keys]) == 2
  assert words in capsys.readouterr().err
  assert not work.exists()


def test_an_adapter_export_of_a_run_without_lora_is_refused(tmp_path, capsys):
  cfg = config.load(None, PLAIN)
  t = trainer(cfg, (1, 1, 1))
  t.save(str(tmp_path / "run"), t.init(0))
  out = tmp_path / "adapter"
  assert export_cmd.main(["--workdir", str(tmp_path / "run"), "--peft", str(out)]) == 2
  err = capsys.readouterr().err
  assert "trained without LoRA (train.lora_rank=0)" in err and "Traceback" not in err
  assert not out.exists()
