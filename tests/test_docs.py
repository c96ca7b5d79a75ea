"""README.md and BUILD.md as a new user meets them: every command a CPU machine can run, in the
order written, in one fresh folder; then the plain-orbax snippet on the checkpoint they left.

Commands are taken from the docs' ```bash blocks (lines that start with `python scripts/`, and the
part of README's first command after its install). Training commands get `--steps 4` and a small
text cap so the sequence takes a minute; that is the only change, and it is the same for all, so
what one command leaves in a workdir is what the next one finds there.
"""
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

from conftest import child_env

from jaxpar.commands import plan as plan_command
from jaxpar.commands import train as train_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["--steps", "4", "--no-progress", "--set", "data.max_bytes=300000"]


def commands(doc: str) -> list[str]:
  """`python scripts/...` lines of the doc's bash blocks, in order, plus its marked examples."""
  out = []
  for block in re.finditer(r"```bash\n(.*?)```|<!-- example: (\w+) -->", (ROOT / doc).read_text(), re.S):
    if block.group(2):
      out.append(f"example:{block.group(2)}")
      continue
    previous = ""
    for raw in block.group(1).splitlines():
      continued, previous = previous.endswith("\\"), raw.rstrip()
      line = raw.split("#")[0].strip()
      if continued:  # the rest of another command (srun, mpirun: not for one CPU machine)
        continue
      if "pip install" in line and "&& python scripts/" in line:
        line = line[line.index("python scripts/"):]
      if line.startswith("python scripts/"):
        out.append(line)
  return out


def example(doc: str, name: str) -> str:
  m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
  return m.group(1)


def fast(argv: list[str]) -> list[str]:
  """Training commands (also behind launch_local's `--`) run 4 steps on a small text cap."""
  return argv + FAST if "scripts/train.py" in argv else argv


# Commands whose mesh has this process's 8 devices run in it (their main, in the same folder),
# which saves each a Python and JAX start-up; the others pick their own device count.
IN_PROCESS = {"scripts/train.py": train_command.main, "scripts/plan.py": plan_command.main}


def _devices(mesh: str) -> int:
  return math.prod(int(n) for n in mesh.split("x"))


def in_process(argv, folder, monkeypatch, capsys) -> subprocess.CompletedProcess:
  monkeypatch.chdir(folder)
  capsys.readouterr()
  code = IN_PROCESS[argv[0]](argv[1:])
  out = capsys.readouterr()
  return subprocess.CompletedProcess(argv, code, out.out, out.err)


def test_docs_commands_run_in_order(tmp_path, monkeypatch, capsys):
  for d in ("scripts", "configs"):
    os.symlink(ROOT / d, tmp_path / d)
  env = child_env("JAX_PLATFORMS")
  sequence = [("README.md", c) for c in commands("README.md")] + \
             [("BUILD.md", c) for c in commands("BUILD.md")]
  ran = [c for _, c in sequence]
  assert ran[0] == "python scripts/train.py --mesh 2x4x1", ran  # the main job comes first
  assert any("launch_local.py" in c for c in ran) and any("generate.py" in c for c in ran)
  assert "example:orbax" in ran
  for doc, cmd in sequence:
    if cmd.startswith("example:"):
      name = cmd.split(":")[1]
      if name != "orbax":  # the README's own-model examples are run by test_readme.py
        continue
      r = subprocess.run([sys.executable, "-c", example(doc, name)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    else:
      argv = fast(shlex.split(cmd)[1:])
      r = (in_process(argv, tmp_path, monkeypatch, capsys) if argv[0] in IN_PROCESS
           and "--mesh" in argv and _devices(argv[argv.index("--mesh") + 1]) == 8
           else subprocess.run([sys.executable] + argv, cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600))
    what = f"{doc}: {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, what
    assert "Traceback" not in r.stderr, what
    if "scripts/train.py" in cmd:  # each trains: no silent resume of another run's checkpoint
      assert "resuming" not in r.stdout and "nothing to train" not in r.stdout, what
      assert "steps: 4" in r.stdout, what
    if "--deepspeed" in cmd:  # the mapping it printed and what it cannot honour
      assert "-> precision.loss_scale = dynamic" in r.stdout, what
      assert ("warning: deepspeed: zero_optimization.overlap_comm=true is not honoured"
              in r.stderr), what

  # The next two end before any compile: in process (the command's main, in the same folder).
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  # the main job again: its checkpoint is at --steps, so one line and exit 0
  code = train_command.main(["--mesh", "2x4x1", *FAST])
  again = capsys.readouterr()
  assert code == 0 and "nothing to train" in again.out, again.err
  # another model in the same workdir: one sentence naming the key, exit 2, nothing written
  before = sorted(p.name for p in (tmp_path / "workdir" / "checkpoints").iterdir())
  code = train_command.main(["--mesh", "2x4x1", *FAST, "model.n_layers=2"])
  other = capsys.readouterr()
  errors = [l for l in other.err.splitlines() if l.startswith("error:")]
  assert code == 2 and len(errors) == 1 and "model.n_layers=4->2" in errors[0], other.err
  assert "--workdir" in errors[0] and "Traceback" not in other.err
  assert sorted(p.name for p in (tmp_path / "workdir" / "checkpoints").iterdir()) == before


# The docs' Python examples that other test files run (in process, against references); the
# sequence above runs `orbax` itself.
RUN_BY = {"nnx": "test_readme.py", "linen": "test_readme.py", "nnx-checkpoint": "test_readme.py",
          "linen-checkpoint": "test_readme.py", "own-optimizer": "test_own_optimizer.py"}


def test_every_example_is_run_by_a_test():
  for doc in ("README.md", "BUILD.md"):
    for name in re.findall(r"<!-- example: ([\w-]+) -->", (ROOT / doc).read_text()):
      if name == "orbax":
        continue
      assert name in RUN_BY, f"{doc}'s example {name} is run by no test: add it to RUN_BY"
      test = (ROOT / "tests" / RUN_BY[name]).read_text()
      assert f'"{name}"' in test or f"example: {name} -->" in test, (name, RUN_BY[name])
