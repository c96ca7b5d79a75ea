"""docs/config.md against jaxpar/config.py, `--print-config`, the commands' help and the run
summary's parameter count."""
import dataclasses
import importlib.util
import pathlib
import re

import numpy as np
import pytest
import yaml

from jaxpar import config
from jaxpar.commands import plan as plan_command
from jaxpar.commands import train as train_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gen_config_reference",
                                              ROOT / "docs" / "gen_config_reference.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def keys() -> list[str]:
  return [f"{s}.{k}" for s, body in config.to_dict(config.Config()).items() for k in body]


def test_the_config_page_is_what_the_code_gives():
  page = (ROOT / "docs" / "config.md").read_text()
  assert page == gen.render(), "docs/config.md is stale: run python docs/gen_config_reference.py"
  listed = re.findall(r"^- `([\w.]+)` \((\w+), default (.+?)\): (.+)$", page, re.M)
  assert [k for k, *_ in listed] == keys()  # every key, once, in the dataclasses' order
  defaults = config.to_dict(config.Config())
  for key, typ, default, meaning in listed:
    section, name = key.split(".")
    value = defaults[section][name]
    assert typ == type(value).__name__, key
    text = default.strip("`")
    assert (float(text) if typ == "float" else yaml.safe_load(text)) == value, key
    assert meaning.strip(), f"{key} has no meaning: a comment beside it in jaxpar/config.py"


def test_a_fields_meaning_is_the_block_above_it_and_its_own_comment():
  meaning = gen.meanings((ROOT / "jaxpar" / "config.py").read_text())
  assert meaning["model.kind"].startswith("gpt (GPT-2 style)")  # its own line's comment
  assert meaning["train.eval_steps"].startswith("batches per evaluation (0 = the whole split")
  assert "background threads" in meaning["data.workers"]  # the block above, not the line below
  assert meaning["train.spike_factor"].startswith("Loss-spike guard")
  assert "Loss-spike" not in meaning["train.skip_nonfinite"]  # the block below is the next key's


def _yaml(capsys, code: int, head: list[str] | None = None) -> dict:
  out = capsys.readouterr()
  assert code == 0, out.err
  if head is not None:  # the comment lines before the YAML
    assert out.out.splitlines()[:len(head)] == head, out.out
  return yaml.safe_load(out.out)


def _expected(*trees: dict) -> dict:
  """The defaults with each tree's keys laid over them, as a --config file and --set give them."""
  want = dataclasses.asdict(config.Config())
  for tree in trees:
    for section, body in tree.items():
      want[section].update(body)
  return want


@pytest.mark.parametrize("main", [train_command.main, plan_command.main], ids=["train", "plan"])
def test_print_config_prints_the_resolved_config_and_trains_nothing(main, tmp_path, monkeypatch,
                                                                    capsys):
  monkeypatch.chdir(tmp_path)
  medium = ROOT / "configs" / "gpt_medium.yaml"
  steps = ["--steps", "7"] if main is train_command.main else []  # train.py's --steps is the total
  # The command line's part of the run, too: the mesh, and train.py's workdir (the default here)
  head = ["# mesh: 8x1x1 (8 devices: data=8, model=1, pipeline=1, context=1)"] + (
      [f"# workdir: {tmp_path / 'workdir'}"] if steps else [])
  got = _yaml(capsys, main(["--mesh", "8x1x1", "--config", str(medium), "--print-config", *steps,
                            "--set", "train.lr=0.01", "model.n_layers=2"]), head)
  want = _expected(yaml.safe_load(medium.read_text()), {"train": {"lr": 0.01},
                                                        "model": {"n_layers": 2}},
                   {"train": {"steps": 7}} if steps else {})
  assert got == want
  assert config.from_dict(got) == config.load(str(medium), ["train.lr=0.01", "model.n_layers=2",
                                                            *(["train.steps=7"] if steps else [])])
  assert list(tmp_path.iterdir()) == []  # no workdir, no data, no checkpoint
  # a config that does not fit the mesh is refused as a run would refuse it
  assert main(["--mesh", "1x3x1", "--print-config"]) == 2
  assert "is not divisible by model=3" in capsys.readouterr().err


def test_help_names_the_context_axis_and_print_config(capsys):
  for main in (train_command.main, plan_command.main):
    with pytest.raises(SystemExit) as e:
      main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "--mesh DxMxP[xC]" in text and "[x context]" in text and "--print-config" in text


def test_the_summary_names_the_parameter_count(tmp_path, monkeypatch, capsys):
  """The count the summary prints against the parameters' shapes in the checkpoint it wrote,
  read with plain orbax."""
  import orbax.checkpoint as ocp
  monkeypatch.chdir(tmp_path)
  tiny = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
          "model.seq_len=16", "train.batch_size=8", "data.source=synthetic"]
  code = train_command.main(["--mesh", "8x1x1", "--steps", "1", "--no-progress", "--set", *tiny])
  out = capsys.readouterr()
  assert code == 0, out.err
  printed = re.findall(r"^parameters: (\d+)$", out.out, re.M)
  with ocp.PyTreeCheckpointer() as reader:
    tree = reader.metadata(str(tmp_path / "workdir" / "checkpoints" / "1" / "state")).item_metadata.tree
  stored = sum(int(np.prod(m.shape)) for m in
               __import__("jax").tree_util.tree_leaves(tree["params"]))
  assert printed == [str(stored)], out.out
