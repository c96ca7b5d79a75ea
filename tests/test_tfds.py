"""data.source=tfds through the real tfds.data_source path, on `tfds.testing.mock_data` examples."""
import json
import math
import pathlib
import subprocess
import sys

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import child_env

from jaxpar import config as jconfig
from jaxpar.config import ConfigError
from jaxpar.data import make_loader, pack, tfds_source
from jaxpar.data.tokens import SEPARATOR

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_GPT = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
            "model.seq_len=16"]
CIFAR = ["data.source=tfds", "data.name=cifar10", "model.kind=cnn", "train.batch_size=8"]


def _cfg(*overrides):
  return jconfig.load(None, list(overrides))


@pytest.fixture
def mock40():
  """40 random examples in every split of every TFDS dataset."""
  with tfds.testing.mock_data(num_examples=40):
    yield


def _ids(batch):
  """One identity per example: the normalised image bytes (unique for random mock images)."""
  return [img.tobytes() for img in batch["image"]]


def _take(loader, n):
  return [loader.next() for _ in range(n)]


RUNS = {  # name -> (mock examples per split, train.py arguments)
    "lm1b": (200, ["--set", "data.source=tfds", "data.name=lm1b", "train.batch_size=8", *TINY_GPT]),
    "cifar10": (64, ["--config", str(ROOT / "configs" / "cifar10_cnn.yaml"), "--set",
                     "train.batch_size=8", "train.eval_every=2", "train.eval_steps=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Both 3-step runs on 4x1x1, started together so their start-up and compiles overlap."""
  env = child_env()
  started = {}
  for name, (examples, args) in RUNS.items():
    tmp = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, str(ROOT / "tests" / "mock_tfds_train.py"), str(examples), "--mesh",
           "4x1x1", "--workdir", str(tmp / "wd"), "--metrics-file", str(tmp / "m.jsonl"),
           "--steps", "3", "--no-progress", *args, "train.log_every=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    started[name] = (proc, tmp / "m.jsonl")
  yield started
  for proc, _ in started.values():
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _rows(runs, name):
  """(logged step rows, final row) of one run, after checking that it succeeded."""
  proc, path = runs[name]
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 0, err
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  return [r for r in rows if not r.get("final")], rows[-1]


def test_lm1b_trains_three_steps(runs):
  steps, final = _rows(runs, "lm1b")
  assert [row["step"] for row in steps] == [1, 2, 3]
  assert all(math.isfinite(row["loss"]) and row["tokens_per_sec"] > 0 for row in steps)
  assert final["tokens_per_sec"] > 0 and final["examples_per_sec"] > 0


def test_cifar10_trains_three_steps_and_logs_accuracy(runs):
  steps, final = _rows(runs, "cifar10")
  assert [row["step"] for row in steps] == [1, 2, 3]
  for row in steps:
    assert math.isfinite(row["loss"]) and 0.0 <= row["accuracy"] <= 1.0
    assert row["examples_per_sec"] > 0 and "tokens_per_sec" not in row  # not a sequence model
  assert 0.0 <= steps[1]["eval_accuracy"] <= 1.0 and math.isfinite(steps[1]["eval_loss"])
  assert "tokens_per_sec" not in final and final["examples_per_sec"] > 0


def test_unprepared_dataset_is_a_config_error_before_the_workdir(tmp_path, caplog):
  from jaxpar.train import loop
  cfg = _cfg("data.source=tfds", "data.name=lm1b", f"data.data_dir={tmp_path / 'tfds'}", *TINY_GPT)
  with pytest.raises(ConfigError) as err:  # scripts print it as one line and exit with code 2
    loop.run(cfg, (8, 1, 1), str(tmp_path / "wd"), progress=False)
  # TFDS's "Variant folder ... has no dataset_info.json" would come before that line
  assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= 30], caplog.records
  message = str(err.value)
  assert "TFDS dataset lm1b is not prepared in" in message and "\n" not in message
  assert "tfds build lm1b --file_format=array_record" in message and "data.data_dir" in message
  assert not (tmp_path / "wd").exists()


def test_same_seed_same_batches_and_epochs_reshuffle(mock40):
  a = make_loader(_cfg(*CIFAR), "")
  b = make_loader(_cfg(*CIFAR), "")
  assert a.steps_per_epoch == 5
  assert a.element_spec == {"image": ((8, 32, 32, 3), np.dtype(np.float32)),
                            "label": ((8,), np.dtype(np.int32))}
  first, again = _take(a, 10), _take(b, 10)
  for x, y in zip(first, again):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert first[0]["image"].dtype == np.float32 and first[0]["label"].dtype == np.int32
  epoch0 = sum((_ids(x) for x in first[:5]), [])
  epoch1 = sum((_ids(x) for x in first[5:]), [])
  assert len(set(epoch0)) == 40 and set(epoch0) == set(epoch1)  # every example once per epoch
  assert epoch0 != epoch1  # in another order
  other = make_loader(_cfg(*CIFAR, "train.seed=1"), "")
  assert sum((_ids(x) for x in _take(other, 5)), []) != epoch0
  for it in (a, b, other):
    it.close()


def test_restore_continues_the_exact_sequence(mock40):
  cfg = _cfg(*CIFAR, "data.augment=true")
  it = make_loader(cfg, "")
  _take(it, 3)
  state = it.state()
  assert state == {"epoch": 0, "position": 3, "processes": 1}  # images: shuffled per process
  assert all(type(v) is int for v in state.values())
  expected = _take(it, 9)  # crosses two epoch boundaries; augmentation included
  resumed = make_loader(cfg, "")
  resumed.restore(state)
  for x, y in zip(_take(resumed, 9), expected):
    np.testing.assert_array_equal(x["image"], y["image"])
  assert resumed.state() == {"epoch": 2, "position": 2, "processes": 1}
  with pytest.raises(ConfigError, match="does not fit this data's 5 batches per epoch"):
    resumed.restore({"epoch": 0, "position": 5})
  it.close()
  resumed.close()


def test_shards_of_two_processes_are_disjoint_and_cover_the_split(mock40):
  for n in (1, 2, 7, 40, 41):
    for count in (2, 3):
      ranges = [tfds_source.shard_range(n, grain.sharding.ShardOptions(i, count))
                for i in range(count)]
      keys = [k for lo, hi in ranges for k in range(lo, hi)]
      assert keys == list(range(n))  # contiguous, disjoint, covering, in process order
      sizes = [hi - lo for lo, hi in ranges]
      assert max(sizes) - min(sizes) <= 1
  cfg = _cfg(*CIFAR)
  parts = [make_loader(cfg, "", process_index=i, process_count=2) for i in range(2)]
  assert [p.steps_per_epoch for p in parts] == [5, 5]
  assert parts[0].element_spec["image"][0][0] == 4  # half of the global batch
  seen = [sum((_ids(p.next()) for _ in range(5)), []) for p in parts]
  assert len(set(seen[0])) == len(set(seen[1])) == 20
  assert not set(seen[0]) & set(seen[1])
  whole = sum((_ids(x) for x in _take(make_loader(cfg, ""), 5)), [])
  assert set(seen[0]) | set(seen[1]) == set(whole)
  for p in parts:
    p.close()


def test_text_batches_do_not_depend_on_the_process_count(mock40):
  # Each process takes its part of one global order: two processes' parts, side by side, are the
  # one-process batches, across an epoch boundary, and a resume may change the process count.
  cfg = _cfg("data.source=tfds", "data.name=lm1b", "model.seq_len=15", "train.batch_size=4")
  one = make_loader(cfg, "")
  parts = [make_loader(cfg, "", process_index=i, process_count=2) for i in range(2)]
  n = one.steps_per_epoch + 2
  assert [p.steps_per_epoch for p in parts] == [one.steps_per_epoch] * 2
  for want in _take(one, n):
    got = np.concatenate([p.next()["tokens"] for p in parts])
    np.testing.assert_array_equal(got, want["tokens"])
  resumed = make_loader(cfg, "", process_index=1, process_count=2)
  resumed.restore(one.state())
  np.testing.assert_array_equal(resumed.next()["tokens"], one.next()["tokens"][2:])
  for it in (one, resumed, *parts):
    it.close()


def test_images_resume_mid_epoch_only_with_the_same_process_count(mock40):
  cfg = _cfg(*CIFAR)
  two = make_loader(cfg, "", process_index=0, process_count=2)
  _take(two, 2)
  state = two.state()
  assert state == {"epoch": 0, "position": 2, "processes": 2}
  with pytest.raises(ConfigError, match=r"stopped mid-epoch with 2 processes; .* resume it "
                                        r"with 2 processes"):
    make_loader(cfg, "").restore(state)
  make_loader(cfg, "").restore({**state, "epoch": 1, "position": 0})  # an epoch boundary is fine
  two.close()


def test_streamed_shards_match_the_cached_ones(mock40, monkeypatch):
  cached = _take(make_loader(_cfg(*CIFAR), ""), 2)
  monkeypatch.setattr(tfds_source, "CACHE_BYTES", 0)
  streamed = _take(make_loader(_cfg(*CIFAR), ""), 2)
  for x, y in zip(cached, streamed):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])


