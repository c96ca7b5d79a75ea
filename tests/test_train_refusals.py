"""scripts/train.py's refusals come alone and leave nothing behind: a workdir holding a
checkpoint of a user's own model, and a mesh that does not fit the model (no "simulating N CPU
devices" line before the sentence)."""
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
from conftest import child_env
from flax import nnx

import jaxpar
from jaxpar.parallel import mesh as jmesh

ROOT = pathlib.Path(__file__).resolve().parents[1]


def script(name, *args):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
                        capture_output=True, text=True, timeout=300, env=child_env(), cwd=ROOT)


def tree(path) -> dict:
  """Every entry below `path`; a file's with its size and modification time (a folder's own
  time moves with the writability check's scratch entry, made and removed)."""
  out = {}
  for d, dirs, files in os.walk(path):
    for n in dirs + files:
      p = os.path.join(d, n)
      st = os.stat(p)
      out[os.path.relpath(p, path)] = None if n in dirs else (st.st_size, st.st_mtime_ns)
  return out


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def test_train_refuses_a_checkpoint_of_a_users_model_and_writes_nothing(tmp_path):
  loss = lambda out, batch: (optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
                             .mean(), {})
  cfg = jaxpar.config.load(None, [])  # the defaults train.py runs: the resume check passes
  t = jaxpar.Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), jaxpar.from_nnx(Tiny, loss, path_rules=[("bias", (None,)), ("kernel", (None, None))]))
  workdir = tmp_path / "wd"
  t.save(str(workdir), t.init(0))
  before = tree(workdir)
  r = script("train.py", "--workdir", workdir, "--steps", 2, "--no-progress")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.splitlines() == [
      f"error: the checkpoint of step 0 in {workdir / 'checkpoints'} holds a model of your own; "
      f"jaxpar-train trains jaxpar's own model kinds only: go on with jaxpar.Trainer.load in "
      f"your own loop, or use another --workdir"]
  assert tree(workdir) == before  # no workdir/data, nothing else


def test_a_refused_mesh_is_one_sentence_alone(tmp_path):
  r = script("train.py", "--mesh", "2x4x1", "--set", "model.d_ff=1026", "--workdir",
             tmp_path / "wd")
  assert r.returncode == 2, r.stderr
  assert r.stderr.splitlines() == [
      "error: mesh 2x4x1 (data=2, model=4, pipeline=1) does not fit: model.d_ff=1026 is not "
      "divisible by model=4"]
  assert not (tmp_path / "wd").exists()
  r = script("generate.py", "--mesh", "1x1x1x2", "--workdir", tmp_path / "wd", "--prompt", "x")
  assert r.returncode == 2, r.stderr
  assert r.stderr.splitlines() == [
      "error: generation runs without a context axis (mesh 1x1x1x2 has context=2); a checkpoint "
      "trained with any context split loads on a DxMxP mesh"]
