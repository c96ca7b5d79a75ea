"""The README, the guides in docs/ (in the site's order, mkdocs.yml's nav) and BUILD.md as a new
user meets them: every command a CPU machine can run, in the order written, in one fresh folder;
the plain-orbax snippet on the checkpoint they left; and the site, built strictly.

Commands are taken from the docs' ```bash blocks (lines that start with `python scripts/`, and the
part of README's first command after its install) and from table cells that hold one (the
README's task index). A command met a second time (the index's, again in its guide) runs once.
Training commands get `--steps 4` and a small text cap so the sequence takes a minute; that is
the only change, and it is the same for all, so what one command leaves in a workdir is what the
next one finds there. A training command on a workdir trained before in the sequence is a
restart: it gets 4 steps more than that workdir holds, and must say it resumes.
"""
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

import yaml
from conftest import child_env

from jaxpar.commands import dataset as dataset_command
from jaxpar.commands import export as export_command
from jaxpar.commands import plan as plan_command
from jaxpar.commands import train as train_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["--steps", "4", "--no-progress", "--set", "data.max_bytes=300000"]
# Site pages that are the repository's own files (docs/hooks.py), not files in docs/.
TOP = {"index.md": "README.md", "build.md": "BUILD.md", "architecture.md": "ARCHITECTURE.md"}


def docs() -> list[str]:
  """README.md, the guides in the site's order, BUILD.md: the order a new user reads them."""
  site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
  pages = [page for entry in site["nav"] for page in entry.values()]
  guides = [f"docs/{page}" for page in pages if page not in TOP]
  assert sorted(guides) == sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
  return ["README.md", *guides, "BUILD.md"]


def commands(doc: str) -> list[str]:
  """`python scripts/...` lines of the doc's bash blocks and table cells, in order, plus its
  marked examples."""
  return commands_in((ROOT / doc).read_text())


def commands_in(text: str) -> list[str]:
  """commands() of a doc's text, or of a part of it."""
  out = []
  for block in re.finditer(r"```bash\n(.*?)```|<!-- example: ([\w-]+) -->|^\|[^\n]*?\| `(python scripts/[^`]+)` \|",
                           text, re.S | re.M):
    if block.group(2):
      out.append(f"example:{block.group(2)}")
      continue
    if block.group(3):
      out.append(block.group(3))
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
# which saves each a Python and JAX start-up; so do plan.py's searches of 8 devices (--auto
# --devices 8) and of none (--analytic: formulas only), export.py (it reads the checkpoint as
# whole numpy arrays, on no mesh) and dataset.py (no JAX); the others pick their own device count
# (generate.py on one device too: it checks the mesh against the devices it finds).
IN_PROCESS = {"scripts/train.py": train_command.main, "scripts/plan.py": plan_command.main,
              "scripts/export.py": export_command.main,
              "scripts/dataset.py": dataset_command.main}


def _devices(mesh: str) -> int:
  return math.prod(int(n) for n in mesh.split("x"))


def here(argv: list[str]) -> bool:
  """Whether the command runs in this process: its devices are this process's 8, or none."""
  if argv[0] not in IN_PROCESS:
    return False
  if argv[0] in ("scripts/export.py", "scripts/dataset.py"):
    return True
  if "--mesh" in argv:
    return _devices(argv[argv.index("--mesh") + 1]) == 8
  if argv[0] == "scripts/plan.py" and "--analytic" in argv:
    return True
  return "--auto" in argv and "--devices" in argv and argv[argv.index("--devices") + 1] == "8"


def _exit(code):
  raise SystemExit(code)


def in_process(argv, folder, monkeypatch, capsys) -> subprocess.CompletedProcess:
  monkeypatch.chdir(folder)
  capsys.readouterr()
  # the scripts end the process at once after a signal or a RunError (cli.guard): here that is
  # the exit code the test reads, not the end of the test session
  with monkeypatch.context() as m:
    m.setattr(os, "_exit", _exit)
    try:
      code = IN_PROCESS[argv[0]](argv[1:])
    except SystemExit as e:
      code = e.code
  out = capsys.readouterr()
  return subprocess.CompletedProcess(argv, code, out.out, out.err)


