"""`--print-config`, the commands' help and the run
summary's parameter count."""
import dataclasses
import pathlib
import re

import numpy as np
import pytest
import yaml

from jaxpar import config
from jaxpar.commands import plan as plan_command
from jaxpar.commands import train as train_command

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _yaml(capsys, code: int) -> dict:
  out = capsys.readouterr()
  assert code == 0, out.err
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
  got = _yaml(capsys, main(["--mesh", "8x1x1", "--config", str(medium), "--print-config",
                            "--set", "train.lr=0.01", "model.n_layers=2"]))
  want = _expected(yaml.safe_load(medium.read_text()), {"train": {"lr": 0.01},
                                                        "model": {"n_layers": 2}})
  assert got == want
  assert config.from_dict(got) == config.load(str(medium), ["train.lr=0.01", "model.n_layers=2"])
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
