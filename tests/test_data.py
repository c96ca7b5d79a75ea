"""jaxpar.data: the local_text TFDS builder, packing and the resumable batch iterator (no JAX)."""
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import DataConfig
from jaxpar.data import (BatchIterator, TokenWindows, inputs_targets, local_text, make_batches,
                         pack, windows)

DOCS = {
    "a.txt": "alpha line\n",
    "sub/b.md": "# beta\nwith unicode: é ✓\n",
    "sub/deeper/c.py": "print('gamma')\n" * 40,
    "z.txt": "zeta " * 300,
}


def _write_folder(root, docs):
  for rel, text in docs.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.fixture
def text_dir(tmp_path):
  root = tmp_path / "src"
  _write_folder(root, DOCS)
  (root / "blob.bin").write_bytes(b"\x7fELF\x00\x01binary")  # NUL: binary, skipped
  (root / "latin1.txt").write_bytes(b"caf\xe9\n")  # not UTF-8, skipped
  (root / "empty.txt").write_bytes(b"")
  (root / ".hidden").write_text("secret")
  return root


def _ids(n, seq_len=7):
  """Windows whose first column is the row index, so batches can be traced back to rows."""
  w = np.zeros((n, seq_len + 1), np.int32)
  w[:, 0] = np.arange(n)
  return w


def _take(it, n):
  return [it.next() for _ in range(n)]


def test_local_text_round_trip(text_dir, tmp_path):
  builder = local_text.prepare(str(tmp_path / "data"), str(text_dir), max_bytes=0)
  texts = local_text.read_texts(builder, "train")
  assert sorted(texts) == sorted(t.encode() for t in DOCS.values())
  assert builder.data_path.is_relative_to(tmp_path / "data" / "local_text")
  assert any(f.name.endswith(".array_record-00000-of-00001") for f in builder.data_path.iterdir())
  with pytest.raises(ValueError, match="no split 'validation'"):
    local_text.read_texts(builder, "validation")  # under 50 files: train only


def test_local_text_cap_and_validation_split(tmp_path):
  root = tmp_path / "many"
  _write_folder(root, {f"f{i:03d}.txt": f"{i:03d}é" * 10 for i in range(120)})  # 50 bytes each
  builder = local_text.prepare(str(tmp_path / "data"), str(root), max_bytes=60 * 50 + 4)
  train, val = local_text.read_texts(builder, "train"), local_text.read_texts(builder, "validation")
  assert len(train) + len(val) == 61 and len(val) == 1
  assert val == [("049é" * 10).encode()]
  # The 61st file is cut at the cap, less the half of 'é' that does not fit.
  assert b"060" in train
  assert sum(map(len, train + val)) == 60 * 50 + 3


