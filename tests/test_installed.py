"""jaxpar as a user who installed it meets it: a wheel built from the package, installed with its
console scripts into a fresh virtual environment, run from a folder outside the checkout.

The dependencies come from this environment's site-packages on PYTHONPATH: entries there are not
searched for .pth files, so the editable install's path to this checkout is not picked up, and
the test checks that jaxpar is imported from the new environment.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest
from conftest import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["data.source=synthetic", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
        "model.d_ff=64", "model.seq_len=16", "train.batch_size=4"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(the new environment's bin folder, a folder outside the checkout, the environment to run in)."""
  tmp = tmp_path_factory.mktemp("installed")
  src = tmp / "src"  # a copy: building in the checkout would leave build/ and egg-info there
  src.mkdir()
  shutil.copytree(ROOT / "jaxpar", src / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  # setuptools' own PEP 517 hook, offline (pip 23.2's `pip wheel --no-build-isolation` fails in
  # setuptools 84's bdist_wheel here before it writes anything)
  build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                          "print(build_meta.build_wheel(sys.argv[1]))", str(tmp / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stderr[-3000:]
  wheel = tmp / "dist" / build.stdout.split()[-1]
  venv = tmp / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
  python = venv / "bin" / "python"
  pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
  assert pip.returncode == 0, pip.stderr[-3000:]
  env = child_env("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
  paths = sysconfig.get_paths()
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
  where = tmp / "elsewhere"
  where.mkdir()
  return venv / "bin", where, env


def run(argv, installed, timeout=300):
  _, where, env = installed
  return subprocess.run([str(a) for a in argv], cwd=where, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_the_wheel_installs_every_command_and_jaxpar_from_itself(installed):
  bin_dir, _, _ = installed
  for name in ("train", "plan", "launch", "export", "generate", "dataset"):
    assert os.access(bin_dir / f"jaxpar-{name}", os.X_OK), f"no console script jaxpar-{name}"
  r = run([bin_dir / "python", "-c", "import jaxpar; print(jaxpar.__file__)"], installed)
  assert r.returncode == 0, r.stderr
  where = pathlib.Path(r.stdout.strip()).resolve()
  assert where.is_relative_to(bin_dir.parent.resolve()), where
  assert not where.is_relative_to(ROOT), where


def test_installed_train_plan_and_python_m(installed, tmp_path):
  bin_dir, _, _ = installed
  metrics = tmp_path / "m.jsonl"
  r = run([bin_dir / "jaxpar-train", "--mesh", "1x1x1", "--steps", "2", "--workdir",
           tmp_path / "w", "--no-progress", "--metrics-file", metrics, "--set", *TINY], installed)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "steps: 2" in r.stdout, r.stdout
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert rows[-1]["final"] and [row["step"] for row in rows[:-1]][-1] == 2, rows
  assert (tmp_path / "w" / "checkpoints").is_dir()

  r = run([bin_dir / "jaxpar-plan", "--mesh", "1x1x1", "--json", "--set", *TINY], installed)
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout)
  assert {"devices", "mesh", "param_count", "bytes_per_device", "compiled", "collectives",
          "flops_per_step"} <= set(report), sorted(report)
  assert set(report["bytes_per_device"]) >= {"params", "grads", "opt_state"}

  # bad input: one sentence and exit 2, in each spelling (nothing runs, so these are quick)
  for argv in ([bin_dir / "python", "-m", "jaxpar", "train", "--mesh", "3y"],
               [bin_dir / "jaxpar-plan", "--mesh", "1x1x1", "--set", "model.bogus=1"],
               [bin_dir / "jaxpar-launch", "--processes", "0", "--", "jaxpar-train"],
               [bin_dir / "python", "-m", "jaxpar", "no-such-command"]):
    r = run(argv, installed)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, r.stderr)
