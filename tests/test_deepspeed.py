"""DeepSpeed configs read as jaxpar overrides: the mapping of a seed-style config, contradictions
as one-sentence errors, warnings for what cannot be honoured, and the README's command."""
import json
import pathlib
import sys

import pytest

from jaxpar import config
from jaxpar.commands import cli
from jaxpar.config import ConfigError
from jaxpar.interop import deepspeed
from jaxpar.parallel import mesh as jmesh

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = ROOT / "configs" / "ds_zero3_offload_fp16.json"


def mapped(tree, dp=8, user_set=(), pipeline=1):
  m = deepspeed.translate(tree, dp, pipeline=pipeline)
  return m, config.load(None, m.overrides + list(user_set))


def test_seed_config_maps_to_the_expected_jaxpar_config():
  m = deepspeed.load(str(SEED), 8)
  cfg = config.load(None, m.overrides)
  t, p, pr = cfg.train, cfg.parallel, cfg.precision
  assert (t.batch_size, t.grad_accum, t.clip_norm) == (16, 2, 1.0)  # 1 x 2 x data 8
  assert (t.lr, t.b1, t.b2, t.weight_decay) == (3e-3, 0.9, 0.95, 0.1)
  assert (t.warmup_steps, t.steps, t.min_lr_ratio) == (30, 300, 0.0)  # WarmupDecayLR to min_lr 0
  assert (p.zero_stage, p.offload_optimizer) == (3, True)
  assert (pr.compute_dtype, pr.loss_scale, pr.initial_scale) == ("float16", "dynamic", 2.0 ** 16)
  assert (pr.growth_interval, pr.min_scale) == (1000, 1.0)
  # every row is printed as DeepSpeed key -> jaxpar key = value
  table = m.table(["train.lr=0.01"])
  assert "zero_optimization.offload_optimizer.device" in table
  assert "-> parallel.offload_optimizer = true" in table
  assert "-> train.lr = 0.003  (--set train.lr=0.01 wins)" in table
  assert len(table.splitlines()) == len(m.rows) + 1


def test_defaults_auto_and_user_set():
  """A key left out of a present block is DeepSpeed's default (and says so); "auto" and absent
  blocks leave jaxpar's value; the user's --set wins over the DeepSpeed file."""
  tree = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
          "fp16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                       "warmup_max_lr": "auto",
                                                       "warmup_type": "linear"}},
          "activation_checkpointing": {"partition_activations": False}}
  m, cfg = mapped(tree, dp=4, user_set=["train.b2=0.98"])
  assert (cfg.train.batch_size, cfg.train.grad_accum) == (8, 1)  # 2 x 1 (default) x data 4
  assert cfg.precision.loss_scale == "dynamic"  # DeepSpeed's default loss_scale 0
  assert cfg.precision.growth_interval == 1000  # DeepSpeed's loss_scale_window, not jaxpar's 2000
  assert (cfg.train.b1, cfg.train.b2, cfg.train.weight_decay) == (0.9, 0.98, 0.0)
  assert cfg.train.lr == config.Config().train.lr  # "auto": jaxpar's own
  assert (cfg.train.warmup_steps, cfg.train.min_lr_ratio) == (10, 1.0)  # constant after warmup
  assert cfg.parallel.remat not in (False, "none")
  assert cfg.train.steps == config.Config().train.steps  # WarmupLR has no total
  assert "fp16.loss_scale_window (DeepSpeed default)" in m.table()
  assert "(DeepSpeed default)" in dict((k, d) for d, k, _ in m.rows)["train.grad_accum"]
  assert m.warnings == ["fp16.hysteresis=2 is not honoured (jaxpar backs the scale off on every "
                        "overflow, as hysteresis 1)"]


CONTRADICTORY = [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1},
     "train_batch_size=32 is not train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 "
     "x data-parallel degree 8 = 16"),
    ({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 2},
     "train_batch_size=20 is not divisible by train_micro_batch_size_per_gpu=2 x data-parallel "
     "degree 8"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled and bf16.enabled are both true"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not a ZeRO stage"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type='Lamb' is not available"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type='OneCycle' is not available"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}},
     "adam_w_mode=false (Adam with L2 weight decay) is not available"),
    ({"gradient_clipping": "one"}, "gradient_clipping='one' must be a non-negative number"),
    ({"fp16": {"enabled": "true"}},
     'fp16.enabled="true" must be the JSON boolean true or false (or "auto")'),
    ({"bf16": {"enabled": "false"}},
     'bf16.enabled="false" must be the JSON boolean true or false (or "auto")'),
    # Hugging Face fills "auto" in the optimizer's params only; DeepSpeed has no optimizer "auto"
    ({"optimizer": {"type": "auto", "params": {"lr": 1e-3}}},
     "optimizer.type='auto' is not available: jaxpar trains with AdamW"),
]


