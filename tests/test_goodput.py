"""Goodput: the compiled step from the persistent cache, loss spikes rolled back, the wall time
split in the summary, a stalled step that ends the job.

The subprocess runs use a tiny model and their own cache folder (never the session's, so no
other test's compiles decide a hit or a miss here).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar import cli, config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")
PLAN = str(ROOT / "scripts" / "plan.py")
FAST_COMPILE = "--xla_backend_optimization_level=0"
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=4", "data.source=synthetic",
        "train.log_every=1", "train.steps=3", "data.workers=0"]


def child_env():
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_", "PMI_", "JAX_COMPILATION_CACHE",
                              "JAX_PERSISTENT_CACHE"))}
  env.update({"XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
  return env


def run(args, timeout=180):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                        env=child_env(), cwd=ROOT)


def records(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_the_cache_folder_comes_from_the_key_then_the_environment_then_the_user_cache():
  cfg = config.load(None, [])
  assert cli.compile_cache_dir(cfg, {"HOME": "/h"}) == os.path.join(
      os.path.expanduser("~"), ".cache", "jaxpar", "xla")
  assert cli.compile_cache_dir(cfg, {"XDG_CACHE_HOME": "/x"}) == "/x/jaxpar/xla"
  assert cli.compile_cache_dir(cfg, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  assert cli.compile_cache_dir(cfg, {"JAXPAR_COMPILE_CACHE": "/p", "XDG_CACHE_HOME": "/x"}) == "/p"
  assert cli.compile_cache_dir(cfg, {"JAXPAR_COMPILE_CACHE": "off"}) is None
  own = config.load(None, ["train.compile_cache=/c"])
  assert cli.compile_cache_dir(own, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/c"
  assert cli.compile_cache_dir(config.load(None, ["train.compile_cache=off"]), {}) is None


def test_plan_then_train_compiles_the_step_once_and_another_topology_misses(tmp_path):
  cache = tmp_path / "cache"
  common = ["--set", *TINY, f"train.compile_cache={cache}"]
  r = run([PLAN, "--mesh", "2x1x1", "--json", *common])
  assert r.returncode == 0, r.stderr
  assert any(p.name.startswith("jit_step_fn") for p in cache.iterdir())

  # plan.py compiled this layout's step: train.py loads it, and says so in its first metrics row
  # and in its summary.
  m = tmp_path / "m.jsonl"
  r = run([TRAIN, "--mesh", "2x1x1", "--workdir", str(tmp_path / "wd"), "--metrics-file", str(m),
           "--no-progress", *common])
  assert r.returncode == 0, r.stderr
  rows = records(m)
  assert rows[0]["compile_cache"] == "hit" and rows[0]["compile_s"] > 0
  assert rows[-1]["final"] and rows[-1]["compile_cache"] == "hit"
  assert "compile_cache: hit" in r.stdout

  # Another topology (one device) is never served the 2-device program.
  m1 = tmp_path / "m1.jsonl"
  r = run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd1"), "--metrics-file",
           str(m1), "--no-progress", *common])
  assert r.returncode == 0, r.stderr
  assert records(m1)[-1]["compile_cache"] == "miss"


def test_a_cache_folder_that_cannot_be_made_is_one_sentence(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  r = run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd"), "--no-progress",
           "--set", *TINY, f"train.compile_cache={blocker}/sub"])
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith(
      f"error: train.compile_cache={blocker}/sub cannot be made"), r.stderr
  assert not (tmp_path / "wd").exists()