def test_images_are_normalised_and_augmented(mock40):
  plain = make_loader(_cfg(*CIFAR), "").next()["image"]
  assert abs(plain.mean()) < 0.1 and abs(plain.std() - 1) < 0.1  # per-channel mean/std
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
  y = tfds_source.augment(x, np.random.default_rng(1), pad=2)
  assert y.shape == x.shape and y.dtype == x.dtype and not np.array_equal(x, y)
  # Each output is a shifted window of the (maybe flipped) input: its centre pixels survive.
  for a, b in zip(x, y):
    assert any(np.isin(b[2:6, 2:6], f).all() for f in (a, a[:, ::-1]))


def test_hosts_augment_the_same_image_differently(mock40, monkeypatch):
  # Both halves of the split read records 0..19, so two hosts' shards hold the same images and,
  # with equal shard sizes, the same permutation: batch k is the same images on both hosts.
  read = tfds_source._read_one
  monkeypatch.setattr(tfds_source, "_read_one", lambda source, key: read(source, int(key) % 20))
  for augment, same in (("false", True), ("true", False)):
    cfg = _cfg(*CIFAR, f"data.augment={augment}")
    hosts = [make_loader(cfg, "", process_index=i, process_count=2) for i in range(2)]
    for _ in range(3):
      a, b = (h.next() for h in hosts)
      np.testing.assert_array_equal(a["label"], b["label"])
      assert np.array_equal(a["image"], b["image"]) == same
      if not same:  # not one image of the batch flipped and cropped alike on both hosts
        assert not any(np.array_equal(x, y) for x, y in zip(a["image"], b["image"]))
    for h in hosts:
      h.close()


