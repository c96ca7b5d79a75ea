"""Hugging Face interop: GPT-2 and Llama folders made by `transformers` (random weights, from a
config: nothing is downloaded) load into jaxpar with the same logits (fp32, 1e-5 relative: the
norm of the difference over the norm of the reference) on one device, tensor parallel, pipeline
and ZeRO-3 layouts, and export back to a folder `from_pretrained` loads with no missing or
unexpected keys and the same logits."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra installs both
import transformers

from jaxpar import config
from jaxpar import data as jdata
from jaxpar.interop import hf
from jaxpar.models import decoder
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import checkpoint, loop
from jaxpar.train.step import Trainer

RTOL = 1e-5
T, B, V = 16, 8, 64
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _randomise(model, seed):
  """Every weight random (biases and norm scales too), so each mapping is exercised."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      base = 1.0 if ("ln" in name or "norm" in name) and name.endswith("weight") else 0.0
      p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
  return model.eval()


def gpt2_folder(path):
  cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_inner=64, n_positions=T,
                                vocab_size=V, bos_token_id=0, eos_token_id=0)
  _randomise(transformers.GPT2LMHeadModel(cfg), 0).save_pretrained(path)
  return str(path)


def llama_folder(path, heads, kv, d, tied=False, vocab=V):
  cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=d, num_attention_heads=heads,
                                 num_key_value_heads=kv, intermediate_size=2 * d, vocab_size=vocab,
                                 max_position_embeddings=T, rms_norm_eps=1e-5,
                                 tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
  _randomise(transformers.LlamaForCausalLM(cfg), 1).save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {"gpt2": gpt2_folder(root / "gpt2"),
          "llama-gqa-8-2": llama_folder(root / "llama82", 8, 2, 64),
          "llama-12-heads-4-kv-tied": llama_folder(root / "llama124", 12, 4, 96, tied=True)}


WORDS = ["the", "cat", "sat", "on", "a", "mat"]


def write_tokenizer(folder):
  """A word-level tokenizers file: <unk> 0, <s> 1, </s> 2 (end of text), then WORDS."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + WORDS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
  tok.save(os.path.join(folder, "tokenizer.json"))


def tokens(n=B, seed=0):
  return np.random.default_rng(seed).integers(0, V, size=(n, T + 1)).astype(np.int32)


def hf_logits(folder, toks):
  m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return m(torch.from_numpy(toks.astype(np.int64))).logits.numpy()


def cross_entropy(logits, targets):
  z = logits - logits.max(-1, keepdims=True)
  lse = np.log(np.exp(z).sum(-1))
  return float(np.mean(lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]))


def jaxpar_run(folder, shape, extra=()):
  """(logits of tokens[:, :-1] through the GSPMD forward, loss through the step's sharded path)."""
  cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}",
                           f"train.batch_size={B}", "precision.compute_dtype=float32", *extra], base=hf.model_overrides)
  n = int(np.prod(shape))
  jmesh.check(shape, cfg, n)
  t = Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.decoder(cfg))
  params = hf.load_params(folder, cfg.model, t.model.abstract, t.state_shardings["params"])
  toks = jnp.asarray(tokens())
  parts = jmodel.decoder_parts(cfg.model)
  with jax.set_mesh(t.mesh):
    logits = jax.jit(lambda p, x: decoder.forward(parts, p, x))(params, toks[:, :-1])
    state = t.init_with(params)
    loss = t.eval_jitted({"tokens": jax.ShapeDtypeStruct(toks.shape, toks.dtype)})(
        state["params"], {"tokens": toks})["loss"]
  return np.asarray(logits), float(loss)


def rel(a, b):
  return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


LAYOUTS = {"1x1x1": ((1, 1, 1), []), "1x4x1-tp": ((1, 4, 1), []),
           "1x1x2-pipeline": ((1, 1, 2), ["parallel.microbatches=2"]),
           "2x2x2-zero3": ((2, 2, 2), ["parallel.zero_stage=3", "parallel.microbatches=2"]),
           "1x2x1x2-context": ((1, 2, 1, 2), [])}  # the loss around the ring, the sequence split
