"""After training: sampling text (scripts/generate.py), safetensors export (scripts/export.py), and
reading a checkpoint with plain orbax, without jaxpar."""
import importlib.util
import json
import pathlib
import random
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import child_env

import jaxpar
from jaxpar import config
from jaxpar.commands import export as export_command
from jaxpar.interop import generate
from jaxpar.train import checkpoint, loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        "model.seq_len=32", "train.batch_size=8", "train.lr=1e-2", "train.warmup_steps=2"]
PROMPT = "the quick"


def script(name, *args):
  env = child_env()  # a 1x1x1 mesh: one device
  return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
                        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A short local_text run on 8x1x1 (a folder of small text files): its workdir and params."""
  base = tmp_path_factory.mktemp("trained")
  text = base / "text"
  text.mkdir()
  rng = random.Random(0)
  words = "the quick brown fox jumps over a lazy dog while sharded arrays train".split()
  for i in range(4):
    (text / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)))
  workdir = base / "wd"
  cfg = config.load(None, TINY + [f"data.path={text}"])
  result = loop.run(cfg, (8, 1, 1), str(workdir), steps=30, progress=False, log=lambda *a: None)
  assert result.losses[30] < result.losses[1] - 1.0  # it learned something to sample from
  return {"workdir": workdir, "cfg": cfg,
          "params": checkpoint.read_state(str(workdir / "checkpoints"))["params"]}


@pytest.fixture(scope="module")
def greedy_1x1x1(run):
  """scripts/generate.py's greedy text on one device."""
  r = script("generate.py", "--workdir", run["workdir"], "--prompt", PROMPT,
             "--max-new-tokens", 40, "--temperature", 0)
  assert r.returncode == 0, r.stderr
  # 10 prompt tokens (end-of-text, then 9 bytes) + 40 pass seq_len 32: the window rule is said
  assert ("jaxpar: prompt (10 tokens) + --max-new-tokens 40 pass model.seq_len=32: a row whose "
          "window is full continues from its last 16 tokens, re-encoded at positions 0-15\n"
          ) in r.stderr
  return r.stdout


def test_generate_script_samples_several_prompts_with_every_option(run, capsys):
  """Two prompts of different lengths, two samples each, top-k, top-p, a stop token and a seed:
  the text is the library's, and the full-recompute path (--no-cache) draws the same."""
  spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  prompts, stop = ["the q", "a la"], ord("w")
  args = ["--workdir", str(run["workdir"]), "--mesh", "8x1x1", "--prompt", prompts[0], "--prompt",
          prompts[1], "--max-new-tokens", "20", "--temperature", "0.9", "--top-k", "5",
          "--top-p", "0.9", "--stop-token", str(stop), "--num-samples", "2", "--seed", "3"]
  assert script.main(args) == 0
  cached = capsys.readouterr().out
  assert script.main(args + ["--no-cache"]) == 0
  assert capsys.readouterr().out == cached
  sampler = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  texts = sampler.generate(prompts, 20, 0.9, 5, 3, 2, top_p=0.9, stop_token=stop)
  assert all("w" not in t for t in texts) and len(set(texts)) > 1
  with_prompts = [p + t for p, t in zip([prompts[0]] * 2 + [prompts[1]] * 2, texts)]
  assert cached == ("\n\n" + "-" * 40 + "\n").join(with_prompts) + "\n"


def test_generate_script_writes_the_prompt_and_its_continuation(run, greedy_1x1x1):
  assert greedy_1x1x1.startswith(PROMPT)
  sampler = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  tokens = sampler.sample(PROMPT, max_new_tokens=40, temperature=0)
  assert tokens.shape == (1, 40) and tokens.dtype == np.int32
  assert ((tokens >= 0) & (tokens < 256)).all()
  assert greedy_1x1x1 == PROMPT + sampler.codec.decode(tokens[0]) + "\n"