def test_a_build_reports_itself_in_one_line_and_tfds_stays_quiet(text_dir, tmp_path, capfd,
                                                                  caplog):
  # TFDS would print "Downloading and preparing dataset Unknown size ..." (nothing is
  # downloaded) and warn through absl about our builder config and the folder not yet built.
  with caplog.at_level(logging.INFO):
    local_text.prepare(str(tmp_path / "data"), str(text_dir), max_bytes=0)
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar: built the local_text dataset (")
    assert f"{len(DOCS)} train files)" in err and "later runs reuse it" in err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    local_text.prepare(str(tmp_path / "data"), str(text_dir), max_bytes=0)  # built: silent
    assert capfd.readouterr() == ("", "")
  assert logging.getLogger("absl").level < logging.ERROR  # the level is given back


def test_a_changed_folder_is_rebuilt_and_a_gone_one_keeps_its_build(text_dir, tmp_path, capfd):
  data = str(tmp_path / "data")
  first = local_text.read_texts(local_text.prepare(data, str(text_dir), max_bytes=0))
  capfd.readouterr()
  # rewritten at the same size (another content, a later mtime): rebuilt
  a = text_dir / "a.txt"
  was = a.stat()
  a.write_text("ALPHA LINE\n", encoding="utf-8")
  os.utime(a, ns=(was.st_atime_ns, was.st_mtime_ns + 5_000_000_000))
  assert a.stat().st_size == was.st_size
  same_size = local_text.read_texts(local_text.prepare(data, str(text_dir), max_bytes=0))
  assert "rebuilding it" in capfd.readouterr().err
  assert b"ALPHA LINE\n" in same_size and b"alpha line\n" not in same_size
  (text_dir / "a.txt").write_text("alpha, edited\n", encoding="utf-8")
  (text_dir / "new.txt").write_text("a new file\n", encoding="utf-8")
  texts = local_text.read_texts(local_text.prepare(data, str(text_dir), max_bytes=0))
  err = capfd.readouterr().err
  assert "changed since local_text/" in err and "rebuilding it" in err, err
  assert b"alpha, edited\n" in texts and b"a new file\n" in texts and len(texts) == len(first) + 1
  assert b"alpha line\n" in first and b"alpha line\n" not in texts
  # The build was renamed into place: nothing else beside it but its lock.
  assert sorted(os.listdir(tmp_path / "data")) == ["local_text"]
  assert len(os.listdir(tmp_path / "data" / "local_text")) == 2
  shutil.rmtree(text_dir)  # the folder is gone: its last build is read, silently
  assert local_text.read_texts(local_text.prepare(data, str(text_dir), max_bytes=0)) == texts
  assert capfd.readouterr() == ("", "")


def test_processes_sharing_a_data_dir_build_once(text_dir, tmp_path):
  code = ("import sys; from jaxpar.data import local_text; "
          "print(len(local_text.read_texts(local_text.prepare(sys.argv[1], sys.argv[2], 0))))")
  runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "data"), str(text_dir)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for _ in range(2)]
  outs = [r.communicate(timeout=120) for r in runs]
  assert [r.returncode for r in runs] == [0, 0], outs
  assert [out for out, _ in outs] == [f"{len(DOCS)}\n"] * 2
  assert sum(err.count("jaxpar: built the local_text dataset") for _, err in outs) == 1, outs


def test_config_name_depends_on_folder_and_cap(tmp_path):
  names = {local_text.LocalTextConfig(path=str(p), max_bytes=m).name
           for p in (tmp_path / "a", tmp_path / "b") for m in (0, 100)}
  assert len(names) == 4
  assert local_text.LocalTextConfig(path="", max_bytes=5).name.startswith("stdlib_")
  assert (local_text.LocalTextConfig(path=str(tmp_path), max_bytes=5).name
          == local_text.LocalTextConfig(path=str(tmp_path) + "/", max_bytes=5).name)


def test_second_make_batches_reuses_the_build(text_dir, tmp_path, monkeypatch):
  calls = []
  generate = local_text.LocalText._generate_examples
  monkeypatch.setattr(local_text.LocalText, "_generate_examples",
                      lambda self, files: calls.append(files) or generate(self, files))
  cfg = DataConfig(source="local_text", path=str(text_dir), max_bytes=0)
  first = make_batches(cfg, seq_len=15, global_batch=4, seed=0, workdir=str(tmp_path))
  assert len(calls) == 1
  second = make_batches(cfg, seq_len=15, global_batch=4, seed=0, workdir=str(tmp_path))
  assert len(calls) == 1
  assert os.path.isdir(tmp_path / "data" / "local_text")  # data_dir "" = <workdir>/data
  np.testing.assert_array_equal(_take(first, 5), _take(second, 5))


def test_pack_shapes_and_shift():
  w = pack([b"abc", "dé"], seq_len=3)  # stream: a b c \0 d \xc3 \xa9 \0 (8 bytes -> 2 windows)
  assert w.shape == (2, 4) and w.dtype == np.uint8
  assert bytes(w.reshape(-1)) == b"abc\0d\xc3\xa9\0"
  inputs, targets = inputs_targets(w)
  assert inputs.shape == targets.shape == (2, 3)
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  assert pack([b"abcdefghij"], seq_len=4).shape == (2, 5)  # the short tail is dropped