CASES = [(m, lay) for m in ("gpt2", "llama-12-heads-4-kv-tied") for lay in LAYOUTS
         if lay != "1x2x1x2-context"] + \
        [("llama-gqa-8-2", "1x1x1"), ("llama-gqa-8-2", "2x2x2-zero3"),  # 2 kv heads: model <= 2
         ("gpt2", "1x2x1x2-context"), ("llama-gqa-8-2", "1x2x1x2-context")]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_logits_match_transformers(folders, name, layout):
  shape, extra = LAYOUTS[layout]
  toks = tokens()
  want = hf_logits(folders[name], toks[:, :-1])
  logits, loss = jaxpar_run(folders[name], shape, extra)
  assert rel(logits, want) < RTOL
  assert loss == pytest.approx(cross_entropy(want, toks[:, 1:]), rel=RTOL)


def _checkpoint_of(folder, workdir, extra=()):
  """A jaxpar checkpoint at step 0 holding the folder's weights (what a run starts from)."""
  cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}", f"train.batch_size={B}",
                           *extra], base=hf.model_overrides)
  t = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jmodel.decoder(cfg))
  state = t.init_with(hf.load_params(folder, cfg.model, t.model.abstract, t.state_shardings["params"]))
  with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=1, every=0) as ckpt:
    ckpt.maybe_save(0, state, {"data": {}, "config": config.to_dict(cfg)}, force=True)


def exported_logits(folder, tmp_path):
  """`folder` imported into a jaxpar checkpoint, exported again and loaded by transformers with
  no missing, unexpected or mismatched weight: (the model, its logits on tokens()[:, :-1])."""
  _checkpoint_of(folder, tmp_path / "wd")
  out = tmp_path / "exported"
  hf.export(str(tmp_path / "wd"), str(out))
  m, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True,
                                                             dtype=torch.float32)
  assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  with torch.no_grad():
    logits = m.eval()(torch.from_numpy(tokens()[:, :-1].astype(np.int64))).logits.numpy()
  return m, logits


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-8-2", "llama-12-heads-4-kv-tied"])
def test_round_trip_loads_in_transformers_with_the_same_logits(folders, tmp_path, name):
  m, got = exported_logits(folders[name], tmp_path)
  assert m.config.eos_token_id == m.config.bos_token_id == 0  # byte tokens: the separator
  want = hf_logits(folders[name], tokens()[:, :-1])
  if name == "gpt2":  # the key bias comes back as zeros: equal up to softmax's rounding
    assert rel(got, want) < 1e-6
  else:
    np.testing.assert_array_equal(got, want)


