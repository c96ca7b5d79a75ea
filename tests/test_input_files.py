"""What a run reads from a user's files is read whole and as it is now, or refused (issue 45): a
Hugging Face folder whose tensors the model would not all read, or not as they are stored; a
safetensors file or index that cannot be read; images that are bombs, FIFOs or not named in
UTF-8; numpy arrays cut short; sizes past the config's bounds. Each is one sentence and exit 2
through the real command, with nothing written. A build edited in place is rebuilt; a wait for
another process's build says whom it waits for and ends; a full disk during a build is one
sentence (exit 1) and leaves nothing of the build."""
import errno
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from test_hf import llama_folder

from jaxpar.commands import dataset as dataset_command
from jaxpar.commands import train as train_command
from jaxpar.config import RunError


def _exit(code):  # stands for os._exit: the commands end that way after a RunError (exit 1)
  raise SystemExit(code)


def _run(capsys, main, *argv):
  """(exit code, stderr) of a command's main(argv) run in this process."""
  capsys.readouterr()
  with pytest.MonkeyPatch.context() as m:
    m.setattr(os, "_exit", _exit)
    try:
      code = main([str(a) for a in argv])
    except SystemExit as e:
      code = e.code
  return code, capsys.readouterr().err


def _train(capsys, workdir, *sets):
  return _run(capsys, train_command.main, "--mesh", "8x1x1", "--workdir", workdir, "--steps", 1,
              "--no-progress", "--set", *sets)