def test_greedy_is_deterministic_on_any_mesh(run, greedy_1x1x1):
  want = greedy_1x1x1[len(PROMPT):-1]
  on8 = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  assert on8.generate(PROMPT, 40, temperature=0, seed=1) == [want]
  assert on8.generate(PROMPT, 40, temperature=0, seed=2) == [want]  # the seed plays no part
  # Tensor parallel, parameters split by ZeRO-3, and 3 samples padded to a multiple of data=2.
  tp = generate.Sampler(str(run["workdir"]), (2, 4, 1), overrides=["parallel.zero_stage=3"])
  spec = tp.params["layers"]["w1"].sharding.spec  # (layers, embed, mlp)
  assert spec[1:] == ("data", "model"), spec
  assert tp.generate(PROMPT, 40, temperature=0, num_samples=3) == [want] * 3
  # top-k 1 leaves only the greedy choice, whatever the temperature.
  assert tp.generate(PROMPT, 40, temperature=1.5, top_k=1, seed=3) == [want]


def test_sampling_follows_the_seed(run):
  sampler = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  a = sampler.sample(PROMPT, 40, temperature=1.0, seed=0, num_samples=2)
  assert np.array_equal(a, sampler.sample(PROMPT, 40, temperature=1.0, seed=0, num_samples=2))
  assert not np.array_equal(a[0], a[1])  # rows draw independently
  assert not np.array_equal(a, sampler.sample(PROMPT, 40, temperature=1.0, seed=1, num_samples=2))


def test_generate_bad_input_is_exit_2(run, tmp_path):
  r = script("generate.py", "--workdir", tmp_path / "none", "--prompt", "x")
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == [
      f"error: workdir {tmp_path / 'none'} holds no complete checkpoint "
      f"(looked in {tmp_path / 'none' / 'checkpoints'})"]
  sampler = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  for t in (-1.0, float("nan"), float("inf")):
    with pytest.raises(config.ConfigError, match=f"--temperature={t} must be a finite number, not negative"):
      sampler.sample("x", 4, temperature=t)


def test_export_writes_every_parameter_unsharded(run, tmp_path):
  from safetensors.numpy import load_file
  out = tmp_path / "export" / "model.safetensors"
  r = script("export.py", "--workdir", run["workdir"], "--out", out)
  assert r.returncode == 0, r.stderr
  tensors = load_file(str(out))
  want = {jaxpar.parallel.rules.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(run["params"])}
  assert set(tensors) == set(want) and "layers/wq" in tensors and "wte" in tensors
  for name, x in want.items():
    assert tensors[name].shape == x.shape and tensors[name].dtype == x.dtype, name
    assert np.array_equal(tensors[name], x), name
  info = json.loads((tmp_path / "export" / "model.json").read_text())
  assert info["model"] == config.to_dict(run["cfg"])["model"]
  extra = checkpoint.read_extra(str(run["workdir"] / "checkpoints"))  # training records the kind
  assert extra["model"] == {"origin": "jaxpar", "kind": "gpt"}
  assert info["jaxpar_version"] == jaxpar.__version__ and info["step"] == 30
  assert info["n_params"] == sum(x.size for x in want.values())


def test_export_bad_input_is_exit_2(run, tmp_path, capsys):
  def export(*args):  # the script's main, in process
    code = export_command.main([str(a) for a in args])
    return code, capsys.readouterr().err
  out = tmp_path / "m.safetensors"
  code, err = export("--workdir", tmp_path / "none", "--out", out)
  assert code == 2 and "Traceback" not in err
  assert len([l for l in err.splitlines() if l.startswith("error:")]) == 1
  assert "holds no complete checkpoint" in err
  code, err = export("--workdir", run["workdir"], "--step", 7, "--out", out)
  assert code == 2 and "has no checkpoint of step 7; it has steps 30" in err
  assert not out.exists()
  a_file = tmp_path / "a_file"
  a_file.write_text("mine")
  for args, message in ((["--out", a_file / "m.safetensors"], f"cannot be made: {a_file} is a file"),
                        (["--hf", a_file], f"--hf {a_file} is a file; it must be a folder")):
    code, err = export("--workdir", run["workdir"], *args)
    assert code == 2 and "Traceback" not in err and message in err, err
  assert a_file.read_text() == "mine"


