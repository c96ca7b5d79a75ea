import os
import sys

if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.train import metrics


def read_lines(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_model_flops_per_token():
  assert metrics.model_flops_per_token(1_000_000, 4, 128, 256) == 6 * 1_000_000 + 12 * 4 * 128 * 256


def test_mfu():
  assert metrics.mfu(1000.0, 6e6, 1e9, 8) == pytest.approx(1000 * 6e6 / 8e9)


def test_jsonl_lines_and_final(tmp_path):
  path = tmp_path / "run" / "metrics.jsonl"
  logger = metrics.MetricsLogger(str(tmp_path), str(path), total_steps=20, progress=True)
  logger.log(10, {"loss": np.float32(2.5), "tokens_per_sec": jnp.asarray(1234.5),
                  "lr": 1e-3, "n_tokens": np.int64(4096)})
  logger.log(20, {"loss": 2.25, "tokens_per_sec": 1300.0, "lr": 5e-4, "n_tokens": 8192})
  text = logger.final({"steps": 20, "tokens_per_sec": np.float64(1300.0), "mfu": 0.25,
                       "peak_flops_per_device": 1e12, "peak_flops_source": "test",
                       "peak_memory_bytes": None})
  lines = read_lines(path)
  assert len(lines) == 3
  assert lines[0] == {"step": 10, "loss": 2.5, "tokens_per_sec": 1234.5, "lr": 1e-3,
                      "n_tokens": 4096}
  assert type(lines[0]["loss"]) is float and type(lines[0]["n_tokens"]) is int
  assert lines[1]["step"] == 20 and lines[1]["loss"] == 2.25
  assert lines[2]["final"] is True and lines[2]["steps"] == 20 and lines[2]["mfu"] == 0.25
  assert "steps: 20" in text and "MFU: 25.00%" in text and "test" in text
  assert "tokens/s: 1,300" in text and "peak memory per device" in text
  # The file is valid JSON everywhere, so no NaN/Infinity tokens either.
  assert "NaN" not in path.read_text()

  events = os.listdir(tmp_path / "tb")
  assert any(name.startswith("events.out.tfevents") for name in events)


def test_non_finite_becomes_null_and_file_appends(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 1}\n')
  logger = metrics.MetricsLogger(None, str(path), total_steps=5, use_tensorboard=True,
                                 progress=False)
  logger.log(2, {"loss": float("nan"), "grad_norm": np.float32("inf")})
  logger.close()
  lines = read_lines(path)
  assert lines == [{"step": 1}, {"step": 2, "loss": None, "grad_norm": None}]


def test_not_main_writes_nothing(tmp_path):
  path = tmp_path / "metrics.jsonl"
  logger = metrics.MetricsLogger(str(tmp_path), str(path), total_steps=3, is_main=False)
  logger.log(1, {"loss": 1.0})
  logger.final({"steps": 1})
  assert os.listdir(tmp_path) == []


def test_nothing_written_before_first_log(tmp_path):
  metrics.MetricsLogger(str(tmp_path), str(tmp_path / "m.jsonl"), total_steps=3).close()
  assert os.listdir(tmp_path) == []


def test_peak_flops_per_device_is_measured_and_cached():
  peak, source = metrics.peak_flops_per_device()
  assert peak > 0 and isinstance(source, str)
  if jax.devices()[0].platform == "cpu":
    assert "measured fp32 matmul" in source and str(jax.local_device_count()) in source
  assert metrics.peak_flops_per_device() == (peak, source)


def test_device_peak_memory_bytes():
  peak = metrics.device_peak_memory_bytes()
  if jax.devices()[0].platform == "cpu":
    assert peak is None
  else:
    assert isinstance(peak, int) and peak > 0


def test_progress_rate_excludes_compilation(tmp_path):
  """The first interval (compilation) shows no rate; later ones show 1 / step_time_s."""
  logger = metrics.MetricsLogger(None, None, total_steps=100, use_tensorboard=False)
  logger.log(10, {"loss": 3.0, "step_time_s": 2.0})  # 10 steps incl. compile, microseconds ago
  first = str(logger._bar)
  assert "?step/s" in first and "10/100" in first, first
  logger.log(20, {"loss": 2.5, "step_time_s": 0.25})
  second = str(logger._bar)
  assert " 4.00step/s" in second and "20/100" in second and "<00:20" in second, second
  logger.close()


def test_progress_rate_after_resume_ignores_earlier_steps():
  logger = metrics.MetricsLogger(None, None, total_steps=1000, use_tensorboard=False)
  logger.log(510, {"loss": 3.0})  # resumed at 500: the first 500 steps ran in another process
  assert "?step/s" in str(logger._bar), str(logger._bar)
  logger.close()


def test_missing_tensorboardx_and_tqdm_each_leave_one_note(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
  monkeypatch.setitem(sys.modules, "tqdm.auto", None)
  path = tmp_path / "m.jsonl"
  logger = metrics.MetricsLogger(str(tmp_path), str(path), total_steps=4, progress=True)
  logger.log(2, {"loss": 2.0})
  logger.log(4, {"loss": 1.5})
  logger.close()
  assert [row["step"] for row in read_lines(path)] == [2, 4]
  err = capsys.readouterr().err
  assert err.count("note: tensorboardX is not installed") == 1
  assert err.count("note: tqdm is not installed") == 1
  assert not (tmp_path / "tb").exists()
