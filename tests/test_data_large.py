"""A 200 MB text split trains with host memory bounded by the batch, not the split, and resumes."""
import ctypes
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import child_env

from jaxpar import config as jconfig
from jaxpar import data as jdata

SPLIT_BYTES = 200_000_000
# Both memory figures come from one fresh process (`measure` below), not from the test worker:
# after a file of other tests under load, a worker's allocator added 60-110 MB of its own to the
# same figures (a reader's 34 MB became 144 MB, a run's 60 MB became 150 MB in CI runs).
# In a fresh process streaming needs 25-45 MB for two readers (their counting passes, record
# files and three batches) and adds 5-40 MB to a training run above the same run on a small split
# (the same program, loaded from the compilation cache). A reader holding the split as bytes adds
# its 200 MB (measured: 400 MB for the two readers, 170-190 MB to the training run); 100 MB is half
# that and fails both.
MAX_GROWTH_MB = 100
SMALL_BYTES = 400_000  # the baseline run's split (a few files, 3000-odd windows)
TWO_READERS_MAX_MB = 100
# A tiny model at the default seq_len (128) and global batch (16).
RUN = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64"]


def _write_texts(root: str, total: int) -> None:
  """Files of random words, 1 byte to 200 kB each, `total` bytes in all, written in seconds."""
  rng = np.random.default_rng(0)
  words = [bytes(rng.integers(97, 123, rng.integers(2, 9)).astype(np.uint8)) for _ in range(4096)]
  pool = b" ".join(words[i] for i in rng.integers(0, len(words), 1_000_000))  # about 6 MB
  os.makedirs(root)
  i = done = 0
  while done < total:  # each file a random slice of the pool, so windows differ
    n = int(rng.integers(1, 200_000))
    start = int(rng.integers(0, len(pool) - n))
    data = b"doc %d\n" % i + pool[start:start + n]
    with open(os.path.join(root, f"f{i:05d}.txt"), "wb") as f:
      f.write(data)
    done, i = done + len(data), i + 1


def _build(src: str, data_dir: str) -> None:
  """The large split, then a small one (SMALL_BYTES) beside it: `<large name> <small name>`."""
  from jaxpar.data import local_text
  names = []
  for folder, total in ((src, SPLIT_BYTES), (src + "-small", SMALL_BYTES)):
    _write_texts(folder, total)
    names.append(local_text.prepare(data_dir, folder, 0).builder_config.name)
  print(*names)


@pytest.fixture(scope="module")
def large_split(tmp_path_factory):
  """The 200 MB split, built in another process, and the memory figures of a fresh process.

  Another process builds, so that the build's memory neither counts nor sits freed in a heap
  where a loader could reuse it unseen. A third (`_measure`) takes every memory figure from a
  fresh start: what its readers and runs add to RSS, against a run on the small split.
  """
  tmp = tmp_path_factory.mktemp("large")
  src, data_dir = str(tmp / "src"), str(tmp / "tfds")
  build = subprocess.run([sys.executable, __file__, "build", src, data_dir], capture_output=True,
                         text=True, env=child_env(), timeout=300)
  assert build.returncode == 0, build.stderr
  shutil.rmtree(src)  # the array_record copy is all the loaders read; src names it
  shutil.rmtree(src + "-small")
  large, small = build.stdout.split()[-2:]
  split = {"name": f"local_text/{large}", "small": f"local_text/{small}", "data_dir": data_dir,
           "src": src, "workdir": str(tmp / "wd"), "batches": str(tmp / "batches.npz")}
  measure = subprocess.run([sys.executable, __file__, "measure", json.dumps(split)],
                           capture_output=True, text=True, env=child_env(), timeout=600)
  assert measure.returncode == 0, measure.stderr
  split.update(json.loads(measure.stdout.splitlines()[-1]))
  return split