@pytest.mark.parametrize("tree,message", CONTRADICTORY, ids=[m.split()[0] for _, m in CONTRADICTORY])
def test_contradictory_or_unavailable_is_one_sentence_config_error(tree, message):
  with pytest.raises(ConfigError) as e:
    deepspeed.translate(tree, 8)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_ignorable_and_unknown_keys_are_warnings():
  tree = {"train_batch_size": 16, "steps_per_print": 100, "wall_clock_breakdown": False,
          "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                                "allgather_partitions": True, "stage3_max_live_parameters": 1e9,
                                "offload_param": {"device": "cpu"}, "bucket_magic": 1},
          "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4},
          "my_own_key": 1}
  m, cfg = mapped(tree)
  assert (cfg.parallel.zero_stage, cfg.train.batch_size, cfg.train.grad_accum) == (2, 16, 1)
  text = "\n".join(m.warnings)
  for key in ("steps_per_print=100", "zero_optimization.overlap_comm=true",
              "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_partitions",
              "zero_optimization.stage3_max_live_parameters", "offload_param.device=cpu",
              "activation_checkpointing.cpu_checkpointing", "activation_checkpointing.number_checkpoints"):
    assert sum(key in w for w in m.warnings) == 1, (key, text)
  assert "wall_clock_breakdown" not in text  # false asks for nothing
  assert all("is not honoured (" in w for w in m.warnings[:-1])
  assert m.warnings[-1] == ("not DeepSpeed keys jaxpar knows, ignored: "
                            "zero_optimization.bucket_magic, my_own_key")


def test_readme_command_is_the_seed_configs():
  """The README's command names this config (tests/test_docs.py runs it and checks the mapping's
  lines and the warning; tests/test_loss_scale.py the dynamic scale)."""
  readme = (ROOT / "README.md").read_text()
  cmd = "python scripts/train.py --mesh 8x1x1 --deepspeed configs/ds_zero3_offload_fp16.json"
  assert cmd in readme
  assert SEED.read_text().splitlines()[0].startswith(f"// {cmd}")


def test_contradiction_exits_2_with_one_sentence(tmp_path, capsys):
  bad = tmp_path / "ds.json"
  bad.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 1,
                             "gradient_accumulation_steps": 1}))
  sys.path.insert(0, str(ROOT / "scripts"))
  try:
    import train as train_script
  finally:
    sys.path.pop(0)
  rc = train_script.main(["--mesh", "8x1x1", "--deepspeed", str(bad), "--workdir",
                          str(tmp_path / "wd")])
  assert rc == 2 and not (tmp_path / "wd").exists()
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: DeepSpeed train_batch_size=10 is not train_micro_batch_size_per_gpu=1 x "
                 "gradient_accumulation_steps=1 x data-parallel degree 8 = 8"]


# What DeepSpeed itself does with the same JSON (its defaults, cited in each test), against what
# jaxpar maps it to.

def test_warmup_lr_without_max_lr_peaks_at_deepspeeds_default():
  """DeepSpeed's WarmupLR(warmup_max_lr=0.001) sets every parameter group's rate itself, so the
  optimizer's lr does not survive the warmup; "auto" (Hugging Face's) keeps the optimizer's."""
  opt = {"type": "AdamW", "params": {"lr": 3e-4}}
  m, cfg = mapped({"optimizer": opt, "scheduler": {"type": "WarmupLR",
                                                   "params": {"warmup_num_steps": 10}}})
  assert (cfg.train.lr, cfg.train.min_lr_ratio) == (0.001, 1.0)
  assert "optimizer.params.lr=0.0003 is replaced by scheduler.params.warmup_max_lr" in m.warnings[0]
  _, cfg = mapped({"optimizer": opt, "scheduler": {"type": "WarmupLR", "params": {
      "warmup_num_steps": 10, "warmup_max_lr": "auto"}}})
  assert cfg.train.lr == 3e-4