def _refused(code, err, exit_code=2) -> str:
  """The one error line of a refusal, checked to be alone and without a traceback."""
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert code == exit_code and len(errors) == 1 and "Traceback" not in err, err
  return errors[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A 2-layer Llama folder of byte tokens (synthetic data needs 256 ids)."""
  return llama_folder(tmp_path_factory.mktemp("hf") / "llama", 4, 2, 32, vocab=256)


def _safetensors_header(size: int) -> bytes:
  return struct.pack("<Q", size)


def test_a_hugging_face_folder_is_read_whole_and_as_stored_or_refused(llama, tmp_path, capsys):
  """config.json (or --set model.n_layers) of fewer layers than the checkpoint, an int32 q_proj,
  a tensor of the wrong shape (or one layer's unlike the others'), garbled, oversized and
  cut-short safetensors headers, an index naming a missing shard: one sentence naming the file
  (and the tensor), exit 2, no workdir."""
  import json

  from safetensors.numpy import load_file, save_file

  def broken(name, breakage, *sets):
    folder = tmp_path / name
    shutil.copytree(llama, folder)
    weights = folder / "model.safetensors"
    breakage(folder, weights)
    workdir = tmp_path / f"wd-{name}"
    line = _refused(*_train(capsys, workdir, f"model.init_from={folder}", "model.seq_len=16",
                            "data.source=synthetic", *sets))
    assert not workdir.exists()
    return line

  def one_layer(folder, _):
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 1}))
  line = broken("one-layer", one_layer)
  assert "model.safetensors holds tensor model.layers.1." in line and "1 layers" in line, line
  line = broken("set-one-layer", lambda *_: None, "model.n_layers=1")
  assert "model.safetensors holds tensor model.layers.1." in line and "1 layers" in line, line

  def int_q(_, weights):
    t = load_file(str(weights))
    q = "model.layers.0.self_attn.q_proj.weight"
    t[q] = (t[q] * 100).astype(np.int32)
    save_file(t, str(weights), metadata={"format": "pt"})
  line = broken("int-q", int_q)
  assert ("model.safetensors: tensor model.layers.0.self_attn.q_proj.weight is I32, not "
          "floating point") in line, line

  def reshaped(name, shape):
    def breakage(_, weights):
      t = load_file(str(weights))
      t[name] = np.ones(shape, np.float32)
      save_file(t, str(weights), metadata={"format": "pt"})
    return breakage
  line = broken("norm-shape", reshaped("model.norm.weight", (3,)))  # found as the weights load
  assert "tensor model.norm.weight gives norm the shape (3,), but config.json makes (32,)" in line
  line = broken("layer-shape", reshaped("model.layers.1.input_layernorm.weight", (3,)))
  assert ("model.safetensors: tensor model.layers.1.input_layernorm.weight has the shape (3,), "
          "but model.layers.0.input_layernorm.weight has (32,)") in line, line

  whole = (tmp_path / "llama-copy.safetensors")
  shutil.copyfile(os.path.join(llama, "model.safetensors"), whole)
  for name, data, says in (
      ("garbled", _safetensors_header(9) + b"{garbled}", "invalid JSON in header"),
      ("oversized", _safetensors_header(2**40) + b"{}", "header too large"),
      ("cut-short", whole.read_bytes()[:whole.stat().st_size // 2], "incomplete metadata")):
    line = broken(name, lambda _, weights, data=data: weights.write_bytes(data))
    assert "model.safetensors is not a readable safetensors file" in line and says in line, line

  def missing_shard(folder, weights):
    names = sorted(load_file(str(weights)))
    weights.rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  line = broken("missing-shard", missing_shard)
  assert ("model.safetensors.index.json puts tensor model.norm.weight in" in line
          and "model-00002-of-00002.safetensors, which does not exist" in line), line


def test_sizes_past_the_bounds_are_one_sentence_before_anything_is_allocated(tmp_path, capsys):
  """model.moe_d_ff, model.n_experts and the image size (data.image_size, --size) are bounded in
  config.py: refused before the model or a dataset is built."""
  from PIL import Image
  folder = tmp_path / "pets"
  for c in ("cat", "dog"):
    (folder / c).mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(folder / c / "0.png")
  workdir = tmp_path / "wd"
  for sets, says in (
      (["model.n_experts=8", "model.moe_d_ff=100000000000"],
       "model.moe_d_ff=100000000000 is above 1,048,576"),
      (["model.n_experts=100000000"], "model.n_experts=100000000 is above 4,096"),
      (["model.kind=cnn", "data.source=images", f"data.path={folder}",
        "data.image_size=100000x100000"], "data.image_size=100000x100000 is 10,000,000,000 pixels")):
    assert says in _refused(*_train(capsys, workdir, "data.source=synthetic", *sets))
    assert not workdir.exists()
  data = tmp_path / "data"
  line = _refused(*_run(capsys, dataset_command.main, "images", folder, "--data-dir", data,
                        "--name", "pets", "--size", "100000x100000"))
  assert "--size 100000x100000 is 10,000,000,000 pixels an image, more than the 67,108,864" in line
  assert not data.exists()


def _png_header_only(width: int, height: int) -> bytes:
  """A PNG whose header says width x height and which holds no pixels: a bomb's first bytes."""
  def chunk(kind, body):
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
  ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_image_inputs_are_one_sentence_and_leave_nothing(tmp_path, capsys):
  """jaxpar-dataset images: a 20000x20000 PNG, class and file names that are not UTF-8, a FIFO
  named x.png (which hung the build), a zero-size and a truncated .npz, a label of 10**9."""
  from PIL import Image
  data = tmp_path / "data"

  def refused(source):
    line = _refused(*_run(capsys, dataset_command.main, "images", source, "--data-dir", data,
                          "--name", "x"))
    assert not data.exists()
    return line

  def folder(name):
    root = tmp_path / name
    for c in ("cat", "dog"):
      (root / c).mkdir(parents=True)
      for i in range(2):
        Image.fromarray(np.full((4, 4), 60 * i, np.uint8)).save(root / c / f"{i}.png")
    return root

  bomb = folder("bomb")
  (bomb / "cat" / "big.png").write_bytes(_png_header_only(20000, 20000))
  assert ("cat/big.png is 400,000,000 pixels, more than the 67,108,864 (8192x8192) jaxpar "
          "decodes") in refused(bomb)
  (bomb / "cat" / "big.png").write_bytes(_png_header_only(9000, 9000))  # under Pillow's limit
  assert "cat/big.png is 9000x9000, 81,000,000 pixels, more than the 67,108,864" in refused(bomb)
  for name, bad in (("class", os.fsdecode(b"b\xffd/0.png")), ("file", os.fsdecode(b"cat/\xff.png"))):
    root = folder(f"names-{name}")
    (root / bad).parent.mkdir(exist_ok=True)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / bad, format="PNG")
    line = refused(root)  # the name's bytes shown as \xNN
    assert "\\xff" in line and "has a name that is not UTF-8 text" in line, line
  fifo = folder("fifo")
  os.mkfifo(fifo / "cat" / "x.png")
  assert "cat/x.png is a FIFO, not a regular file" in refused(fifo)
  (tmp_path / "empty.npz").write_bytes(b"")
  assert "empty.npz cannot be read as numpy arrays" in refused(tmp_path / "empty.npz")
  np.savez(tmp_path / "cut.npz", images=np.zeros((10, 4, 4), np.uint8), labels=np.arange(10))
  whole = (tmp_path / "cut.npz").read_bytes()
  (tmp_path / "cut.npz").write_bytes(whole[:len(whole) // 2])
  assert "cut.npz cannot be read as numpy arrays (BadZipFile" in refused(tmp_path / "cut.npz")
  np.savez(tmp_path / "labels.npz", images=np.zeros((2, 4, 4), np.uint8),
           labels=np.asarray([0, 10**9]))
  assert "a label is 1000000000: class indices 0..K-1 with K at most 1,000,000" in refused(
      tmp_path / "labels.npz")


def test_a_fifo_in_an_image_folder_is_refused_at_train_time(tmp_path, capsys):
  """data.source=images over a folder holding a FIFO named x.png: one sentence, exit 2, no
  workdir (it hung on opening the FIFO)."""
  from PIL import Image
  root = tmp_path / "pets"
  for c in ("cat", "dog"):
    (root / c).mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / c / "0.png")
  os.mkfifo(root / "cat" / "x.png")
  workdir = tmp_path / "wd"
  line = _refused(*_train(capsys, workdir, "model.kind=cnn", "data.source=images",
                          f"data.path={root}", "train.batch_size=8"))
  assert "cat/x.png is a FIFO, not a regular file" in line, line
  assert not workdir.exists()


def _same_size_edit(path, data: bytes) -> None:
  """Writes `data` (as long as what is there) into `path` and puts its mtime back."""
  st = os.stat(path)
  assert len(data) == st.st_size
  with open(path, "r+b") as f:
    f.write(data)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_edit_in_place_keeping_size_and_mtime_is_rebuilt(tmp_path, capsys):
  """The fingerprint of image and text builds holds each file's ctime and inode: new pixels or
  text of the same size with the old mtime are rebuilt, not trained on as the old ones."""
  from PIL import Image

  from jaxpar.data import local_images, local_text, tfds_source
  images = tmp_path / "pets"
  for c in ("cat", "dog"):
    (images / c).mkdir(parents=True)
    for i in range(2):
      Image.fromarray(np.full((4, 4, 3), 10 + i, np.uint8)).save(images / c / f"{i}.bmp")
  data = str(tmp_path / "data")
  name, built = local_images.prepare(str(images), data, validation=0.0)
  assert built
  edited = images / "cat" / "0.bmp"
  before = edited.read_bytes()
  buf = tmp_path / "new.bmp"
  Image.fromarray(np.full((4, 4, 3), 200, np.uint8)).save(buf)
  _same_size_edit(edited, buf.read_bytes())
  assert edited.read_bytes() != before
  assert local_images.prepare(str(images), data, validation=0.0) == (name, True)
  tfds_source.open_dataset.cache_clear()
  source = tfds_source.data_source(tfds_source.open_dataset(f"local_images/{name}", data), "train")
  stored = [source[i]["image"] for i in range(len(source))]
  assert sum((x == 200).all() for x in stored) == 1, [x.max() for x in stored]

  text = tmp_path / "text"
  text.mkdir()
  (text / "a.txt").write_text("old words " * 20)
  builder = local_text.prepare(data, str(text), 0)
  assert local_text.read_texts(builder) == [b"old words " * 20]
  _same_size_edit(text / "a.txt", b"new words " * 20)
  capsys.readouterr()
  builder = local_text.prepare(data, str(text), 0)
  assert "changed since" in capsys.readouterr().err
  assert local_text.read_texts(builder) == [b"new words " * 20]


def test_text_file_names_in_any_bytes_build(tmp_path):
  """A text file whose name is not UTF-8 is read like any other (its example key is its bytes)."""
  from jaxpar.data import local_text
  text = tmp_path / "text"
  text.mkdir()
  (text / "a.txt").write_text("plain")
  (text / os.fsdecode(b"\xff.txt")).write_text("latin-1 name")
  builder = local_text.prepare(str(tmp_path / "data"), str(text), 0)
  assert sorted(local_text.read_texts(builder)) == [b"latin-1 name", b"plain"]


# Holds a build lock as jaxpar's builder does (its pid and host in the file), then stops itself.
_STOPPED_HOLDER = """
import fcntl, os, signal, socket, sys
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.write(f"{os.getpid()} {socket.gethostname()}\\n")
f.flush()
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_build_lock_held_by_a_stopped_process_is_named_and_given_up(tmp_path, capsys):
  """Another process stopped (SIGSTOP) while it holds the local_text build lock: the run says
  whom it waits for, then gives up at once in one sentence (exit 1) naming the pid; it waited
  silently forever."""
  from jaxpar.data import local_text
  text, data = tmp_path / "text", tmp_path / "data"
  text.mkdir()
  (text / "a.txt").write_text("words " * 100)
  name = local_text.LocalTextConfig(path=str(text), max_bytes=0).name
  (data / "local_text").mkdir(parents=True)
  child = subprocess.Popen([sys.executable, "-c", _STOPPED_HOLDER,
                            str(data / "local_text" / f".{name}.lock")], stdout=subprocess.PIPE)
  try:
    assert child.stdout.readline() == b"held\n"
    stat = f"/proc/{child.pid}/stat"
    deadline = time.monotonic() + 30
    while open(stat).read().rsplit(")", 1)[1].split()[0] != "T":
      assert time.monotonic() < deadline
      time.sleep(0.05)
    workdir = tmp_path / "wd"
    t0 = time.monotonic()
    code, err = _train(capsys, workdir, f"data.path={text}", f"data.data_dir={data}",
                       "data.max_bytes=0", "data.lock_timeout=600")
    line = _refused(code, err, exit_code=1)
    assert time.monotonic() - t0 < 120  # not the 600 s of data.lock_timeout
    assert f"waiting for pid {child.pid} on host {socket.gethostname()}" in err, err
    assert f"pid {child.pid} on this host holds the lock" in line and "is stopped" in line, line
    assert not workdir.exists()
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()


def test_a_wait_for_a_running_build_says_whom_and_gives_up_after_the_timeout(tmp_path, capsys):
  """A lock held by a live builder: the waiting process names its pid and host and gives up
  after lock_timeout seconds in one RunError sentence; once it is let go the build goes on."""
  from jaxpar.data import local_text, stamps
  text, data = tmp_path / "text", str(tmp_path / "data")
  text.mkdir()
  (text / "a.txt").write_text("words " * 100)
  name = local_text.LocalTextConfig(path=str(text), max_bytes=0).name
  held, release = threading.Event(), threading.Event()

  def hold():
    with stamps.locked(os.path.join(data, "local_text"), name, 5):
      held.set()
      release.wait(60)
  holder = threading.Thread(target=hold)
  holder.start()
  try:
    assert held.wait(30)
    capsys.readouterr()
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
      local_text.prepare(data, str(text), 0, lock_timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 10
    by = f"pid {os.getpid()} on host {socket.gethostname()}"
    assert f"jaxpar: waiting for {by}, which is building {name}" in capsys.readouterr().err
    assert str(e.value).startswith(f"gave up after 0.5 s (data.lock_timeout) waiting for {by}")
  finally:
    release.set()
    holder.join()
  assert local_text.read_texts(local_text.prepare(data, str(text), 0, lock_timeout=0.5))


@classmethod
def _write_on_a_full_disk(cls, path, iterator):
  """TFDS's array_record writing on a full disk: part of the file written, then, as array_record
  says it (seen on a 256 KiB tmpfs), a RuntimeError in words."""
  with open(path, "wb") as f:
    for _, record in iterator:
      f.write(record[:len(record) // 2])
  raise RuntimeError(f"write() failed: No space left on device; writing {path}; at byte 258048; "
                     f"Failed to close chunk_writer")


def test_a_full_disk_during_a_build_leaves_nothing_half_written(tmp_path, capsys, monkeypatch):
  """A disk that fills up while local_text or local_images writes: one sentence (exit 1), no
  workdir, data dir or temporary folder left; a rebuild that fills it keeps the earlier build."""
  from PIL import Image
  from tensorflow_datasets.core import file_adapters

  from jaxpar.data import local_text, stamps
  text = tmp_path / "text"
  text.mkdir()
  (text / "a.txt").write_text("words " * 100)
  data = str(tmp_path / "data")
  builder = local_text.prepare(data, str(text), 0)  # an earlier build, kept through a full disk
  (text / "b.txt").write_text("more words " * 100)
  real_write = stamps.write

  def full(folder, stamp):
    real_write(folder, stamp[:3])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(stamps, "write", full)
  with pytest.raises(RunError, match=r"could not build local_text/\w+ under .* \(No space left on "
                                     r"device\): nothing of the build is left"):
    local_text.prepare(data, str(text), 0)
  monkeypatch.undo()

  def no_room(*args, **kwargs):  # a disk full before the build's first byte
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(local_text.tempfile, "mkdtemp", no_room)
  with pytest.raises(RunError, match=r"\(No space left on device\): nothing of the build"):
    local_text.prepare(data, str(text), 0)
  monkeypatch.undo()
  assert sorted(os.listdir(os.path.join(data, "local_text"))) == sorted(
      [builder.builder_config.name, f".{builder.builder_config.name}.lock"])
  assert [n for n in os.listdir(data) if n != "local_text"] == []  # no temporary folder
  assert local_text.read_texts(builder) == [b"words " * 100]

  monkeypatch.setattr(file_adapters.ArrayRecordFileAdapter, "write_examples",
                      _write_on_a_full_disk)
  workdir = tmp_path / "wd"
  line = _refused(*_train(capsys, workdir, f"data.path={text}", "data.max_bytes=0"), exit_code=1)
  assert "could not build local_text/" in line and "(No space left on device)" in line, line
  assert not workdir.exists()
  images = tmp_path / "pets"
  for c in ("cat", "dog"):
    (images / c).mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(images / c / "0.png")
  out = tmp_path / "images"
  line = _refused(*_run(capsys, dataset_command.main, "images", images, "--data-dir", out,
                        "--name", "pets"), exit_code=1)
  assert "could not build local_images/pets" in line and "No space left on device" in line, line
  assert not out.exists()