def test_text_is_packed_bytes_of_every_document(mock40):
  source = tfds.data_source("lm1b", split="train")
  docs = [source[i]["text"] for i in range(len(source))]
  windows = tfds_source.text_windows(source, "text", 15)
  packed = pack(docs, 15)
  assert windows.shape == packed.shape and windows.tokens == sum(len(d) + 1 for d in docs)
  np.testing.assert_array_equal(windows[:], packed)
  rows = np.array([7, 0, 7, len(packed) - 1, -1])  # any order, repeats and negative rows
  np.testing.assert_array_equal(windows[rows], packed[rows])
  np.testing.assert_array_equal(windows[3], packed[3])
  it = make_loader(_cfg("data.source=tfds", "data.name=lm1b", "model.seq_len=15",
                        "train.batch_size=4"), "")
  batch = it.next()
  assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == np.int32
  leaf = ((4, 16), np.dtype(np.int32))
  assert it.element_spec == {"tokens": leaf, "segment_ids": leaf}  # data.packing=documents
  tokens, seg = batch["tokens"], batch["segment_ids"]
  # 1 from each window's first token, one more after each document's end token
  assert (seg[:, 0] == 1).all() and seg.dtype == np.int32
  np.testing.assert_array_equal(np.diff(seg, axis=1), tokens[:, :-1] == SEPARATOR)
  it.close()
  it = make_loader(_cfg("data.source=tfds", "data.name=lm1b", "model.seq_len=15",
                        "train.batch_size=4", "data.packing=stream"), "")
  assert it.element_spec == {"tokens": leaf}
  np.testing.assert_array_equal(it.next()["tokens"], tokens)  # the same windows
  it.close()