def test_token_windows_read_lazily_are_the_packed_windows():
  rng = np.random.default_rng(0)
  docs = [b"", b"a", "é✓".encode(), bytes(rng.integers(1, 256, 300).astype(np.uint8)), b"",
          b"xyz" * 7, bytes(rng.integers(1, 256, 41).astype(np.uint8))]
  source = [{"text": d} for d in docs]  # any random-access sequence of records
  reads = []
  for seq_len in (1, 2, 6, 40, 400):  # windows inside one document and across several
    packed = pack(docs, seq_len)
    w = TokenWindows(source, "text", seq_len, eos=0)
    assert w.shape == packed.shape and len(w) == len(packed) and w.dtype == np.uint8
    assert w.tokens == sum(len(d) + 1 for d in docs)
    np.testing.assert_array_equal(w[:], packed)
    if len(packed):
      rows = rng.integers(-len(packed), len(packed), 9)
      np.testing.assert_array_equal(w[rows], packed[rows])
      np.testing.assert_array_equal(w[len(packed) - 1], packed[-1])
      np.testing.assert_array_equal(w[1::2], packed[1::2])
    reads.append(w)
  assert reads[-1].shape == (0, 401)  # 375 tokens: not one window
  with pytest.raises(IndexError, match="out of range for 125 windows"):
    reads[1][[125]]
  source[3] = {"text": b"shorter"}  # the split changed after counting: a clear error, not garbage
  with pytest.raises(RuntimeError, match="document 3 now has 8 tokens, not the 301 counted"):
    reads[1][:]
  order = windows.shuffled(1000, np.random.default_rng([3, 1]))
  assert order.dtype == np.int32
  np.testing.assert_array_equal(order, np.random.default_rng([3, 1]).permutation(1000))


def test_batches_are_windows_of_the_document_stream(text_dir, tmp_path):
  it = make_batches(DataConfig(source="local_text", path=str(text_dir), max_bytes=0), seq_len=15,
                    global_batch=4, seed=3, workdir=str(tmp_path), prefetch=0)
  batch = it.next()
  assert batch.shape == (4, 16) and batch.dtype == np.int32
  stream = b"".join(t + b"\0" for t in local_text.read_texts(
      local_text.prepare(str(tmp_path / "data"), str(text_dir), 0)))
  windows = [stream[k:k + 16] for k in range(0, len(stream) - 15, 16)]
  inputs, targets = inputs_targets(batch)
  for row, x, y in zip(batch, inputs, targets):  # each row is one aligned window of the stream
    w = bytes(row.astype(np.uint8))
    assert w in windows
    assert bytes(x.astype(np.uint8)) == w[:-1] and bytes(y.astype(np.uint8)) == w[1:]


def test_synthetic_same_seed_same_batches():
  cfg = DataConfig(source="synthetic")
  a = make_batches(cfg, seq_len=16, global_batch=8, seed=1, workdir="")
  b = make_batches(cfg, seq_len=16, global_batch=8, seed=1, workdir="")
  c = make_batches(cfg, seq_len=16, global_batch=8, seed=2, workdir="")
  batches = _take(a, 3)
  assert batches[0].shape == (8, 17) and batches[0].dtype == np.int32
  assert batches[0].min() >= 0 and batches[0].max() < 256
  np.testing.assert_array_equal(batches, _take(b, 3))
  assert not np.array_equal(batches, _take(c, 3))


def test_epochs_reshuffle_and_drop_the_remainder():
  it = BatchIterator(_ids(30), global_batch=8, seed=0, prefetch=0)
  assert it.steps_per_epoch == 3
  epoch0 = np.concatenate(_take(it, 3))[:, 0]
  assert it.state() == {"epoch": 1, "position": 0}
  epoch1 = np.concatenate(_take(it, 3))[:, 0]
  assert len(set(epoch0)) == len(set(epoch1)) == 24  # no window twice within an epoch
  assert not np.array_equal(epoch0, epoch1)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_restore_continues_the_exact_sequence(prefetch):
  it = BatchIterator(_ids(40), global_batch=8, seed=5, prefetch=prefetch)  # 5 batches per epoch
  _take(it, 3)
  state = it.state()
  assert state == {"epoch": 0, "position": 3}  # handed out, not prefetched
  assert all(type(v) is int for v in state.values())
  expected = _take(it, 9)  # crosses two epoch boundaries
  resumed = BatchIterator(_ids(40), global_batch=8, seed=5, prefetch=prefetch)
  resumed.restore(state)
  np.testing.assert_array_equal(_take(resumed, 9), expected)
  it.restore(state)  # rewinding the same iterator works too
  np.testing.assert_array_equal(_take(it, 9), expected)
  it.close()
  resumed.close()


