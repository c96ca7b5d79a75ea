"""Hugging Face interop for the Llama family beyond Llama: the mixtures Mixtral, Qwen2-MoE (q/k/v
biases, a shared expert with its sigmoid gate, un-renormalised top-k) and Qwen3-MoE (q/k norms,
heads twice d_model / n_heads wide: Qwen3's own head_dim), and the dense Mistral (a sliding
window), Qwen2 and Qwen3 (heads half d_model / n_heads wide). Random-weight folders made by
`transformers` (fp32, 2 layers, hidden 32, 4-8 experts, top-2) load into jaxpar with the same
logits (1e-5 relative) on one device and with the experts split over data and tensor parallelism
(4x2x1), export back to folders `from_pretrained` loads with no missing or unexpected keys and
the same logits, and decode greedily with the KV cache to transformers' greedy tokens."""
import dataclasses
import importlib.util

import jax
import numpy as np
import pytest
import torch  # the test extra installs both
import transformers
from test_hf import (B, ROOT, T, V, _randomise, exported_logits, hf_logits, jaxpar_run, rel,
                     tokens)

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.interop import generate, hf, hf_llama
from jaxpar.models import decoder, llama
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import checkpoint
from jaxpar.train.step import Trainer

RTOL = 1e-5
COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, vocab_size=V, max_position_embeddings=T, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=0)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MODELS = {  # name: (config class, model class, its keys, torch seed)
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None), 3),
    "qwen2-moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(QWEN_MOE, shared_expert_intermediate_size=32, norm_topk_prob=False), 4),
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(QWEN_MOE, head_dim=16, norm_topk_prob=True), 5),  # heads wider
    # 4 layers, a mixture in layers 1 and 3 (decoder_sparse_step), dense MLPs in 0 and 2
    "qwen2-moe-every2": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                         dict(QWEN_MOE, shared_expert_intermediate_size=32, norm_topk_prob=False,
                              num_hidden_layers=4, decoder_sparse_step=2), 9),
    "qwen3-moe-every2": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                         dict(QWEN_MOE, head_dim=8, norm_topk_prob=True, num_hidden_layers=4,
                              decoder_sparse_step=2), 10),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(head_dim=8, sliding_window=T), 6),  # a window as long as the sequence
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}, 7),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(head_dim=4, tie_word_embeddings=True), 8),  # and narrower than D/H
}


def make_folder(path, name, **changes):
  cfg_cls, model_cls, keys, seed = MODELS[name]
  cfg = cfg_cls(**{**COMMON, **keys, **changes})
  _randomise(model_cls(cfg), seed).save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_moe")
  return {name: make_folder(root / name, name) for name in MODELS}


def test_the_router_is_exercised(folders):
  """Every expert of each layer is some token's choice, and no top-k choice is a near tie, so
  a router weight mapped wrong moves tokens between experts and the logits tests see it."""
  toks = tokens()[:, :-1]
  for name in ("mixtral", "qwen2-moe", "qwen3-moe"):
    m = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
    with torch.no_grad():
      out = m.eval()(torch.from_numpy(toks.astype(np.int64)), output_router_logits=True)
    for logits in out.router_logits:  # (B*T, E) per layer
      p = torch.softmax(logits, -1).sort(-1, descending=True).values
      chosen = torch.topk(logits, 2, -1).indices
      assert len(set(chosen.flatten().tolist())) == logits.shape[-1], name
      assert float((p[:, 1] - p[:, 2]).min()) > 1e-6, name


CASES = [(m, lay) for m in ("mixtral", "qwen2-moe", "qwen3-moe") for lay in ("1x1x1", "4x2x1")] + \
        [("mistral", "2x2x1"), ("qwen2", "2x2x1"), ("qwen3-tied", "2x2x1"),
         ("qwen2-moe-every2", "1x1x1"), ("qwen3-moe-every2", "4x2x1")]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_logits_match_transformers(folders, name, layout):
  """The GSPMD forward's logits and the step's loss (4x2x1: manual over data, experts reached by
  all-to-all) against transformers'; the router's losses weigh 0 here, as transformers' logits
  carry none."""
  shape = tuple(int(d) for d in layout.split("x"))
  toks = tokens()
  want = hf_logits(folders[name], toks[:, :-1])
  logits, loss = jaxpar_run(folders[name], shape,
                            ["train.moe_aux_weight=0", "train.moe_z_weight=0"])
  assert rel(logits, want) < RTOL
  z = want - want.max(-1, keepdims=True)
  ce = np.mean(np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, toks[:, 1:, None], -1)[..., 0])
  assert loss == pytest.approx(float(ce), rel=RTOL)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers < 5 writes no fused experts")