def deepspeed_mapping(path, data: int) -> dict:
  """What README's DeepSpeed table says the documented ds_config (ZeRO-3, offload, fp16 with a
  dynamic scale, AdamW, WarmupDecayLR) becomes on a mesh of `data` data shards: {jaxpar key:
  value}, read from the JSON here, not from jaxpar/interop/deepspeed.py."""
  text = "".join(l for l in pathlib.Path(path).read_text().splitlines(True)
                 if not l.lstrip().startswith("//"))
  ds = json.loads(text)
  micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
  assert ds["train_batch_size"] == micro * accum * data  # the docs' JSON is consistent
  fp16, opt = ds["fp16"], ds["optimizer"]["params"]
  sched, zero = ds["scheduler"]["params"], ds["zero_optimization"]
  assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # 0: dynamic
  return {"train.batch_size": micro * accum * data, "train.grad_accum": accum,
          "train.clip_norm": ds["gradient_clipping"], "precision.compute_dtype": "float16",
          "precision.loss_scale": "dynamic",
          "precision.initial_scale": 2.0 ** fp16["initial_scale_power"],
          "precision.growth_interval": fp16["loss_scale_window"],
          "precision.min_scale": fp16["min_loss_scale"],
          "train.b1": opt["betas"][0], "train.b2": opt["betas"][1],
          "train.weight_decay": opt["weight_decay"],
          # WarmupDecayLR's warmup_max_lr is the rate it applies, not the optimizer's lr
          "train.lr": sched["warmup_max_lr"], "train.warmup_steps": sched["warmup_num_steps"],
          "train.steps": sched["total_num_steps"],
          "train.min_lr_ratio": sched["warmup_min_lr"] / sched["warmup_max_lr"],
          "parallel.zero_stage": zero["stage"],
          "parallel.offload_optimizer": zero["offload_optimizer"]["device"] == "cpu"}


def printed_mapping(stdout: str) -> dict:
  """The table `--deepspeed` prints ('DeepSpeed key -> jaxpar key = value' lines) as {key: value},
  numbers as numbers and true/false as bools."""
  rows = re.findall(r"^  \S.*? -> ([\w.]+) = (\S+)$", stdout, re.M)
  assert len(rows) == len(dict(rows)), rows  # no key set twice
  return {k: _value(v) for k, v in rows}


def _value(text: str):
  if text in ("true", "false"):
    return text == "true"
  try:
    return float(text)
  except ValueError:
    return text


def test_the_documented_deepspeed_config_maps_to_the_readme_table(capsys):
  """The mapping the docs' --deepspeed command prints, value by value (this runs its mapping in
  process, without the training that test_docs_commands_run_in_order does)."""
  from jaxpar.interop import deepspeed
  cmd = next(c for c in commands("README.md") if "--deepspeed" in c)
  argv = shlex.split(cmd)
  mesh, ds = (argv[argv.index(flag) + 1] for flag in ("--mesh", "--deepspeed"))
  capsys.readouterr()
  overrides = deepspeed.cli_overrides(str(ROOT / ds), mesh, [])
  want = deepspeed_mapping(ROOT / ds, _devices(mesh))
  assert printed_mapping(capsys.readouterr().out) == want
  # and the --set words it hands the trainer say the same
  assert {k: _value(v) for k, v in (w.split("=", 1) for w in overrides)} == want


def sequence() -> list[tuple[str, str]]:
  """(doc, command) in reading order, each command once (where it first appears)."""
  out, seen = [], set()
  for doc in docs():
    for cmd in commands(doc):
      if cmd not in seen:
        seen.add(cmd)
        out.append((doc, cmd))
  return out


def _workdir(argv: list[str]) -> str:
  return os.path.normpath(argv[argv.index("--workdir") + 1] if "--workdir" in argv else "workdir")


