"""--profile-steps: a trace of the window's steps, and the summary's split into compute and collectives."""
import glob
import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import child_env

from jaxpar import config
from jaxpar.analysis import profile
from jaxpar.parallel import mesh as jmesh
from jaxpar.planning import plan
from jaxpar.train.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["data.source=synthetic", "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
        "model.d_ff=64", "model.seq_len=16", "train.batch_size=8"]


def train(workdir, *args: str) -> subprocess.CompletedProcess:
  """scripts/train.py for 3 steps on 2x1x1 (two data shards: gradients are all-reduced)."""
  env = child_env()  # train.py sets its own count
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--mesh", "2x1x1",
                         "--steps", "3", "--workdir", str(workdir), "--no-progress",
                         "--metrics-file", str(workdir) + ".jsonl", *args, "--set", *TINY],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_profile_window_writes_a_trace_and_splits_the_step(tmp_path):
  p = train(tmp_path / "wd", "--profile-steps", "2:3")
  assert p.returncode == 0, p.stderr
  traces = glob.glob(str(tmp_path / "wd" / "profile" / "**" / "*.xplane.pb"), recursive=True)
  assert len(traces) == 1
  lines = [l for l in p.stdout.splitlines() if l.startswith("profile steps 2-3")]
  assert len(lines) == 1 and "measured from the profiler trace" in lines[0], p.stdout
  final = json.loads((tmp_path / "wd.jsonl").read_text().splitlines()[-1])
  prof = final["profile"]
  assert final["final"] and prof["traced_steps"] == 2 and prof["source"] == "trace"
  assert prof["devices"] == 2 and prof["trace_file"] == traces[0]
  assert prof["compute_s"] > 0 and prof["collective_s"] > 0  # the gradients' all-reduce
  assert prof["compute_s"] + prof["collective_s"] + prof["other_s"] >= prof["step_s"] * 0.999


@pytest.mark.parametrize("window", ["3:2", "two:3", "2:9"])
def test_bad_window_is_one_sentence_and_exit_2(tmp_path, window):
  p = train(tmp_path / "wd", "--profile-steps", window)
  assert p.returncode == 2, p.stderr
  lines = p.stderr.strip().splitlines()
  errors = [l for l in lines if l.startswith("error:")]
  assert len(errors) == 1 and window in errors[0] and "Traceback" not in p.stderr, p.stderr
  assert not (tmp_path / "wd").exists()


def test_union_counts_overlapping_spans_once():
  # A while loop's event covers its body's: time is counted once per device.
  assert profile._union([(0, 10), (2, 5), (12, 15), (14, 20)]) == 18
  assert profile._union([]) == 0


def test_concurrent_ops_count_once_for_the_first_category():
  # XLA:CPU runs independent ops at once: an overlap counts for the lower rank only, so the
  # categories add up to the time covered by any op; a loop's span (last rank) fills the gaps.
  shares = profile._exclusive([(0, 10, 1), (5, 15, 0), (20, 30, 2), (18, 32, 3)], 4)
  assert shares == [10, 5, 10, 4]
  assert sum(shares) == profile._union([(0, 10), (5, 15), (20, 30), (18, 32)])
  assert profile._exclusive([], 2) == [0, 0]


def test_split_estimated_from_hlo_without_a_trace():
  cfg = config.load(None, TINY)
  mesh = jmesh.make((2, 1, 1), jax.devices()[:2])
  trainer = Trainer(cfg, mesh, plan._model(cfg))
  compiled = trainer.lower(plan._batch_abstract(cfg)).compile()
  split = profile.estimate_from_hlo(compiled, trainer, 0.1)
  assert split["compute_s"] + split["collective_s"] == pytest.approx(0.1)
  assert split["compute_s"] > 0 and split["collective_s"] > 0
