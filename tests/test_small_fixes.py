"""Benchmark output paths, the launcher's rank prefixes and the exported file's mode."""
import importlib.util
import os
import pathlib
import stat
import subprocess

import numpy as np
import pytest

from jaxpar.interop import export

ROOT = pathlib.Path(__file__).resolve().parents[1]
# benchmarks/_*.py are the benchmarks' shared helpers, not benchmarks
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def load(path):
  spec = importlib.util.spec_from_file_location(f"_under_test_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_default_output_is_git_ignored(path):
  out = load(path).parser().get_default("out")
  assert out, f"{path.name} has no --out flag"
  rel = os.path.relpath(os.path.abspath(out), ROOT)
  assert not rel.startswith(".."), f"{path.name} writes outside the repository: {out}"
  # check-ignore answers 1 for a tracked file too, so a committed result fails here.
  r = subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT)
  assert r.returncode == 0, f"{path.name} writes {rel} by default, which git does not ignore"


GPU_ONLY = {"gpu_mfu", "gpu_check"}  # need a GPU: no reference figures until one has run them


def test_benchmark_reference_results_are_committed():
  r = subprocess.run(["git", "ls-files", "benchmarks/reference"], cwd=ROOT, capture_output=True,
                     text=True, check=True)
  tracked = subprocess.run(["git", "ls-files", "benchmarks/*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
  want = {pathlib.Path(p).stem for p in tracked if not pathlib.Path(p).name.startswith("_")} - GPU_ONLY
  assert {pathlib.Path(p).stem for p in r.stdout.split()} >= want


@pytest.fixture(scope="module")
def launch_local():
  return load(ROOT / "scripts" / "launch_local.py")


def feed_all(prefixer, chunks):
  return b"".join(prefixer.feed(c) for c in chunks) + prefixer.close()


def test_prefixer_prefixes_lines(launch_local):
  p = launch_local.Prefixer(b"[1] ")
  assert feed_all(p, [b"one\ntw", b"o\n\nthree"]) == b"[1] one\n[1] two\n[1] \n[1] three\n"


def test_prefixer_prefixes_every_progress_bar_redraw(launch_local):
  # What tqdm writes: '\r' + the bar for every update, one '\n' at close.
  chunks = [b"\r  0%|          | 0/10", b"\r 50%|#####     | 5/10", b"\r100%|##########| 10/10",
            b"\n", b"done\n"]
  p = launch_local.Prefixer(b"[0] ")
  out = [p.feed(c) for c in chunks]
  # Each redraw is passed on as it comes, prefixed, not held back until the bar's '\n'.
  assert out[:3] == [b"\r[0]   0%|          | 0/10", b"\r[0]  50%|#####     | 5/10",
                     b"\r[0] 100%|##########| 10/10"]
  assert b"".join(out) + p.close() == (b"\r[0]   0%|          | 0/10\r[0]  50%|#####     | 5/10"
                                       b"\r[0] 100%|##########| 10/10\n[0] done\n")


def test_prefixer_redraw_split_over_reads(launch_local):
  p = launch_local.Prefixer(b"[0] ")
  assert feed_all(p, [b"\r 10%|#", b"  | 1/10\r", b" 20%|##", b" | 2/10"]) == \
      b"\r[0]  10%|#  | 1/10\r[0]  20%|## | 2/10\n"


def test_prefixer_holds_unfinished_lines(launch_local):
  p = launch_local.Prefixer(b"[0] ")
  assert p.feed(b"half a li") == b""  # another process's line may come before the rest
  assert p.feed(b"ne\n") == b"[0] half a line\n"
  assert p.close() == b""


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_safetensors_written_with_umask_mode(tmp_path, umask):
  from safetensors.numpy import load_file
  out = tmp_path / "model.safetensors"
  old = os.umask(umask)
  try:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    export.write_safetensors({"w": (w.shape, w.dtype)}, lambda name: w, str(out),
                             {"format": "jaxpar"})
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask
  np.testing.assert_array_equal(load_file(str(out))["w"], np.arange(6).reshape(2, 3))
  assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left behind


def test_safetensors_write_failure_keeps_the_old_file(tmp_path):
  out = tmp_path / "model.safetensors"
  out.write_bytes(b"old")
  with pytest.raises(Exception):
    def fail(name):
      raise OSError("the checkpoint became unreadable")
    export.write_safetensors({"w": ((2,), np.float32)}, fail, str(out), {})
  assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.safetensors"]


def test_safetensors_stream_loads_with_the_safetensors_library(tmp_path):
  """Written tensor by tensor with its own header; safetensors reads every dtype and shape back."""
  import ml_dtypes
  from safetensors.numpy import load_file
  rng = np.random.default_rng(0)
  tensors = {"b/bias": rng.normal(size=(3,)).astype(np.float32),
             "a/kernel": rng.normal(size=(4, 5, 2)).astype(ml_dtypes.bfloat16),
             "c/count": np.arange(7, dtype=np.int32), "d/scalar": np.array(1.5, np.float16),
             "e/half": rng.normal(size=(3, 1)).astype(np.float16)}
  out = tmp_path / "m.safetensors"
  export.write_safetensors({k: (v.shape, v.dtype) for k, v in tensors.items()}, tensors.__getitem__,
                           str(out), {"format": "jaxpar"})
  back = load_file(str(out))
  assert set(back) == set(tensors)
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape
    np.testing.assert_array_equal(back[k], v)