@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_a_folder_with_fused_experts_loads_with_the_same_logits(folders, tmp_path, name):
  """transformers >= 5 keeps a layer's experts in two tensors (gate_up_proj, down_proj) and
  writes them so with save_original_format=False: such a folder gives the same logits."""
  m = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
  m.save_pretrained(tmp_path, save_original_format=False)
  from safetensors import safe_open
  with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
    assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
  logits, _ = jaxpar_run(str(tmp_path), (1, 1, 1), ["train.moe_aux_weight=0", "train.moe_z_weight=0"])
  assert rel(logits, hf_logits(folders[name], tokens()[:, :-1])) < RTOL


def test_config_keys(folders):
  """What each folder's config.json becomes in jaxpar."""
  keys = {name: hf.model_overrides(folders[name]) for name in MODELS}
  assert keys["mixtral"]["n_experts"] == 8 and keys["mixtral"]["router_softmax"] == "after_topk"
  assert keys["mixtral"]["rope_theta"] == 1e6 and "max_positions" not in keys["mixtral"]
  assert {"qkv_bias": True, "shared_experts": 2, "moe_d_ff": 16, "shared_expert_gate": True,
          "router_softmax": "before_topk"}.items() <= keys["qwen2-moe"].items()
  assert keys["qwen3-moe"]["qk_norm"] and keys["qwen3-moe"]["router_softmax"] == "after_topk"
  assert keys["mistral"]["max_positions"] == T and keys["qwen3-tied"]["tie_embeddings"]
  assert keys["qwen2-moe"]["moe_every"] == 1 and keys["qwen2-moe-every2"]["moe_every"] == 2
  assert keys["qwen3-moe"]["head_dim"] == 16 and keys["qwen3-tied"]["head_dim"] == 4
  assert "head_dim" not in keys["mistral"]  # 8 = hidden / heads: the default


@pytest.mark.parametrize("sets,says", [
    (["model.head_dim=-8"], "model.head_dim=-8 must not be negative"),
    (["model.head_dim=5"], "model.head_dim=5 must be even: rotary embeddings turn pairs"),
    (["model.n_heads=3", "model.n_kv_heads=3"],
     "model.d_model=32 is not divisible by model.n_heads=3"),
])
def test_bad_head_dims_are_one_sentence(sets, says):
  with pytest.raises(ConfigError) as e:
    jmodel.build_model(config.load(None, ["model.kind=llama", "model.d_model=32"] + sets))
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_decoupled_head_dim_needs_no_divisible_width():
  """With model.head_dim set, d_model need not divide by n_heads (3 heads of 16 at width 32): the
  parameters' shapes and count follow H x K, not d_model."""
  cfg = config.load(None, ["model.kind=llama", "model.d_model=32", "model.n_heads=3",
                           "model.n_kv_heads=1", "model.head_dim=16", "model.n_layers=1"])
  model = jmodel.decoder(cfg)
  shapes = {k: v.shape for k, v in model.abstract["layers"].items()}
  assert shapes["wq"] == (1, 32, 48) and shapes["wk"] == (1, 32, 16) and shapes["wo"] == (1, 48, 32)
  n = sum(int(np.prod(v.shape)) for k, v in model.abstract["layers"].items()) + 32  # final norm
  assert decoder.sizes(cfg.model)[-1] == 16 and llama.n_params_nonembedding(cfg.model) == n


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe", "mistral", "qwen2",
                                  "qwen2-moe-every2", "qwen3-moe-every2"])
def test_round_trip_loads_in_transformers_with_the_same_logits(folders, tmp_path, name):
  m, got = exported_logits(folders[name], tmp_path)
  assert type(m).__name__ == MODELS[name][1].__name__
  np.testing.assert_array_equal(got, hf_logits(folders[name], tokens()[:, :-1]))


def test_gateless_shared_experts_export_as_qwen2_moe(tmp_path):
  """jaxpar's own mixture with a shared expert and no gate, q/k/v biases or norms becomes a
  Qwen2-MoE folder (zero gate, doubled shared down projection, zero biases) with jaxpar's logits."""
  sets = ["model.kind=llama", "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
          "model.n_kv_heads=2", "model.d_ff=32", f"model.vocab_size={V}", f"model.seq_len={T}",
          "model.n_experts=4", "model.shared_experts=1", "model.router_softmax=before_topk",
          f"train.batch_size={B}", "precision.compute_dtype=float32"]
  cfg = config.load(None, sets)
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg))
  with jax.set_mesh(t.mesh):
    state = t.init_with(jax.jit(t.model.init)(jax.random.key(1)))
    toks = tokens()[:, :-1]
    parts = jmodel.decoder_parts(cfg.model)
    want = np.asarray(jax.jit(lambda p, x: decoder.forward(parts, p, x))(state["params"], toks))
  with checkpoint.Checkpointer(str(tmp_path / "wd" / "checkpoints"), keep=1, every=0) as ckpt:
    ckpt.maybe_save(0, state, {"data": {}, "config": config.to_dict(cfg)}, force=True)
  hf.export(str(tmp_path / "wd"), str(tmp_path / "out"))
  m, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                             output_loading_info=True)
  assert type(m).__name__ == "Qwen2MoeForCausalLM" and not info["missing_keys"], info
  with torch.no_grad():
    got = m.eval()(torch.from_numpy(toks.astype(np.int64))).logits.numpy()
  assert rel(got, want) < RTOL