def test_processes_read_disjoint_shares_of_each_global_batch():
  whole = BatchIterator(_ids(50), global_batch=8, seed=9, prefetch=0)
  parts = [BatchIterator(_ids(50), global_batch=8, seed=9, process_index=i, process_count=2)
           for i in range(2)]
  seen = []
  for _ in range(whole.steps_per_epoch):
    p0, p1 = (p.next()[:, 0] for p in parts)
    assert p0.shape == p1.shape == (4,)
    assert not set(p0) & set(p1)
    np.testing.assert_array_equal(np.concatenate([p0, p1]), whole.next()[:, 0])
    seen += list(p0) + list(p1)
  assert len(set(seen)) == whole.steps_per_epoch * 8


def test_errors_are_clear(text_dir, tmp_path):
  with pytest.raises(ValueError, match="not supported yet"):
    make_batches(DataConfig(source="tfds", name="lm1b"), 16, 8, 0, str(tmp_path))
  with pytest.raises(ValueError, match="fewer than one global batch of 4096"):
    make_batches(DataConfig(source="local_text", path=str(text_dir), max_bytes=0), 15, 4096, 0,
                 str(tmp_path))
  with pytest.raises(ValueError, match="multiple of process_count"):
    BatchIterator(_ids(50), global_batch=7, seed=0, process_count=2)


def test_default_folder_is_the_stdlib(tmp_path):
  cfg = DataConfig(source="local_text", data_dir=str(tmp_path / "tfds"), max_bytes=200_000)
  it = make_batches(cfg, seq_len=127, global_batch=8, seed=0, workdir="unused")
  assert it.next().shape == (8, 128)
  builder = local_text.prepare(cfg.data_dir, "", 200_000)
  texts = local_text.read_texts(builder, "train")  # 200 kB is under 50 files: no validation
  total = sum(map(len, texts))
  assert 200_000 - 4 <= total <= 200_000  # cut at the cap, within one UTF-8 character
  root = local_text.default_path()
  files = local_text.scan(root, only_py=True, max_bytes=200_000)
  assert len(texts) == len(files) > 1
  assert all(rel.endswith(".py") for rel, _ in files)
  first = open(os.path.join(root, files[0][0]), "rb").read()
  assert first in texts
  assert it.steps_per_epoch == sum(len(t) + 1 for t in local_text.read_texts(builder)) // 128 // 8


def test_loader_settings_are_used_or_refused(tmp_path):
  import threading

  from jaxpar import config
  from jaxpar.config import ConfigError
  from jaxpar.data import make_loader
  base = ["data.source=synthetic", "model.seq_len=16", "train.batch_size=4"]
  with pytest.raises(ConfigError, match="data.tokenizer applies to text files"):
    make_loader(config.load(None, base + ["data.tokenizer=/no/such.json"]), str(tmp_path))

  def prefetching(workers):
    before = {t.ident for t in threading.enumerate() if t.name == "jaxpar-prefetch"}
    it = make_loader(config.load(None, base + [f"data.workers={workers}"]), str(tmp_path))
    first = it.next()
    started = {t.ident for t in threading.enumerate() if t.name == "jaxpar-prefetch"} - before
    it.close()
    return first, bool(started)
  (a, threaded), (b, inline) = prefetching(2), prefetching(0)
  assert threaded and not inline  # data.workers=0: read in the loop, no thread
  np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_synthetic_data_serves_any_batch_and_a_file_is_not_a_data_folder(tmp_path):
  from jaxpar import config
  from jaxpar.config import ConfigError
  from jaxpar.data import make_loader
  big = make_loader(config.load(None, ["data.source=synthetic", "model.seq_len=4",
                                       "train.batch_size=8192"]), str(tmp_path))
  assert big.next()["tokens"].shape == (8192, 5)  # more than the 4096 windows a small batch gets
  big.close()
  a_file = tmp_path / "a.txt"
  a_file.write_text("text")
  with pytest.raises(ConfigError, match=f"local_text folder {a_file} is a file; data.path names "
                                        f"a folder of text files"):
    make_loader(config.load(None, [f"data.path={a_file}"]), str(tmp_path / "wd"))