def test_fine_tune_from_a_folder_trains(folders, tmp_path, monkeypatch):
  """`model.init_from` starts a run from the folder's weights, on a ZeRO-3 pipeline layout."""
  folder = str(tmp_path / "llama256")  # byte tokens need a vocabulary of 256
  cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, vocab_size=256,
                                 max_position_embeddings=T, bos_token_id=0, eos_token_id=0)
  _randomise(transformers.LlamaForCausalLM(cfg), 2).save_pretrained(folder)
  write_tokenizer(folder)
  special = {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}
  with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
    json.dump(special, f)
  cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}", f"train.batch_size={B}",
                           "data.source=synthetic", "train.steps=2", "precision.compute_dtype=float32"], base=hf.model_overrides)
  logs, first = [], []
  make_loader = jdata.make_loader

  def recording(*args, **kwargs):  # keeps the first batch the run trains on
    loader = make_loader(*args, **kwargs)
    next_batch = loader.next

    def recorded():
      batch = next_batch()
      if not first:
        first.append(np.array(batch["tokens"]))
      return batch
    loader.next = recorded
    return loader
  monkeypatch.setattr(jdata, "make_loader", recording)
  result = loop.run(cfg, (2, 2, 2), str(tmp_path / "wd"), progress=False, log=logs.append)
  assert any("initialised from the model folder" in line for line in logs)
  assert result.steps == 2 and np.isfinite(result.losses[2])
  # Step 1's loss is taken before the first update: transformers' loss on that same batch, to
  # the fp32 tolerance of the logits tests (a weight not loaded, or loaded transposed, is far off).
  toks = first[0]
  assert toks.shape == (B, T + 1)
  want = cross_entropy(hf_logits(folder, toks[:, :-1]), toks[:, 1:])
  assert result.losses[1] == pytest.approx(want, rel=RTOL)

  # generate.py speaks the folder's tokenizer; export.py --hf hands the run back to transformers
  from jaxpar.interop import generate
  sampler = generate.Sampler(str(tmp_path / "wd"), (2, 2, 2))
  assert sampler.codec.tokenizer is not None and sampler.codec.eos == 2
  text = sampler.generate("the cat", max_new_tokens=6, temperature=0)[0]
  assert set(text.split()) <= set(WORDS)
  out = tmp_path / "back"
  r = subprocess.run([sys.executable, "scripts/export.py", "--workdir", str(tmp_path / "wd"),
                      "--hf", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  m, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert m.config.eos_token_id == m.config.bos_token_id == 0  # the folder's, kept
  # and its tokenizer beside the weights: the folder's files, a tokenizer_config.json made for it
  assert "the run's tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json)" in r.stdout
  assert json.loads((out / "special_tokens_map.json").read_text()) == special
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tok("the cat sat")["input_ids"] == [3, 4, 5] and tok.eos_token_id == 2


def test_a_folder_with_a_tokenizer_fine_tunes_on_its_tokens(tmp_path):
  """With no data.tokenizer, text is tokenised by the model.init_from folder's tokenizer.json,
  as generation and export --hf speak it, and the run's start-up says which; a folder without
  one, and synthetic data, keep byte tokens."""
  from jaxpar.interop import generate
  from tokenizers import Tokenizer
  folder = llama_folder(tmp_path / "llama", 4, 2, 32, vocab=256)
  bare = llama_folder(tmp_path / "bare", 4, 2, 32, vocab=256)
  write_tokenizer(folder)
  text = tmp_path / "text"
  text.mkdir()
  (text / "a.txt").write_text(" ".join(WORDS[i % 5] for i in range(400)))
  sets = [f"data.path={text}", f"model.seq_len={T}", f"train.batch_size={B}", "data.workers=0",
          "train.steps=1", "precision.compute_dtype=float32"]
  cfg = config.load(None, [f"model.init_from={folder}", *sets], base=hf.model_overrides)
  assert cfg.data.tokenizer == folder
  assert generate.Codec(cfg).path == os.path.join(folder, "tokenizer.json")
  # the reference: the tokenizer's own ids of the text, each window a slice of them
  ids = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(
      (text / "a.txt").read_text(), add_special_tokens=False).ids + [2]  # </s> ends it
  stream = " ".join(map(str, ids))
  logs = []
  result = loop.run(cfg, (8, 1, 1), str(tmp_path / "wd"), progress=False, log=logs.append)
  assert result.steps == 1
  assert f"tokenizer: {folder} (the model.init_from folder's tokenizer.json)" in logs
  tokens = jdata.make_loader(cfg, str(tmp_path / "wd")).next()["tokens"]
  assert all(" ".join(map(str, row)) in stream for row in tokens), tokens
  for folder_, extra in ((bare, []), (folder, ["data.source=synthetic"])):
    cfg = config.load(None, [f"model.init_from={folder_}", *sets, *extra],
                      base=hf.model_overrides)
    assert cfg.data.tokenizer == ""


def test_a_bare_tokenizer_json_exports_with_its_end_of_text(tmp_path):
  """A run whose tokenizer folder holds only tokenizer.json: export --hf writes a
  tokenizer_config.json beside it, and transformers' AutoTokenizer on the export knows the run's
  end-of-text id (as eos and bos) and encodes as the run did."""
  from jaxpar.interop import generate
  folder, out = tmp_path / "tok", tmp_path / "out"
  folder.mkdir()
  out.mkdir()
  write_tokenizer(folder)
  codec = generate.Codec(config.load(None, [f"data.tokenizer={folder}"]))
  assert hf.write_tokenizer(codec, str(out), T) == ["tokenizer.json", "tokenizer_config.json"]
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tok.eos_token_id == tok.bos_token_id == codec.eos == 2
  assert tok("the cat sat")["input_ids"] == codec.encode("the cat sat")[1:].tolist() == [3, 4, 5]
  assert tok.model_max_length == T


@pytest.mark.parametrize("breakage,words", [
    ("arch", ["config.json", "architecture", "BertModel"]),
    ("missing", ["has no tensor", "model.layers.1.mlp.up_proj.weight"]),
    ("shape", ["model.norm.weight", "shape"]),
])
def test_malformed_folder_is_one_sentence_and_exit_2(tmp_path, capsys, breakage, words):
  from safetensors.numpy import load_file, save_file
  bad = tmp_path / "bad"
  llama_folder(bad, 4, 2, 32, vocab=256)  # byte tokens (synthetic data) need 256 ids
  if breakage == "arch":
    c = json.loads((bad / "config.json").read_text())
    c["architectures"] = ["BertModel"]
    (bad / "config.json").write_text(json.dumps(c))
  else:
    t = load_file(str(bad / "model.safetensors"))
    if breakage == "missing":
      del t["model.layers.1.mlp.up_proj.weight"]
    else:
      t["model.norm.weight"] = np.ones((3,), np.float32)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
  workdir = tmp_path / "wd"
  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  train = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train)
  code = train.main(["--mesh", "8x1x1", "--workdir", str(workdir), "--steps", "1", "--no-progress",
                     "--set", f"model.init_from={bad}", f"model.seq_len={T}", "data.source=synthetic"])
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert code == 2 and len(errors) == 1, err
  assert all(w in errors[0] for w in words), errors[0]
  assert "Traceback" not in err
  assert not (workdir / "checkpoints").exists()


def test_export_keeps_every_field_of_the_folder_the_run_did_not_change(tmp_path, capsys):
  """A folder with its own token ids, a longer max_position_embeddings than the run's seq_len,
  rope parameters beyond jaxpar's, transformers 4's torch_dtype and a generation_config.json:
  exported after a run that changed nothing, every field of both files is the folder's (compared
  as JSON values: json.load of each file, key by key); after a run that changed the rotary base
  and trained on another tokenizer, exactly those fields differ, and the summary line names them."""
  from jaxpar.commands import export as export_command
  folder = tmp_path / "src"
  llama_folder(folder, 4, 2, 32)
  write_tokenizer(str(folder))
  c = json.loads((folder / "config.json").read_text())
  c.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=128,
           torch_dtype="float32", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 64})
  del c["dtype"]
  (folder / "config.json").write_text(json.dumps(c))
  g = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_length": 40,
       "do_sample": True, "temperature": 0.7, "top_p": 0.9}
  (folder / "generation_config.json").write_text(json.dumps(g))

  _checkpoint_of(str(folder), tmp_path / "wd")
  assert export_command.main(["--workdir", str(tmp_path / "wd"), "--hf", str(tmp_path / "out")]) == 0
  assert "(the run changed none)" in capsys.readouterr().out
  out = json.loads((tmp_path / "out" / "config.json").read_text())
  assert {k: out.get(k) for k in c} == c
  assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == g

  other = tmp_path / "other"  # another tokenizer (its end of text: 2)
  other.mkdir()
  write_tokenizer(str(other))
  _checkpoint_of(str(folder), tmp_path / "wd2", ["model.rope_theta=20000", f"data.tokenizer={other}"])
  assert export_command.main(["--workdir", str(tmp_path / "wd2"), "--hf", str(tmp_path / "out2")]) == 0
  line = capsys.readouterr().out
  out = json.loads((tmp_path / "out2" / "config.json").read_text())
  changed = {k for k in c if out[k] != c[k]}
  assert changed == {"bos_token_id", "rope_parameters"}, changed
  assert out["rope_parameters"] == {**c["rope_parameters"], "rope_theta": 20000.0}
  assert out["bos_token_id"] == out["eos_token_id"] == 2  # the run's tokenizer's end of text
  for words in ("rope_parameters.rope_theta: 10000.0 -> 20000.0", "bos_token_id: 1 -> 2",
                "generation_config.json bos_token_id: 1 -> 2"):
    assert words in line, line
  assert json.loads((tmp_path / "out2" / "generation_config.json").read_text()) == {
      **g, "bos_token_id": 2}