def test_disabled_half_precision_trains_float32_as_deepspeed():
  """DeepSpeed trains in float32 unless fp16 or bf16 is enabled; jaxpar's own compute_dtype=auto
  would be bfloat16 on a GPU."""
  for tree, want in [
      ({"fp16": {"enabled": False}}, "float32"),
      ({"bf16": {"enabled": False}}, "float32"),
      ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "float32"),
      ({"fp16": {"loss_scale": 0}}, "float32"),  # DeepSpeedFP16Config.enabled defaults to False
      ({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "bfloat16"),
      ({"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}}, "auto")]:  # Hugging Face's
    m, cfg = mapped(tree)
    assert cfg.precision.compute_dtype == want, tree
    assert ("-> precision.compute_dtype = float32" in m.table()) == (want == "float32")


def test_absent_gradient_clipping_is_deepspeeds_no_clipping():
  """DeepSpeed's GRADIENT_CLIPPING_DEFAULT is 0, no clipping (jaxpar's own default is 1.0)."""
  m, cfg = mapped({"train_batch_size": 16})
  assert cfg.train.clip_norm == 0.0
  assert "gradient_clipping (DeepSpeed default: no clipping) -> train.clip_norm = 0.0" in m.table()
  assert mapped({"train_batch_size": 16, "gradient_clipping": "auto"})[1].train.clip_norm == \
      config.Config().train.clip_norm


def test_batch_is_completed_as_deepspeed_does():
  """DeepSpeed's _set_batch_related_parameters on data 8: the missing one of train_batch_size =
  micro x accumulation x world size is derived, a missing accumulation is 1, the micro batch has
  no default; "auto" leaves the batch to jaxpar."""
  jaxpar_batch = config.Config().train.batch_size
  for tree, want in [
      ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, (64, 4)),
      ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, (64, 4)),
      ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, (64, 4)),
      ({"train_batch_size": 64}, (64, 1)),
      ({"train_micro_batch_size_per_gpu": 2}, (16, 1)),
      ({"train_batch_size": "auto", "gradient_accumulation_steps": 4}, (jaxpar_batch, 4))]:
    _, cfg = mapped(tree)
    assert (cfg.train.batch_size, cfg.train.grad_accum) == want, tree
  # accumulation alone: DeepSpeed asserts 'Either train_batch_size or
  # train_micro_batch_size_per_gpu needs to be provided'
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 alone does not give the "
                     "batch size: add train_batch_size or train_micro_batch_size_per_gpu"):
    deepspeed.translate({"gradient_accumulation_steps": 4}, 8)


def test_pipeline_mesh_takes_accumulation_steps_as_microbatches():
  """DeepSpeed's PipelineEngine runs gradient_accumulation_steps microbatches of
  train_micro_batch_size_per_gpu per train_batch() and steps once: on 2x1x4 the same JSON is 8
  microbatches of 1 example per data shard, one optimizer step, 16 examples."""
  tree = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8}
  m, cfg = mapped(tree, dp=2, user_set=["model.n_layers=4"], pipeline=4)
  t, p = cfg.train, cfg.parallel
  assert (t.batch_size, t.grad_accum, p.microbatches) == (16, 1, 8)
  assert t.batch_size // (2 * t.grad_accum * p.microbatches) == 1  # DeepSpeed's micro batch
  jmesh.check((2, 1, 4), cfg, 8)  # the mesh takes it
  row = ("gradient_accumulation_steps = pipeline microbatches", "parallel.microbatches", 8)
  assert row in m.rows
  # the CLI reads the pipeline degree from --mesh: the seed's 16 = 1 x 2 x data 8
  words = deepspeed.cli_overrides(str(SEED), "8x1x2", [], show=False)
  assert "parallel.microbatches=2" in words and "train.grad_accum=1" in words
  assert mapped(tree, dp=2)[1].train.grad_accum == 8  # no pipeline: plain accumulation


@pytest.mark.parametrize("tree,said", [
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4 alone"),
    ({"train_batch_size": 16, "fp16": {"enabled": "true"}}, 'fp16.enabled="true" must be'),
    ({"train_batch_size": 16, "optimizer": {"type": "auto"}}, "optimizer.type='auto' is not"),
], ids=["accum-alone", "enabled-string", "optimizer-auto"])
def test_new_refusals_exit_2_with_one_sentence(tmp_path, capsys, monkeypatch, tree, said):
  bad = tmp_path / "ds.json"
  bad.write_text(json.dumps(tree))
  sys.path.insert(0, str(ROOT / "scripts"))
  try:
    import train as train_script
  finally:
    sys.path.pop(0)

  def accepted(*_, **__):  # a config that got through would go on to train: stop it here
    raise AssertionError(f"{tree} was accepted")
  monkeypatch.setattr(cli, "setup", accepted)
  rc = train_script.main(["--mesh", "8x1x1", "--deepspeed", str(bad), "--workdir",
                          str(tmp_path / "wd")])
  assert rc == 2 and not (tmp_path / "wd").exists()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: DeepSpeed {said}"), err
