"""data.source=jsonl: prompt/completion and chat records, rendered by the tokenizer folder's chat
template as transformers renders it, packed whole into windows with segment ids, the loss mask on
the answers only; bad input one sentence naming the file and line."""
import json
import sys

import numpy as np
import pytest

from output_fields import undocumented

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.data import jsonl, make_loader

# Llama 3 Instruct's template (Meta-Llama-3-8B-Instruct's tokenizer_config.json)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5 Instruct's template without its tools branch: ChatML with a default system message
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
STYLES = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "<|eot_id|>"),
    "qwen": (QWEN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "<|im_end|>"),
}
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4, the sum."},
        {"role": "user", "content": "And\n\n3 + 3?"},
        {"role": "assistant", "content": "6\n\nof course."}]
ANSWERS = ("4, the sum.", "6\n\nof course.")


def tokenizer_folder(folder, style=None):
  """A byte-level BPE tokenizer (256 bytes, a few merges, one across "\\n\\n") with the style's
  special tokens and, for a style, its chat template in tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  folder.mkdir(parents=True, exist_ok=True)
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = [("Ċ", "Ċ"), ("o", "f"), ("Ġ", "c"), ("t", "h"), ("th", "e")]
  vocab = {c: i for i, c in enumerate(alphabet + ["".join(m) for m in merges])}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  template, special, names, _ = STYLES[style or "qwen"]
  tok.add_special_tokens(special)
  tok.save(str(folder / "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
  if style:
    cfg["chat_template"] = template
  (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
  return folder


def write(path, records):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


def encoder(folder):
  from jaxpar.data.windows import load_tokenizer
  return jsonl.Encoder(load_tokenizer(str(folder)), str(folder))


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("renderer", ["transformers", "jinja2"])
def test_chat_tokens_are_transformers_and_the_mask_is_the_answers(tmp_path, monkeypatch, style,
                                                                   renderer):
  """A conversation's tokens are transformers' apply_chat_template's (Llama 3 and Qwen templates,
  rendered by transformers or, without it, by jinja2), and the loss mask holds exactly the
  assistant turns' tokens through their end-of-turn token."""
  transformers = pytest.importorskip("transformers")
  folder = tokenizer_folder(tmp_path / style, style)
  want = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
      CHAT, tokenize=True, return_dict=False)
  if renderer == "jinja2":
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
  enc = encoder(folder)
  ids, mask = enc.encode(jsonl.check_record({"messages": CHAT}, "x"), "x")
  assert enc.template("x")._render.__qualname__.startswith(
      f"ChatTemplate._{'jinja' if renderer == 'jinja2' else 'transformers'}")
  assert ids.tolist() == list(want)
  tok = enc.tokenizer
  end = STYLES[style][3]
  assert tok.decode(ids[mask].tolist(), skip_special_tokens=False) == end.join(ANSWERS) + end
  # every answer is whole tokens here, so the mask is also the tokens of exactly those turns
  assert mask.sum() == sum(len(tok.encode(a + end, add_special_tokens=False).ids) for a in ANSWERS)


def byte_cfg(tmp_path, *extra):
  return config.load(None, [f"data.path={tmp_path / 'data'}", "data.source=jsonl",
                            "model.seq_len=31", "train.batch_size=4", "data.workers=0", *extra])


RECORDS = [{"prompt": "p" * (3 + i % 7), "completion": "c" * (1 + (5 * i) % 11)} for i in range(40)]