def test_gpt2_with_its_real_vocabulary_trains_split_over_model_and_exports_unpadded(tmp_path):
  """GPT-2's 50,257 tokens do not divide by 4: the embedding holds 50,304 rows
  (model.vocab_multiple=64), the padding masked out of the softmax. The first loss is
  transformers' on the same tokens, two steps on 1x4x1 and 2x4x1 ZeRO-1 match one device (losses
  and first gradients within 1e-5), and the export drops the padding: every tensor of the folder
  comes back bit for bit (its key bias zero, as jaxpar writes it)."""
  from safetensors.numpy import load_file
  from test_equivalence import assert_trees_close
  full = 50257
  m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      n_layer=2, n_embd=32, n_head=4, n_inner=64, n_positions=T, vocab_size=full))
  _randomise(m, 3)
  with torch.no_grad():
    for block in m.transformer.h:
      block.attn.c_attn.bias[32:64] = 0  # the key bias, which jaxpar drops (softmax ignores it)
  folder = str(tmp_path / "gpt2")
  m.save_pretrained(folder)
  toks = np.random.default_rng(0).integers(0, full, size=(B, T + 1)).astype(np.int32)
  toks[:, -1] = full - 1  # the last real token is a target
  want = cross_entropy(hf_logits(folder, toks[:, :-1]), toks[:, 1:])

  def run(shape, extra=()):
    cfg = config.load(None, [f"model.init_from={folder}", f"model.seq_len={T}", f"train.batch_size={B}",
                             "precision.compute_dtype=float32", "train.lr=1e-2", *extra],
                      base=hf.model_overrides)
    n = int(np.prod(shape))
    jmesh.check(shape, cfg, n)
    t = Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.decoder(cfg), expose_grads=True)
    assert t.model.abstract["wte"].shape == (50304, 32)
    assert decoder.padding_params(t.model.abstract, cfg.model) == 47 * 32
    state = t.init_with(hf.load_params(folder, cfg.model, t.model.abstract, t.state_shardings["params"]))
    losses, grads = [], None
    for _ in range(2):
      state, metrics = t.step(state, {"tokens": jnp.asarray(toks)})
      losses.append(float(metrics["loss"]))
      grads = jax.device_get(metrics["grads"]) if grads is None else grads
    return np.array(losses), grads

  ref, ref_grads = run((1, 1, 1))
  assert ref[0] == pytest.approx(want, rel=RTOL)
  assert not np.any(ref_grads["wte"][full:])  # the padding learns nothing
  for shape, extra in (((1, 4, 1), ()), ((2, 4, 1), ("parallel.zero_stage=1",))):
    losses, grads = run(shape, extra)
    np.testing.assert_allclose(losses, ref, rtol=RTOL)
    assert_trees_close(grads, ref_grads, f"{shape} gradient")

  _checkpoint_of(folder, tmp_path / "wd")
  hf.export(str(tmp_path / "wd"), str(tmp_path / "out"))
  src, out = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, tmp_path / "out"))
  assert out["transformer.wte.weight"].shape == (full, 32)
  assert set(out) == set(src)
  for name in src:
    np.testing.assert_array_equal(out[name], src[name], err_msg=name)
  assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == full


