"""scripts/train.py as a user runs it: one-sentence errors with exit code 2, and a short real run."""
import json
import pathlib
import subprocess
import sys

import pytest
from conftest import FAST_XLA, child_env

from jaxpar.commands import train as train_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        "model.seq_len=16", "train.batch_size=8", "train.log_every=2"]


def train(*args, env_extra=None, timeout=300):
  env = child_env()
  env.update(env_extra or {})
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args],
                        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


BAD = [
    (["--mesh", "2by4"], "is not of the form DxMxP"),
    (["--mesh", "0x1x1"], "is not of the form DxMxP"),
    (["--mesh", "2x4x1", "--set", "model.n_heads=6", "model.d_model=96"], "model.n_heads=6 is not divisible by model=4"),
    (["--mesh", "3x1x1"], "train.batch_size/train.grad_accum=16 is not divisible by data=3"),
    (["--mesh", "1x1x1", "--set", "model.d_layers=3"], "unknown config key: model.d_layers"),
    (["--mesh", "1x1x1", "--set", "train.steps=many"], "train.steps must be of type int"),
    (["--mesh", "1x1x1", "--set", "parallel.zero_stage=5"], "parallel.zero_stage=5 must be 0, 1, 2 or 3"),
    (["--mesh", "1x1x1", "--set", "train.lr=-1"], "train.lr=-1.0 must not be negative"),
    (["--mesh", "1x1x1", "--set", "train.lr=nan"], "train.lr=nan must be a finite number"),
    (["--mesh", "1x1x1", "--config", "no/such/file.yaml"], "config file no/such/file.yaml does not exist"),
    (["--mesh", "1x1x1", "--set", "precision.compute_dtype=fp8"], "is not one of"),
    (["--mesh", "1x1x3"], "model.n_layers=4 is not divisible by 3 pipeline stages"),
    (["--mesh", "1x1x2", "--set", "parallel.microbatches=3"], "per-replica batch 16 is not divisible by parallel.microbatches=3"),
    (["--mesh", "1x1x2", "--set", "parallel.schedule=zigzag"], "parallel.schedule='zigzag' is not one of gpipe, circular, 1f1b"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, message, capsys):
  # The command's main as train.py runs it, in process; where it then counts this process's 8
  # devices against a mesh for another count, the script itself, in a process of its own.
  workdir = tmp_path / "wd"
  code = train_command.main([*args, "--workdir", str(workdir), "--no-progress"])
  err = capsys.readouterr().err
  if "devices, found 8" in err:
    r = train(*args, "--workdir", str(workdir), "--no-progress")
    code, err = r.returncode, r.stderr
  assert code == 2, err
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], err
  assert "Traceback" not in err
  assert not workdir.exists()