def test_local_text_with_a_tokenizers_file(text_dir, tmp_path):
  """data.tokenizer on a folder of text files: every document's ids, then its end-of-text id,
  packed into the windows the batches take (as a Hugging Face model's own tokenizer would); the
  tokenizer's own special tokens (a BOS before each text, here) are not added."""
  from collections import Counter

  from tokenizers import Tokenizer
  from tokenizers import models as tok_models
  from tokenizers import pre_tokenizers, processors, trainers

  from jaxpar import config
  from jaxpar.config import ConfigError
  from jaxpar.data import make_loader
  tok = Tokenizer(tok_models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(DOCS.values(),
                          trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>", "<s>"]))
  bos = tok.token_to_id("<s>")
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
  assert tok.encode("alpha").ids[0] == bos
  folder = tmp_path / "hf"
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  base = ["data.source=local_text", f"data.path={text_dir}", "data.max_bytes=0",
          f"data.data_dir={tmp_path / 'tfds'}", "model.seq_len=7", "train.batch_size=2",
          "data.workers=0"]
  it = make_loader(config.load(None, base + [f"data.tokenizer={folder}"]), str(tmp_path))
  texts = local_text.read_texts(local_text.prepare(str(tmp_path / "tfds"), str(text_dir), 0))
  eos = tok.token_to_id("</s>")
  stream = sum((tok.encode(t.decode(), add_special_tokens=False).ids + [eos] for t in texts), [])
  rows = [tuple(stream[i:i + 8]) for i in range(0, len(stream) - 7, 8)]
  assert it.steps_per_epoch == len(stream) // 8 // 2 > 0
  seen = [tuple(row) for _ in range(it.steps_per_epoch) for row in it.next()["tokens"]]
  # every window at most once in an epoch (the remainder past the last whole batch dropped)
  assert len(rows) - len(seen) < 2 and not Counter(seen) - Counter(rows)
  assert bos not in {t for row in seen for t in row}
  it.close()
  with pytest.raises(ConfigError, match="data.tokenizer needs model.vocab_size >= "):
    make_loader(config.load(None, base + [f"data.tokenizer={folder}", "model.vocab_size=4"]),
                str(tmp_path))
  with pytest.raises(ConfigError, match="does not exist"):
    make_loader(config.load(None, base + ["data.tokenizer=/no/such.json"]), str(tmp_path))


def test_local_text_batches_carry_each_tokens_document(text_dir, tmp_path):
  """data.packing=documents (the default): beside the stream's windows, segment_ids that start at
  1 in each window and go up by one after each document's end token, so a document a window's
  end cuts is its next window's segment 1; stream: the same windows alone. batch_spec agrees."""
  from jaxpar import config
  from jaxpar.data import batch_spec, make_loader
  from jaxpar.data.tokens import SEPARATOR
  base = ["data.source=local_text", f"data.path={text_dir}", "data.max_bytes=0",
          "model.seq_len=15", "train.batch_size=4", "data.workers=0"]
  cfg = config.load(None, base)
  it = make_loader(cfg, str(tmp_path))
  leaf = ((4, 16), np.dtype(np.int32))
  assert it.element_spec == batch_spec(cfg) == {"tokens": leaf, "segment_ids": leaf}
  batches = _take(it, it.steps_per_epoch)
  tokens = np.concatenate([b["tokens"] for b in batches])
  seg = np.concatenate([b["segment_ids"] for b in batches])
  assert seg.dtype == np.int32 and (seg[:, 0] == 1).all()
  np.testing.assert_array_equal(np.diff(seg, axis=1), tokens[:, :-1] == SEPARATOR)
  assert (seg[:, -1] > 1).any() and (seg[:, -1] == 1).any()  # windows with several and one
  stream = config.load(None, base + ["data.packing=stream"])
  it = make_loader(stream, str(tmp_path))
  assert it.element_spec == batch_spec(stream) == {"tokens": leaf}
  np.testing.assert_array_equal(it.next()["tokens"], batches[0]["tokens"])