def torch_greedy(folder, ids, n):
  """transformers' model, argmax n times: the greedy continuation of `ids`."""
  m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  x = torch.tensor([list(ids)], dtype=torch.int64)
  with torch.no_grad():
    for _ in range(n):
      x = torch.cat([x, m(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
  return x[0, len(ids):].numpy()


CHAT = ("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}")


def test_generate_from_a_folder_gives_transformers_greedy_tokens_and_chats(tmp_path, capsys):
  """generate.py --hf on jaxpar's export of a Llama folder: prompts start with the folder's
  bos_token_id; greedy tokens are transformers' on 1x1x1 and 2x2x1; --chat renders the folder's
  chat template as transformers' apply_chat_template does and continues it as transformers does;
  a folder of an architecture jaxpar does not read is one sentence, exit 2, nothing written."""
  from tokenizers import Tokenizer
  from jaxpar.commands import generate as generate_command
  src = tmp_path / "src"
  llama_folder(src, 4, 2, 32)
  write_tokenizer(str(src))
  tok = Tokenizer.from_file(str(src / "tokenizer.json"))
  tok.add_special_tokens(["<s>", "</s>"])  # whole in a chat template's text
  tok.save(str(src / "tokenizer.json"))
  (src / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
       "unk_token": "<unk>", "chat_template": CHAT}))
  c = json.loads((src / "config.json").read_text())
  for name in ("config.json", "generation_config.json"):
    f = src / name
    f.write_text(json.dumps({**json.loads(f.read_text()), "bos_token_id": 1, "eos_token_id": 2}))
  _checkpoint_of(str(src), tmp_path / "wd")
  folder = str(tmp_path / "out")
  hf.export(str(tmp_path / "wd"), folder)

  n = 8
  want = torch_greedy(folder, [1, 3, 4, 5], n)
  # generation_config.json's eos ids as a list (a chat model's end of turn beside </s>): a
  # sample stops at the first of any of them, here at the third token
  turn_end = int(want[2])
  assert 2 not in want[:3] and turn_end not in want[:2], want
  generation = pathlib.Path(folder) / "generation_config.json"
  generation.write_text(json.dumps({**json.loads(generation.read_text()),
                                    "eos_token_id": [2, turn_end]}))
  for shape in ((1, 1, 1), (2, 2, 1)):
    sampler = hf.sampler(folder, shape)
    ids = sampler.codec.encode("the cat sat")
    assert list(ids) == [1, 3, 4, 5]  # <s> the cat sat
    got = sampler.sample_tokens([ids], n, temperature=0, stop_token=-1)[0]
    np.testing.assert_array_equal(got, want, err_msg=str(shape))
  assert sampler.codec.stops == (2, turn_end)  # </s> (end of text, eos_token) and the list's
  stopped = sampler.sample_tokens([ids], n, temperature=0)[0]  # the folder's stops: the default
  assert list(stopped) == list(want[:3]) + [turn_end] * (n - 3)

  messages = [{"role": "user", "content": "the cat"}]
  text = hf.render_chat(folder, messages)
  want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert text == want == "<s>the cat</s><s>"
  ids = sampler.codec.encode(text, start=False)
  greedy = torch_greedy(folder, ids, n)  # the reply ends at the first of the folder's stops
  reply = sampler.codec.decode(greedy[:next(
      (i for i, t in enumerate(greedy) if t in sampler.codec.stops), n)])
  capsys.readouterr()
  assert generate_command.main(["--hf", folder, "--chat", "--prompt", "the cat", "--mesh", "2x2x1",
                                "--temperature", "0", "--max-new-tokens", str(n)]) == 0
  assert capsys.readouterr().out == reply + "\n"

  bad = tmp_path / "bert"
  bad.mkdir()
  (bad / "config.json").write_text(json.dumps({**c, "architectures": ["BertModel"]}))
  assert generate_command.main(["--hf", str(bad), "--prompt", "the"]) == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "BertModel" in errors[0] and "Traceback" not in err, err
  assert sorted(p.name for p in bad.iterdir()) == ["config.json"]


def test_a_folders_stop_ids_are_its_end_of_text_eos_ids_and_eos_token(tmp_path):
  """generate --hf stops a sample at the end of text, every eos_token_id of
  generation_config.json (a list; else config.json's) and tokenizer_config.json's eos_token (a
  chat model's end of turn); a tokenizer's fallback id 0, which ends no text, is no stop."""
  from tokenizers import Tokenizer
  from jaxpar.data.windows import load_tokenizer
  folder = str(tmp_path)
  write_tokenizer(folder)
  tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  tok.add_special_tokens(["<|im_end|>"])  # id 9
  tok.save(os.path.join(folder, "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 6]}))
  tok = load_tokenizer(folder)
  assert hf.stop_ids(folder, {"eos_token_id": 7}, tok, 2) == (2, 6, 9)
  os.remove(tmp_path / "generation_config.json")
  assert hf.stop_ids(folder, {"eos_token_id": 7}, tok, 0) == (7, 9)  # 0 is <unk>
  assert hf.stop_ids(folder, {"eos_token_id": [3, 4]}, None, 0) == (0, 3, 4)  # byte tokens


def test_a_tokenizer_trained_offline_loads_in_transformers_with_its_chat_template(tmp_path, capsys):
  """dataset.py tokenizer (the guide's offline recipe): a byte-level BPE on a folder of text
  that AutoTokenizer loads with the same ids and whose chat template renders as hf.render_chat
  does; too small a vocabulary is one sentence, exit 2, nothing written."""
  from tokenizers import Tokenizer
  from jaxpar.commands import dataset
  text = tmp_path / "text"
  text.mkdir()
  (text / "a.py").write_text("def main():\n    return sum(range(10))\n" * 50)
  out = tmp_path / "tok"
  assert dataset.main(["tokenizer", str(text), "--out", str(out), "--vocab-size", "300"]) == 0
  assert "data.tokenizer=" in capsys.readouterr().out
  ours = Tokenizer.from_file(str(out / "tokenizer.json"))
  auto = transformers.AutoTokenizer.from_pretrained(str(out))
  line = "def main(): return 1"
  assert auto(line)["input_ids"] == ours.encode(line).ids and auto.decode(ours.encode(line).ids) == line
  assert ours.get_vocab_size() <= 300 and auto.eos_token_id == ours.token_to_id("<|endoftext|>") == 0
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": line}]
  assert hf.render_chat(str(out), messages) == auto.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  bad = tmp_path / "bad"
  assert dataset.main(["tokenizer", str(text), "--out", str(bad), "--vocab-size", "100"]) == 2
  err = capsys.readouterr().err
  assert "--vocab-size=100 must be at least 259" in err and "Traceback" not in err
  assert not bad.exists()