def test_records_are_packed_whole_with_segments_and_answer_masks(tmp_path):
  """Byte-level prompt/completion records: every record appears once, whole, in one window as
  one segment (prompt, completion, end-of-text 0), its mask 1 from the completion on; padding
  is segment 0, mask 0; best-fit decreasing leaves less padding than one record a row."""
  write(tmp_path / "data" / "train.jsonl", RECORDS[:20] + [""] + RECORDS[20:])
  it = make_loader(byte_cfg(tmp_path), str(tmp_path))
  windows = it._it._plan.windows
  assert it.element_spec == {"tokens": ((4, 32), np.dtype(np.int32)),
                             "segment_ids": ((4, 32), np.dtype(np.int32)),
                             "loss_mask": ((4, 32), np.dtype(np.float32))}
  rows = windows[np.arange(len(windows))]
  seen = []
  for tokens, seg, mask in zip(rows["tokens"], rows["segment_ids"], rows["loss_mask"]):
    n = int((seg > 0).sum())
    assert (seg[n:] == 0).all() and (tokens[n:] == 0).all() and (mask[n:] == 0).all()
    assert (np.diff(seg[:n]) >= 0).all() and seg[0] == 1
    for s in range(1, seg.max() + 1):
      t, m = tokens[seg == s], mask[seg == s]
      text = bytes(t[:-1].astype(np.uint8)).decode()
      assert t[-1] == 0 and m[-1] == 1
      p = len(text.rstrip("c"))
      seen.append({"prompt": text[:p], "completion": text[p:]})
      assert m.tolist() == [0] * p + [1] * (len(t) - p)
  assert sorted(map(json.dumps, seen)) == sorted(map(json.dumps, RECORDS))
  lengths = [len(r["prompt"]) + len(r["completion"]) + 1 for r in RECORDS]
  assert len(windows) < len(RECORDS) and windows.tokens == sum(lengths)
  assert len(windows) == -(-sum(lengths) // 32)  # these lengths pack with no window to spare
  # the start-up line: 519 tokens in 17 windows of 32, 1 - 519 / 544 of them padding; the blank
  # line is no record
  assert sum(lengths) == 519 and it.summary == ("data: 40 records of train.jsonl -> 17 windows "
                                                "of 32 tokens, 4.6% padding")
  assert undocumented([], it.summary) == []  # docs/output.md names the line
  # each record into the window it leaves least room in: worst fit would open a third window
  assert jsonl.best_fit_decreasing(np.array([2, 5, 4, 6, 3]), 10) == [[3, 2], [1, 4, 0]]


def test_a_long_record_is_refused_or_split(tmp_path):
  """A record longer than a window: data.long_records=refuse names its file and line;
  split cuts it into window-long pieces, each a segment of its own, nothing lost."""
  long = {"prompt": "q" * 40, "completion": "a" * 30}  # 71 tokens: windows of 32, 32, 7
  write(tmp_path / "data" / "train.jsonl", RECORDS[:8] + [long] + RECORDS[8:])
  with pytest.raises(ConfigError, match=r"train\.jsonl:9: the record is 71 tokens, longer than "
                                        r"a window of model.seq_len \+ 1 = 32.*long_records=split"):
    make_loader(byte_cfg(tmp_path), str(tmp_path))
  it = make_loader(byte_cfg(tmp_path, "data.long_records=split"), str(tmp_path))
  windows = it._it._plan.windows
  rows = windows[np.arange(len(windows))]
  segments = [(t[s == k], m[s == k]) for t, s, m in
              zip(rows["tokens"], rows["segment_ids"], rows["loss_mask"])
              for k in range(1, s.max() + 1)]
  pieces = [(bytes(t.astype(np.uint8)), int(m.sum())) for t, m in segments
            if np.isin(t, [ord("q"), ord("a")]).any()]  # the other records are p's and c's
  # 40 q + 30 a + end of text in windows of 32: its mask from the a's on
  assert sorted(pieces) == [(b"a" * 6 + b"\0", 7), (b"q" * 8 + b"a" * 24, 24), (b"q" * 32, 0)]
  assert len(segments) == len(RECORDS) + 3
  # the start-up line: 519 + 71 tokens in 19 windows of 32, 1 - 590 / 608 of them padding
  assert it.summary == ("data: 41 records of train.jsonl -> 19 windows of 32 tokens, 3.0% "
                        "padding, 1 record split into 3 pieces (data.long_records=split)")


def test_resumes_mid_epoch_and_reshuffles_windows(tmp_path):
  """state() after k batches restores to the same next batches; a new epoch reorders windows."""
  write(tmp_path / "data" / "train.jsonl", RECORDS)
  cfg = byte_cfg(tmp_path)
  it = make_loader(cfg, str(tmp_path))
  epoch = [it.next() for _ in range(it.steps_per_epoch)]
  it.next()
  state = it.state()
  want = [it.next() for _ in range(2)]
  again = make_loader(cfg, str(tmp_path))
  again.restore(state)
  for a, b in zip(want, [again.next() for _ in range(2)]):
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert state == {"epoch": 1, "position": 1}
  assert not np.array_equal(epoch[1]["tokens"], want[0]["tokens"])


BAD = {
    "not JSON": ('{"prompt": "a", "completion": ', "train.jsonl:3: the line is not JSON"),
    "no fields": ({"prompt": "a", "answer": "b"},
                  "train.jsonl:3: a record needs string fields prompt and completion"),
    "unknown role": ({"messages": [{"role": "user", "content": "a"},
                                   {"role": "bot", "content": "b"}]},
                     "train.jsonl:3: message 1 has role 'bot', not one of system, user, "
                     "assistant, tool"),
    "no template": ({"messages": [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}]},
                    "train.jsonl:3: a messages record needs a chat template, and the tokenizer "
                    "folder"),
    "too long": ({"prompt": "a" * 40, "completion": "b"},
                 "train.jsonl:3: the record is 42 tokens, longer than a window"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_one_sentence_naming_file_and_line(tmp_path, capsys, case):
  """Through the train command: one error line naming the file and line, exit 2, no workdir."""
  from jaxpar.commands import train
  record, words = BAD[case]
  write(tmp_path / "data" / "train.jsonl", RECORDS[:2] + [record] + RECORDS[2:])
  tokenizer = tokenizer_folder(tmp_path / "tok")  # the qwen tokens, no chat template
  code = train.main(["--mesh", "8x1x1", "--workdir", str(tmp_path / "wd"), "--no-progress",
                     "--steps", "1", "--set", f"data.path={tmp_path / 'data'}",
                     "data.source=jsonl", "model.seq_len=31", "train.batch_size=8",
                     "model.vocab_size=512", "model.n_layers=1",
                     *([f"data.tokenizer={tokenizer}"] if case == "no template" else [])])
  err = capsys.readouterr().err
  errors = [l for l in err.splitlines() if l.startswith("error:")]
  assert code == 2 and len(errors) == 1 and words in errors[0], err
  assert str(tmp_path / "data" / "train.jsonl") in errors[0] and "Traceback" not in err
  assert not (tmp_path / "wd").exists()


# -- the loss over packed records (the decoders' segments and loss mask) ---------------------------

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "precision.compute_dtype=float32", "data.workers=0", "data.source=jsonl"]


def chat_batch(tmp_path, monkeypatch, *extra):
  """The first batch of examples/chat (two conversations a 256-token window) rendered through
  jinja2 (transformers' import is slow), and its config."""
  monkeypatch.setitem(sys.modules, "transformers", None)
  root = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples"
  cfg = config.load(None, TINY + [f"data.path={root / 'chat'}",
                                  f"data.tokenizer={root / 'chat-tokenizer'}",
                                  "model.vocab_size=320", "model.seq_len=255",
                                  "train.batch_size=4", *extra])
  return cfg, make_loader(cfg, str(tmp_path)).next()


def test_the_loss_is_the_mean_over_answer_tokens_of_each_record_alone(tmp_path, monkeypatch):
  """The step's loss on packed chats equals a hand computation: each record run alone from
  position 0, cross-entropy on its answer targets only, the mean over all the batch's answer
  tokens (loss_weight their count). Changing a template token's target (the newline after the
  last <|im_end|> of a record, loss_mask 0) changes nothing; changing an answer token does."""
  import jax
  import jax.numpy as jnp
  import test_equivalence as eq

  from jaxpar.models import decoder
  from jaxpar.models import registry as jmodel
  cfg, batch = chat_batch(tmp_path, monkeypatch)
  seg, tokens, mask = batch["segment_ids"], batch["tokens"], batch["loss_mask"]
  assert (seg.max(-1) == 2).all() and (seg == 0).any()  # two records a window, then padding
  t = eq.trainer(cfg, (1, 1, 1))
  state = t.init(cfg.train.seed)
  fn = t.eval_jitted({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()})

  def eval_loss(b):
    with jax.set_mesh(t.mesh):
      return {k: float(v) for k, v in fn(state["params"], b).items()}
  got = eval_loss(batch)
  params = jax.device_get(t.to_logical(state)["params"])
  parts = jmodel.decoder_parts(cfg.model)
  records = [(tokens[r, seg[r] == s], mask[r, seg[r] == s])
             for r in range(len(tokens)) for s in range(1, seg[r].max() + 1)]
  alone = np.zeros((len(records), tokens.shape[1] - 1), np.int32)  # each from position 0;
  for i, (ids, _) in enumerate(records):  # causal, so what follows it changes none of its logits
    alone[i, :len(ids) - 1] = ids[:-1]
  logits = np.asarray(decoder.forward(parts, params, jnp.asarray(alone)), np.float64)
  total, count = 0.0, 0
  for (ids, m), z in zip(records, logits):
    z = z[:len(ids) - 1] - z[:len(ids) - 1].max(-1, keepdims=True)
    ce = np.log(np.exp(z).sum(-1)) - z[np.arange(len(ids) - 1), ids[1:]]
    total += float((ce * m[1:]).sum())
    count += int(m[1:].sum())
  assert got["loss"] == pytest.approx(total / count, rel=1e-5)
  assert got["loss_weight"] == count
  end = int(np.flatnonzero(seg[0] == 1)[-1])  # the last token of row 0's first record
  assert mask[0, end] == 0 and tokens[0, end] == ord("\n")
  changed = {**batch, "tokens": tokens.copy()}
  changed["tokens"][0, end] = ord("x")
  assert eval_loss(changed)["loss"] == pytest.approx(got["loss"], rel=1e-6)
  answer = int(np.flatnonzero(mask[0] * (seg[0] == 1))[0])
  changed["tokens"][0, answer] = ord("x")
  assert eval_loss(changed)["loss"] != pytest.approx(got["loss"], rel=1e-4)


@pytest.mark.parametrize("shape,extra", [((2, 1, 1), ["train.grad_accum=2"]),
                                         ((1, 1, 2), ["parallel.microbatches=4"])],
                         ids=["2x1x1-accum2", "1x1x2-pipeline"])
def test_accumulation_and_pipeline_give_the_per_answer_token_loss_of_one_device(tmp_path, shape,
                                                                                extra):
  """Packed prompt/completion records, whose windows hold unequal numbers of answer tokens:
  two training steps with gradient accumulation over data shards, or under a pipeline's
  microbatches, give one device's losses and first gradients (fp32, 1e-5): means of the pieces'
  means would not."""
  import jax
  import jax.numpy as jnp
  import test_equivalence as eq
  write(tmp_path / "data" / "train.jsonl", RECORDS * 2)
  base = TINY + [f"data.path={tmp_path / 'data'}", "model.seq_len=31", "train.batch_size=8",
                 "train.lr=1e-2", "train.warmup_steps=0"]
  results = []
  for s, e in (((1, 1, 1), []), (shape, extra)):
    cfg = config.load(None, base + e)
    it = make_loader(cfg, str(tmp_path))
    data = [{k: jnp.asarray(v) for k, v in it.next().items()} for _ in range(2)]
    per_row = np.asarray(data[0]["loss_mask"][:, 1:]).sum(1)
    assert len(set(per_row.tolist())) > 1, per_row  # rows weigh unequally
    t = eq.trainer(cfg, s, expose_grads=True)
    state = t.init(cfg.train.seed)
    losses, grads = [], None
    for b in data:
      state, m = t.step(state, b)
      losses.append(float(m["loss"]))
      if grads is None:
        grads = jax.device_get(t._reorder(m["grads"], None if t.layer_order is None
                                          else np.argsort(t.layer_order)))
    results.append((np.array(losses), grads))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
  eq.assert_trees_close(results[1][1], results[0][1], "first step's gradients")


def test_a_template_that_renders_earlier_turns_otherwise_is_refused(tmp_path, monkeypatch):
  """A template that writes an assistant turn one way while it is the last and another once
  more turns follow (as Qwen3's drops earlier reasoning) leaves no answer span to find: the
  record is refused, naming it, rather than masked wrongly."""
  monkeypatch.setitem(sys.modules, "transformers", None)  # jinja2: fast, and the same rendering
  folder = tokenizer_folder(tmp_path / "tok", "qwen")
  cfg_path = folder / "tokenizer_config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == "
                          "'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}"
                          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                          "<|im_start|>assistant\n{% endif %}")
  cfg_path.write_text(json.dumps(cfg))
  enc = encoder(folder)
  ids, mask = enc.encode({"messages": CHAT[:3]}, "f:1")  # one answer, the last: found
  answer = enc.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
  assert answer == ANSWERS[0] + "<|im_end|>"
  with pytest.raises(ConfigError, match="f:2: the chat template of .* renders the turns up to "
                                        "message 2 differently once more turns follow"):
    enc.encode({"messages": CHAT}, "f:2")