@pytest.mark.parametrize("folder,message", [
    ("missing", "does not exist"),
    ("empty", "holds no readable text files"),
    ("one_line", "yields 0 windows of seq_len + 1 = 129 tokens, fewer than one global batch of 16"),
])
def test_bad_data_leaves_the_workdir_as_it_was(tmp_path, folder, message, capsys):
  # The local_text build writes under <workdir>/data before the folder or its size is found
  # wanting; all of it goes again, and a workdir that was there keeps what it held. In process
  # (the command's main, as train.py runs it): the one sentence and the exit code are its own.
  data = tmp_path / folder
  if folder != "missing":
    data.mkdir()
  if folder == "one_line":
    (data / "a.py").write_text("print('hi')\n")
  fresh, kept = tmp_path / "fresh", tmp_path / "kept"
  kept.mkdir()
  (kept / "notes.txt").write_text("mine")
  for wd in (fresh, kept):
    code = train_command.main(["--mesh", "8x1x1", "--set", f"data.path={data}", "--workdir",
                               str(wd), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
  assert not fresh.exists()
  assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_output_paths_taken_by_the_other_kind_are_refused_before_any_work(tmp_path, capsys):
  a_file = tmp_path / "a_file"
  a_file.write_text("mine")
  cases = [(["--workdir", str(a_file)], f"--workdir {a_file} is a file"),
           (["--workdir", str(a_file / "wd")], f"cannot be made: {a_file} is a file"),
           (["--workdir", str(tmp_path / "wd"), "--metrics-file", str(tmp_path)],
            f"--metrics-file {tmp_path} is a folder"),
           (["--workdir", str(tmp_path / "wd"), "--metrics-file", str(a_file / "m.jsonl")],
            f"cannot be made: {a_file} is a file"),
           # places that refuse new entries (as root too): tried before any work, not at the end
           (["--workdir", "/proc/jaxpar_wd"], "--workdir /proc/jaxpar_wd cannot be written"),
           (["--workdir", str(tmp_path / "wd"), "--metrics-file", "/proc/jaxpar_m.jsonl"],
            "--metrics-file /proc/jaxpar_m.jsonl cannot be written")]
  for args, message in cases:
    code = train_command.main(["--mesh", "8x1x1", *args, "--set", "data.source=synthetic",
                               "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and a_file.read_text() == "mine"


def test_a_bad_flag_is_one_line_not_the_usage(tmp_path):
  r = train("--steps", "abc", "--workdir", str(tmp_path / "wd"))
  assert r.returncode == 2
  assert r.stderr.splitlines() == ["error: argument --steps: invalid int value: 'abc'"]
  assert not (tmp_path / "wd").exists()


def test_a_prefix_of_a_flag_is_refused_by_every_command(capsys):
  """train's `--step 5` is not taken for `--steps 5` (export and generate use --step for a
  checkpoint), nor any other prefix of a flag, by any command."""
  from jaxpar.commands import dataset, export, generate, launch, plan
  for main, argv, said in (
      (train_command.main, ["--step", "5", "--print-config"], "unrecognized arguments: --step 5"),
      (plan.main, ["--mesh", "1x1x1", "--print-conf"], "unrecognized arguments: --print-conf"),
      (export.main, ["--work", "wd", "--out", "x.safetensors"], "--workdir"),
      (generate.main, ["--work", "wd"], "--workdir"),
      (dataset.main, ["images", "src", "--data", "d", "--name", "n"], "--data-dir"),
      (launch.main, ["--proc", "2", "--", "true"], "--processes")):
    with pytest.raises(SystemExit) as e:
      main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and said in err[0], (argv, err)


def test_mesh_larger_than_devices_is_exit_2(tmp_path):
  r = train("--mesh", "2x4x1", "--workdir", str(tmp_path / "wd"),
            env_extra={"XLA_FLAGS": f"{FAST_XLA} --xla_force_host_platform_device_count=4"})
  assert r.returncode == 2
  assert "mesh 2x4x1 needs 8 devices, found 4 (data=2, model=4, pipeline=1)" in r.stderr
  assert not (tmp_path / "wd").exists()


def test_short_run_writes_metrics_tensorboard_and_checkpoint(tmp_path):
  wd, mf = tmp_path / "wd", tmp_path / "metrics.jsonl"
  r = train("--mesh", "2x2x1", "--workdir", str(wd), "--metrics-file", str(mf), "--steps", "6",
            "--no-progress", "--set", "data.source=synthetic", *TINY)
  assert r.returncode == 0, r.stderr
  assert "simulating 4 CPU devices" in r.stderr
  rows = [json.loads(l) for l in mf.read_text().splitlines()]
  steps = [row for row in rows if not row.get("final")]
  assert [row["step"] for row in steps] == [2, 4, 6]
  for row in steps:
    for key in ("step", "loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_sec", "mfu"):
      assert isinstance(row[key], (int, float)), key
  final = rows[-1]
  assert final["final"] is True and final["steps"] == 6 and final["tokens_per_sec"] > 0
  assert "rate_includes_warmup" not in final  # steps 3-6 were timed, the warm-up's 1-2 not
  assert list((wd / "tb").iterdir())
  assert (wd / "checkpoints").exists()


def test_a_run_within_its_first_log_interval_still_reports_its_rate(tmp_path):
  # Two steps with train.log_every=2: no interval after the warm-up one. The rate is then over
  # both steps, said so, rather than 0 tokens/s and 0% MFU.
  mf = tmp_path / "metrics.jsonl"
  r = train("--workdir", str(tmp_path / "wd"), "--metrics-file", str(mf), "--steps", "2",
            "--no-progress", "--set", "data.source=synthetic", *TINY)
  assert r.returncode == 0, r.stderr
  final = json.loads(mf.read_text().splitlines()[-1])
  assert final["tokens_per_sec"] > 0 and final["mfu"] > 0 and final["rate_includes_warmup"] is True
  assert "the first one's warm-up included" in r.stdout, r.stdout


# What a bare accelerator image lacks (jax, flax, optax and orbax preinstalled, nothing else):
# a run on synthetic data must not need any of it.
BARE_IMAGE_LACKS = ("tensorflow_datasets", "grain", "array_record", "tensorboardX", "tqdm")


def test_a_synthetic_run_needs_none_of_the_optional_packages(tmp_path):
  mf = tmp_path / "metrics.jsonl"
  code = (f"import sys, runpy\nfor name in {BARE_IMAGE_LACKS!r}: sys.modules[name] = None\n"
          f"sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')")
  r = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "train.py"),
                      "--workdir", str(tmp_path / "wd"), "--metrics-file", str(mf), "--steps", "2",
                      "--set", "data.source=synthetic", *TINY],
                     capture_output=True, text=True, timeout=300, env=child_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert "note: tensorboardX is not installed, so no TensorBoard events are written" in r.stderr
  assert "note: tqdm is not installed, so no progress bar is shown" in r.stderr
  assert json.loads(mf.read_text().splitlines()[-1])["final"] is True
  assert not (tmp_path / "wd" / "tb").exists()
