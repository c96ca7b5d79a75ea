"""Every shipped config loads, validates, and starts with the command that runs it."""
import pathlib
import re

import pytest

from jaxpar import config

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_documents_its_command(path):
  config.load(str(path))
  first = path.read_text().splitlines()[0]
  assert first.startswith("# python scripts/train.py --mesh ") and path.name in first


def test_set_overrides_file_and_later_wins(tmp_path):
  f = tmp_path / "c.yaml"
  f.write_text("train:\n  lr: 0.5\n  steps: 7\n")
  cfg = config.load(str(f), ["train.lr=0.1", "train.lr=0.2"])
  assert cfg.train.lr == 0.2 and cfg.train.steps == 7


def test_unknown_section_and_key_fail():
  with pytest.raises(config.ConfigError, match="unknown config key: optim.lr"):
    config.load(None, ["optim.lr=1"])
  with pytest.raises(config.ConfigError, match="unknown config key: train.learning_rate"):
    config.load(None, ["train.learning_rate=1"])


def test_round_trip_through_dict():
  cfg = config.load(None, ["model.n_layers=3", "parallel.zero_stage=2"])
  assert config.from_dict(config.to_dict(cfg)) == cfg


@pytest.mark.parametrize("override,message", [
    ("train.b1=2", "train.b1=2.0 must be in [0, 1)"),
    ("train.b2=-0.1", "train.b2=-0.1 must be in [0, 1)"),
    ("train.min_lr_ratio=-1", "train.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio=2.0 must be in [0, 1]"),
    ("model.norm_eps=-1", "model.norm_eps=-1.0 must be positive"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be positive"),
    ("precision.min_scale=0", "precision.min_scale=0.0 must be positive"),
    ("precision.min_scale=1e9", "precision.min_scale=1000000000.0 is above precision.initial_scale"),
])
def test_out_of_range_values_are_config_errors(override, message):
  with pytest.raises(config.ConfigError, match=re.escape(message)):
    config.load(None, [override])
  config.load(None, ["train.min_lr_ratio=1", "train.b2=0"])  # the closed ends are fine


def test_a_section_that_is_not_a_mapping_says_so(tmp_path):
  f = tmp_path / "c.yaml"
  f.write_text("train: 5\n")
  with pytest.raises(config.ConfigError, match=re.escape(
      f"config file {f}: section train must hold a mapping of its keys, like 'train: {{steps: 10}}', got 5")):
    config.load(str(f))


def test_resume_compares_data_paths_as_the_folders_they_name(tmp_path, monkeypatch):
  (tmp_path / "a" / "text").mkdir(parents=True)
  (tmp_path / "b" / "text").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "a")
  saved = config.to_dict(config.absolute_paths(config.load(None, ["data.path=text"])))
  assert saved["data"]["path"] == str(tmp_path / "a" / "text")  # a run stores it absolute
  for same in ("text", "./text/", str(tmp_path / "a" / "text")):
    assert config.resume_mismatch(saved, config.load(None, [f"data.path={same}"])) == []
  monkeypatch.chdir(tmp_path / "b")  # the same spelling, another folder: other data
  assert config.resume_mismatch(saved, config.load(None, ["data.path=text"])) == [
      f"data.path={str(tmp_path / 'a' / 'text')!r}->'text'"]