PLAIN_ORBAX = """
import json, sys
import jax
import numpy as np
import orbax.checkpoint as ocp

directory = sys.argv[1]
manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
step = manager.latest_step()
path = f"{directory}/{step}/state"
with ocp.PyTreeCheckpointer() as ckptr:
  tree = ckptr.metadata(path).item_metadata.tree
  as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
  extra = ckptr.restore(f"{directory}/{step}/extra")
print(json.dumps({
    "step": step, "state_step": int(state["step"]), "model": extra["config"]["model"],
    "params": {jax.tree_util.keystr(p): [list(x.shape), float(np.sum(x, dtype=np.float64))]
               for p, x in jax.tree_util.tree_leaves_with_path(state["params"])},
    "jaxpar_imported": any(m.split(".")[0] == "jaxpar" for m in sys.modules)}))
"""


def test_plain_orbax_reads_the_checkpoint_without_jaxpar(run, tmp_path):
  (tmp_path / "read.py").write_text(textwrap.dedent(PLAIN_ORBAX))
  env = child_env("PYTHONPATH")
  r = subprocess.run([sys.executable, str(tmp_path / "read.py"), str(run["workdir"] / "checkpoints")],
                     capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  got = json.loads(r.stdout.splitlines()[-1])
  assert not got["jaxpar_imported"]
  assert got["step"] == 30 and got["state_step"] == 30
  assert got["model"] == config.to_dict(run["cfg"])["model"]
  want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(run["params"])}
  assert set(got["params"]) == set(want)
  for key, x in want.items():
    shape, total = got["params"][key]
    assert tuple(shape) == x.shape, key
    assert total == pytest.approx(float(np.sum(x, dtype=np.float64)), rel=1e-12, abs=1e-12), key


def test_sampler_restores_the_parameters_only(run, monkeypatch):
  """The optimizer state is never read: the whole-state restore is not used, and what is read
  onto the devices is the parameters' bytes exactly (not 3x: parameters + Adam moments)."""
  def whole_state(*a, **k):
    raise AssertionError("the sampler restored the whole train state")
  monkeypatch.setattr(checkpoint.Checkpointer, "restore", whole_state)
  before = {id(a) for a in jax.live_arrays()}
  sampler = generate.Sampler(str(run["workdir"]), (8, 1, 1))
  new = [a for a in jax.live_arrays() if id(a) not in before]
  params = sum(x.nbytes for x in jax.tree_util.tree_leaves(run["params"]))
  assert sum(a.nbytes for a in new) == params
  assert sampler.generate(PROMPT, max_new_tokens=4, temperature=0)


def test_export_holds_one_parameter_at_a_time(run, tmp_path, monkeypatch):
  """Export reads, writes and drops one tensor at a time: when a parameter is read, every one
  read before it is already freed (the old export held the whole tree, then its serialisation)."""
  import gc
  import time
  import weakref

  from jaxpar.interop import export
  real, held, reads = checkpoint.read_param, [], []

  def freed():  # orbax's reader threads may drop their last reference a moment after returning
    for _ in range(200):
      if all(ref() is None for ref in held):
        return True
      gc.collect()
      time.sleep(0.01)
    return False

  def read_one(directory, step, name):
    assert freed(), f"a parameter is still alive 2 s into reading {name}"
    x = real(directory, step, name)
    held.append(weakref.ref(x))
    reads.append(name)
    return x
  monkeypatch.setattr(checkpoint, "read_param", read_one)
  out = tmp_path / "m.safetensors"
  export.export(str(run["workdir"]), str(out))
  assert sorted(reads) == sorted(export.param_tensors(run["params"]))  # each once, by itself
  from safetensors.numpy import load_file
  for name, x in load_file(str(out)).items():
    np.testing.assert_array_equal(x, export.param_tensors(run["params"])[name])