def test_docs_commands_run_in_order(tmp_path, monkeypatch, capsys):
  # jaxpar: the own-data guide trains on its source; examples: the fine-tune guide's records
  for d in ("scripts", "configs", "jaxpar", "examples"):
    os.symlink(ROOT / d, tmp_path / d)
  env = child_env("JAX_PLATFORMS")
  steps = sequence()
  ran = [c for _, c in steps]
  assert ran[0] == "python scripts/train.py --mesh 2x4x1", ran  # the main job comes first
  assert any("launch_local.py" in c for c in ran) and any("generate.py" in c for c in ran)
  assert "example:orbax" in ran
  trained = {}  # workdir -> the step its checkpoint is at
  for doc, cmd in steps:
    restart = False
    if cmd.startswith("example:"):
      name = cmd.split(":")[1]
      if name != "orbax":  # the own-model examples are run by test_readme.py and others
        continue
      r = subprocess.run([sys.executable, "-c", example(doc, name)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    else:
      argv = fast(shlex.split(cmd)[1:])
      if "scripts/train.py" in argv and "--print-config" not in argv:
        restart = _workdir(argv) in trained
        if restart:  # 4 steps past where the workdir's checkpoint is
          argv += ["--steps", str(trained[_workdir(argv)] + 4)]
        trained[_workdir(argv)] = trained.get(_workdir(argv), 0) + 4
      r = (in_process(argv, tmp_path, monkeypatch, capsys) if here(argv)
           else subprocess.run([sys.executable] + argv, cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600))
    what = f"{doc}: {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, what
    assert "Traceback" not in r.stderr, what
    if "--print-config" in cmd:  # the config the run would train, as YAML; nothing trained
      printed = yaml.safe_load(r.stdout)
      assert printed["train"]["steps"] == 4 and printed["data"]["max_bytes"] == 300000, what
    elif restart:  # the workdir's run goes on from its checkpoint
      assert f"resuming from the checkpoint at step {trained[_workdir(argv)] - 4}" in r.stdout, what
      assert f"steps: {trained[_workdir(argv)]}" in r.stdout, what
    elif "scripts/train.py" in cmd:  # each trains: no silent resume of another run's checkpoint
      assert "resuming" not in r.stdout and "nothing to train" not in r.stdout, what
      assert "steps: 4" in r.stdout, what
    if "scripts/train.py" in cmd and "data.source=jsonl" in cmd:  # how its records packed
      assert re.search(r"^data: [\d,]+ records? of train\.jsonl -> [\d,]+ windows? of ",
                       r.stdout, re.M), what
    if "--deepspeed" in cmd:  # the mapping it printed and what it cannot honour
      words = shlex.split(cmd)
      mesh, ds = (words[words.index(flag) + 1] for flag in ("--mesh", "--deepspeed"))
      assert printed_mapping(r.stdout) == deepspeed_mapping(ROOT / ds, _devices(mesh)), what
      assert ("warning: deepspeed: zero_optimization.overlap_comm=true is not honoured"
              in r.stderr), what

  # The next two end before any compile: in process (the command's main, in the same folder).
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  # the main job again: its checkpoint is past --steps, so one line and exit 0
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
  for doc in docs():
    for name in re.findall(r"<!-- example: ([\w-]+) -->", (ROOT / doc).read_text()):
      if name == "orbax":
        continue
      assert name in RUN_BY, f"{doc}'s example {name} is run by no test: add it to RUN_BY"
      test = (ROOT / "tests" / RUN_BY[name]).read_text()
      assert f'"{name}"' in test or f"example: {name} -->" in test, (name, RUN_BY[name])


def test_the_readme_is_short_and_the_site_builds_strictly(tmp_path):
  """A README a newcomer reads in one sitting, and the site (every page, link and anchor) built
  as .ci/run builds it: a broken link, a missing anchor or a page left out of the nav fails."""
  assert len((ROOT / "README.md").read_text().splitlines()) <= 200
  r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "index.html").is_file() and (tmp_path / "build" / "index.html").is_file()