def test_model_and_data_must_match(mock40):
  with pytest.raises(ConfigError, match="model.kind=cnn needs images, but TFDS lm1b"):
    make_loader(_cfg("data.source=tfds", "data.name=lm1b", "model.kind=cnn"), "")
  with pytest.raises(ConfigError, match="model.kind=gpt needs text, but TFDS cifar10"):
    make_loader(_cfg("data.source=tfds", "data.name=cifar10"), "")
  with pytest.raises(ConfigError, match="is not a TFDS dataset"):
    make_loader(_cfg("data.source=tfds", "data.name=no_such_dataset"), "")
  with pytest.raises(ConfigError, match="fewer than its batch of 64"):
    make_loader(_cfg(*CIFAR, "train.batch_size=64"), "")
  with pytest.raises(ConfigError, match="model.kind=cnn needs images"):
    make_loader(_cfg("model.kind=cnn"), "")


def test_a_real_array_record_dataset_without_mocks(tmp_path):
  from jaxpar.data import local_text
  src = tmp_path / "src"
  src.mkdir()
  for i in range(60):  # 60 files: local_text makes a validation split too
    (src / f"f{i:02d}.txt").write_text(f"document {i} " * 30)
  builder = local_text.prepare(str(tmp_path / "tfds"), str(src), 0)
  cfg = _cfg("data.source=tfds", f"data.name=local_text/{builder.builder_config.name}",
             f"data.data_dir={tmp_path / 'tfds'}", "model.seq_len=31", "train.batch_size=4")
  docs = local_text.read_texts(builder, "train")
  windows = pack(docs, 31)
  it = make_loader(cfg, "")
  assert it.steps_per_epoch == len(windows) // 4
  rows = {w.tobytes() for w in windows.astype(np.int32)}
  assert all(row.tobytes() in rows for row in it.next()["tokens"])
  assert make_loader(cfg, "", split="validation").steps_per_epoch >= 1
  with pytest.raises(ConfigError, match=r"cannot read split 'nope' \(its splits: train, valid"):
    make_loader(cfg, "", split="nope")
  it.close()


def test_batch_spec_matches_the_loaders(mock40):
  from jaxpar.data import batch_spec
  for cfg in (_cfg(*CIFAR), _cfg("data.source=tfds", "data.name=lm1b", "train.batch_size=4",
                                 "model.seq_len=15")):
    it = make_loader(cfg, "")
    assert batch_spec(cfg) == it.element_spec  # one process: its share is the global batch
    it.close()


def test_text_with_a_tokenizers_file(mock40, tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  source = tfds.data_source("lm1b", split="train")
  docs = [source[i]["text"] for i in range(len(source))]
  docs = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
  tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  eos = tok.token_to_id("</s>")
  stream = sum((tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs), [])
  windows = tfds_source.text_windows(source, "text", 7, tokenizer=Tokenizer.from_file(path))
  assert windows.shape == (len(stream) // 8, 8) and windows.tokens == len(stream)
  np.testing.assert_array_equal(windows[:].reshape(-1), stream[:len(windows) * 8])
  vocab = tok.get_vocab_size()
  cfg = _cfg("data.source=tfds", "data.name=lm1b", "model.seq_len=7", "train.batch_size=2",
             f"data.tokenizer={path}", f"model.vocab_size={max(vocab, 256)}")
  batch = make_loader(cfg, "").next()["tokens"]
  assert batch.shape == (2, 8) and batch.max() < vocab
  with pytest.raises(ConfigError, match="data.tokenizer needs model.vocab_size >= "):
    make_loader(_cfg("data.source=tfds", "data.name=lm1b", f"data.tokenizer={path}",
                     "model.vocab_size=4"), "")
  with pytest.raises(ConfigError, match="does not exist"):
    make_loader(_cfg("data.source=tfds", "data.name=lm1b", "data.tokenizer=/no/such.json"), "")
