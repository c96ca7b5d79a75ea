"""A user's own model through checkpoints: `Trainer.save` on one layout, `Trainer.load` in a new
process onto another (2x4x1 -> 8x1x1 ZeRO-3) continues the run as if unbroken, and the export of
such a checkpoint says the model is the user's own and lists its parameters, while jaxpar's own
kinds (and checkpoints older than the origin record) still export their model config."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import child_env

import jaxpar
from jaxpar import config
from jaxpar.interop import export, generate, hf
from jaxpar.models import registry
from jaxpar.train import checkpoint

# The user's model, run here and in the new process alike. Dropout makes the continued steps
# depend on the step counter the checkpoint restores (each step's key is folded from it).
MODEL = """
import jax, numpy as np, optax
from flax import nnx
import jaxpar

class MLP(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(16, 64, rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)))
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.down = nnx.Linear(64, 8, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))

  def __call__(self, x):
    return self.down(self.drop(jax.nn.relu(self.up(x))))

def loss_fn(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

def trainer(mesh, *overrides):
  cfg = jaxpar.config.load(None, ["train.batch_size=16", "train.lr=1e-2", "train.warmup_steps=2",
                                  *overrides])
  return jaxpar.Trainer(cfg, jaxpar.make_mesh(mesh), jaxpar.from_nnx(MLP, loss_fn))

rng = np.random.default_rng(0)
x = rng.normal(size=(16, 16)).astype(np.float32)
batch = {"x": x, "y": x[:, :8].argmax(-1).astype(np.int32)}
"""

# The new process: restores the latest checkpoint of WORKDIR onto 8x1x1 ZeRO-3, trains 3 steps.
CONTINUE = MODEL + """
import sys
t = trainer("8x1x1", "parallel.zero_stage=3")
state = t.load(sys.argv[1])
out = {"step": int(state["step"]), "spec": str(t.state_shardings["params"]["up"]["kernel"].spec),
       "losses": []}
for _ in range(3):
  state, metrics = t.step(state, batch)
  out["losses"].append(float(metrics["loss"]))
print("RESULT", json.dumps(out))
"""


def _user(scope=None):
  scope = {} if scope is None else scope
  exec(compile(MODEL, "user-model", "exec"), scope)
  return scope


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """6 unbroken steps on 2x4x1, and 3 steps of the same run saved in a workdir."""
  u = _user()
  t = u["trainer"]("2x4x1")
  state, unbroken = t.init(seed=0), []
  for _ in range(6):
    state, metrics = t.step(state, u["batch"])
    unbroken.append(float(metrics["loss"]))
  workdir = str(tmp_path_factory.mktemp("user") / "run")
  state = t.init(seed=0)
  for _ in range(3):
    state, _ = t.step(state, u["batch"])
  assert t.save(workdir, state) == 3
  params = export.param_tensors(jax.device_get(state["params"]))
  return {"workdir": workdir, "unbroken": unbroken, "trainer": t, "state": state,
          "params": params}


def test_restored_in_a_new_process_onto_another_mesh_continues_the_run(saved):
  env = child_env()
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  r = subprocess.run([sys.executable, "-c", "import json\n" + CONTINUE, saved["workdir"]],
                     env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  assert out["step"] == 3 and out["spec"] == "P(None, 'data')"  # ZeRO-3's shards
  np.testing.assert_allclose(out["losses"], saved["unbroken"][3:], rtol=1e-6, atol=1e-6)


def test_save_refuses_a_saved_step_and_load_names_the_steps(saved):
  t = saved["trainer"]
  with pytest.raises(jaxpar.ConfigError, match=r"holds a checkpoint of step 3 already"):
    t.save(saved["workdir"], saved["state"])
  with pytest.raises(jaxpar.ConfigError, match=r"no checkpoint of step 7 .*it has steps 3$"):
    t.load(saved["workdir"], step=7)


def test_export_of_a_users_model_says_so_and_lists_its_parameters(saved, tmp_path):
  from safetensors.numpy import load_file
  extra = checkpoint.read_extra(os.path.join(saved["workdir"], "checkpoints"))
  assert extra["model"] == {"origin": "user"}
  out = str(tmp_path / "mlp.safetensors")
  info = export.export(saved["workdir"], out)
  assert json.loads((tmp_path / "mlp.json").read_text()) == info
  model = info["model"]
  assert model["origin"] == "user" and "the user's own" in model["description"]
  assert "kind" not in model and "n_layers" not in model  # nothing of jaxpar's default GPT
  want = saved["params"]
  assert model["params"] == {name: {"shape": list(x.shape), "dtype": "float32"}
                             for name, x in want.items()}
  assert sorted(model["params"]) == ["down/bias", "down/kernel", "up/bias", "up/kernel"]
  tensors = load_file(out)
  for name, x in want.items():
    np.testing.assert_array_equal(tensors[name], x)
  # what needs one of jaxpar's models refuses in one sentence
  with pytest.raises(jaxpar.ConfigError, match=r"model of your own, which has no Hugging Face"):
    hf.export(saved["workdir"], str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()
  with pytest.raises(jaxpar.ConfigError, match=r"model of your own; jaxpar samples"):
    generate.Sampler(saved["workdir"])


TINY = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
        "model.seq_len=8", "train.batch_size=8"]


def test_jaxpar_models_and_older_checkpoints_export_their_model_config(tmp_path):
  cfg = config.load(None, TINY)
  t = jaxpar.Trainer(cfg, jaxpar.make_mesh("1x1x1"), registry.build_model(cfg))
  state = t.init(seed=0)
  t.save(str(tmp_path / "gpt"), state)
  assert checkpoint.read_extra(str(tmp_path / "gpt" / "checkpoints"))["model"] == {
      "origin": "jaxpar", "kind": "gpt"}
  info = export.export(str(tmp_path / "gpt"), str(tmp_path / "gpt.safetensors"))
  assert info["model"] == config.to_dict(cfg)["model"] and info["model"]["n_layers"] == 1
  # a checkpoint from before the origin record: its config, as export always read it
  with checkpoint.Checkpointer(str(tmp_path / "old" / "checkpoints"), keep=1, every=0,
                               async_save=False) as ckpt:
    ckpt.maybe_save(0, t.to_logical(state), {"config": config.to_dict(cfg)}, force=True)
  old = export.export(str(tmp_path / "old"), str(tmp_path / "old.safetensors"))
  assert old["model"] == info["model"] and old["n_tensors"] == info["n_tensors"]