@pytest.mark.parametrize("name,mesh", [("qwen2-moe", (1, 1, 1)),
                                       ("qwen3-moe", (2, 2, 1)),  # its cache's heads 16 wide
                                       ("qwen2-moe-every2", (2, 2, 1))])
def test_greedy_decoding_with_the_cache_matches_transformers(folders, name, mesh):
  folder = folders[name]
  cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}",
                           f"train.batch_size={B}", "precision.compute_dtype=float32"],
                    base=hf.model_overrides)
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg))
  params = hf.load_params(folder, cfg.model, t.model.abstract, t.state_shardings["params"])
  sampler = generate.Sampler.from_params(cfg, mesh, params)
  prompts = [tokens(2, seed=3)[0, :5], tokens(2, seed=3)[1, :3]]
  got = sampler.sample_tokens(prompts, max_new_tokens=8, temperature=0, stop_token=-1)
  m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  for p, row in zip(prompts, got):
    ids = torch.from_numpy(p[None].astype(np.int64))
    want = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(p):].numpy()
    np.testing.assert_array_equal(row, want)


@pytest.mark.parametrize("name,changes,says", [
    ("qwen2-moe", dict(decoder_sparse_step=3), "model.moe_every=3 does not divide "
                                               "model.n_layers=2"),
    ("qwen3-moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported"),
    ("qwen2-moe", dict(shared_expert_intermediate_size=24),
     "shared_expert_intermediate_size=24 is not supported (jaxpar needs a multiple of"),
    ("qwen3-tied", dict(attention_bias=True), "attention_bias=True is not supported"),
])
def test_unsupported_configs_are_one_sentence(tmp_path, name, changes, says):
  folder = make_folder(tmp_path / name, name, **changes)
  with pytest.raises(ConfigError) as e:
    config.load(None, [f"model.init_from={folder}"], base=hf.model_overrides)
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_window_shorter_than_the_sequence_is_one_sentence_and_exit_2(folders, tmp_path, capsys):
  """jaxpar's attention has no window: a Mistral folder's window of T trains sequences of up to
  T, and train.py refuses 2T in one sentence, writing nothing."""
  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  train = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train)
  workdir = tmp_path / "wd"
  code = train.main(["--mesh", "1x1x1", "--workdir", str(workdir), "--steps", "1", "--no-progress",
                     "--set", f"model.init_from={folders['mistral']}", f"model.seq_len={2 * T}",
                     "data.source=synthetic"])
  errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  assert code == 2 and len(errors) == 1, errors
  assert f"model.max_positions={T} is shorter than model.seq_len={2 * T}" in errors[0]
  assert not (workdir / "checkpoints").exists()


@pytest.mark.parametrize("keys,arch", [
    ({}, "LlamaForCausalLM"), ({"max_positions": 64}, "MistralForCausalLM"),
    ({"qkv_bias": True}, "Qwen2ForCausalLM"), ({"qk_norm": True}, "Qwen3ForCausalLM"),
    ({"n_experts": 4}, "MixtralForCausalLM"),
    ({"n_experts": 4, "shared_experts": 1}, "Qwen2MoeForCausalLM"),
    ({"n_experts": 4, "qk_norm": True, "router_softmax": "before_topk"}, "Qwen3MoeForCausalLM"),
    ({"n_experts": 4, "router_softmax": "before_topk"}, "router_softmax=before_topk and neither"),
    ({"n_experts": 4, "qkv_bias": True}, "without shared experts and with q/k/v biases"),
    ({"n_experts": 4, "n_layers": 4, "moe_every": 2, "shared_experts": 1}, "Qwen2MoeForCausalLM"),
    ({"n_experts": 4, "n_layers": 4, "moe_every": 2}, "a mixture only every 2 layers"),
    ({"qkv_bias": True, "qk_norm": True}, "both q/k/v biases and q/k norms"),
])
def test_the_export_architecture_follows_the_options(keys, arch):
  mc = dataclasses.replace(config.ModelConfig(), kind="llama", **keys)
  if arch.endswith("ForCausalLM"):
    assert hf_llama.architecture_of(mc) == arch
  else:
    with pytest.raises(ConfigError, match=r"^this llama-kind model has .* no Hugging Face") as e:
      hf_llama.architecture_of(mc)
    assert arch in str(e.value)