def _measure(split: dict) -> dict:
  """The memory figures, in this fresh process; the batches they saw go to split["batches"]."""
  from jaxpar.data import local_text, tfds_source  # noqa: F401  (no part of what a reader holds)
  from jaxpar.train import loop
  figures, saved = {}, {}

  # Two readers of the split (two processes' halves), three batches each.
  cfg = jconfig.DataConfig(source="local_text", path=split["src"], data_dir=split["data_dir"],
                           max_bytes=0)
  before = _peak_from_here()
  parts = [jdata.make_batches(cfg, 128, 16, 0, split["workdir"] + "-readers", i, 2)
           for i in range(2)]
  saved["readers"] = [np.concatenate([p.next() for p in parts]) for _ in range(3)]
  figures["readers_growth"] = _status_mb("VmHWM") - before
  for p in parts:
    p.close()

  # Growth against growth: a second run on the small split and the large run both start from the
  # memory in use and load their (same) program from the compilation cache. The baseline is text
  # of the same source and packing, not synthetic data: under data.packing=documents (the
  # default) text batches carry segment_ids, a program synthetic data (tokens only) never
  # compiles, and compiling it added 180-200 MB to the large run (the split added 10-40 MB).
  quiet = lambda *args: None  # noqa: E731
  small = jconfig.load(None, ["data.source=tfds", f"data.name={split['small']}",
                              f"data.data_dir={split['data_dir']}", *RUN])
  loop.run(small, (8, 1, 1), split["workdir"] + "-warm", steps=3, progress=False, log=quiet)
  start = _peak_from_here()
  loop.run(small, (8, 1, 1), split["workdir"] + "-again", steps=3, progress=False, log=quiet)
  figures["small_growth"] = _status_mb("VmHWM") - start
  cfg = jconfig.load(None, ["data.source=tfds", f"data.name={split['name']}",
                            f"data.data_dir={split['data_dir']}", *RUN])
  recorder = _Recorder(jdata.make_loader)
  jdata.make_loader = recorder
  start = _peak_from_here()
  t0 = time.perf_counter()
  figures["steps"] = loop.run(cfg, (8, 1, 1), split["workdir"], steps=3, progress=False,
                              log=quiet).steps
  figures["seconds"] = time.perf_counter() - t0
  figures["train_growth"] = _status_mb("VmHWM") - start
  saved["trained"] = np.stack(recorder.batches)
  np.savez(split["batches"], **saved)
  return figures


def _peak_from_here() -> float:
  """The RSS in MB, with freed memory handed back first and the peak (VmHWM) started again there.

  glibc keeps freed memory in the heap, where a later allocation reuses it unseen; handed back,
  every byte allocated from here on counts in the peak.
  """
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts again from the current RSS
  return _status_mb("VmRSS")


def _status_mb(key: str) -> float:
  with open("/proc/self/status") as f:
    return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


class _Recorder:
  """make_loader, keeping a copy of every batch its loaders hand out."""

  def __init__(self, make_loader):
    self.make_loader, self.batches = make_loader, []

  def __call__(self, *args, **kwargs):
    loader = self.make_loader(*args, **kwargs)
    next_batch = loader.next

    def recorded():
      batch = next_batch()
      self.batches.append(batch["tokens"].copy())
      return batch
    loader.next = recorded
    return loader


def test_local_text_source_reads_the_large_split_lazily(large_split, tmp_path):
  growth = large_split["readers_growth"]
  print(f"local_text, 2 processes, 3 batches: peak RSS growth {growth:.0f} MB")
  assert growth < TWO_READERS_MAX_MB
  cfg = jconfig.DataConfig(source="local_text", path=large_split["src"],
                           data_dir=large_split["data_dir"], max_bytes=0)
  whole = jdata.make_batches(cfg, 128, 16, 0, str(tmp_path), prefetch=0)
  np.testing.assert_array_equal(np.load(large_split["batches"])["readers"],
                                [whole.next() for _ in range(3)])
  second = jdata.make_batches(cfg, 128, 16, 0, str(tmp_path), 1, 2)
  for _ in range(3):
    second.next()
  resumed = jdata.make_batches(cfg, 128, 16, 0, str(tmp_path), 1, 2)
  resumed.restore(second.state())
  np.testing.assert_array_equal(resumed.next(), second.next())
  for it in (whole, second, resumed):
    it.close()


def test_large_split_trains_in_bounded_memory_and_resumes(large_split):
  from jaxpar.train import checkpoint as jckpt
  cfg = jconfig.load(None, ["data.source=tfds", f"data.name={large_split['name']}",
                            f"data.data_dir={large_split['data_dir']}", *RUN])
  small = large_split["small_growth"]
  growth = large_split["train_growth"] - small
  print(f"3 steps on a {SPLIT_BYTES / 1e6:.0f} MB split: {large_split['seconds']:.1f} s, peak RSS "
        f"growth {growth:.0f} MB above the same run's on a {SMALL_BYTES // 1000} kB split "
        f"({small:.0f} MB)")
  assert large_split["steps"] == 3
  assert growth < MAX_GROWTH_MB
  trained = np.load(large_split["batches"])["trained"]
  assert trained.shape == (3, 16, 129)  # default seq_len 128
  workdir = large_split["workdir"]

  # The loader state saved with the step-3 checkpoint continues the uninterrupted sequence.
  state = jckpt.read_extra(os.path.join(workdir, "checkpoints"), 3)["data"]
  assert state == {"epoch": 0, "position": 3}
  resumed, straight = (jdata.make_loader(cfg, "") for _ in range(2))
  resumed.restore(state)
  expected = [straight.next()["tokens"] for _ in range(5)]
  np.testing.assert_array_equal(trained, expected[:3])
  np.testing.assert_array_equal([resumed.next()["tokens"] for _ in range(2)], expected[3:])
  assert len({row.tobytes() for batch in expected for row in batch}) == 5 * 16  # no row repeated
  resumed.close()
  straight.close()

if __name__ == "__main__":
  if sys.argv[1] == "build":
    _build(*sys.argv[2:])
  else:
    print(json.dumps(_measure(json.loads(sys.argv[2]))))
