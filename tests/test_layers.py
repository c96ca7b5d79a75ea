"""The package's shape: the layers in pyproject.toml hold (import-linter), every top-level module
or folder is in them, an import upward is caught, and the rules the layers leave to review are
checked here (config.py is a leaf, no module over 600 lines, no unexplained lazy import)."""
import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"
LINT = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))


def _contracts() -> list[dict]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def _modules() -> list[pathlib.Path]:
  return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
  assert LINT, "import-linter is a test dependency (pip install -e '.[test]')"
  return subprocess.run([LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                        timeout=120)


def test_every_top_level_module_and_folder_is_a_layer():
  layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
  named = {name.strip() for line in layers for name in line.split("|")}
  present = {f"jaxpar.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
  present |= {f"jaxpar.{p.name}" for p in PACKAGE.iterdir()
              if p.is_dir() and (p / "__init__.py").exists()}
  assert named == present


def test_the_layers_hold_and_an_upward_import_is_caught(tmp_path):
  r = _lint(ROOT)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "2 kept, 0 broken" in r.stdout
  # The same tree with one import upward: the parallel layer reaching into the training loop.
  shutil.copytree(PACKAGE, tmp_path / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  zero = tmp_path / "jaxpar" / "parallel" / "zero.py"
  zero.write_text(zero.read_text() + "\nfrom jaxpar.train import loop  # noqa: E402\n")
  r = _lint(tmp_path)
  assert r.returncode != 0
  assert "jaxpar.parallel is not allowed to import jaxpar.train" in r.stdout
  assert "jaxpar.parallel.zero -> jaxpar.train.loop" in r.stdout


def test_an_import_circle_inside_a_layer_is_caught(tmp_path):
  shutil.copytree(PACKAGE, tmp_path / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  mesh = tmp_path / "jaxpar" / "parallel" / "mesh.py"  # zero imports mesh; now mesh imports zero
  mesh.write_text(mesh.read_text() + "\nfrom jaxpar.parallel import zero  # noqa: E402\n")
  r = _lint(tmp_path)
  assert r.returncode != 0
  assert "No cycles are allowed in jaxpar.parallel" in r.stdout


def test_config_is_a_leaf():
  tree = ast.parse((PACKAGE / "config.py").read_text())
  imported = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in getattr(n, "names", [])]
  assert not [m for m in imported if m and m.split(".")[0] == "jaxpar"]


def test_no_module_is_over_600_lines():
  long = {str(p.relative_to(ROOT)): n for p in _modules()
          if (n := len(p.read_text().splitlines())) > 600}
  assert not long


def test_the_training_loop_reads_in_one_screen():
  tree = ast.parse((PACKAGE / "train" / "loop.py").read_text())
  run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
  assert run.end_lineno - run.lineno + 1 <= 60


def _lazy_jaxpar_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, text) of each import of a jaxpar module inside a function or class body."""
  source = path.read_text()
  lines = source.splitlines()
  tree = ast.parse(source)
  top = set(map(id, tree.body))
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpar"):
      names = [node.module]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.startswith("jaxpar")]
    else:
      continue
    if names and id(node) not in top:
      out.append((node.lineno, lines[node.end_lineno - 1]))
  return out


def test_every_lazy_import_of_a_jaxpar_module_says_why():
  # Allowed only where the import is lazy on purpose (JAX must not start before the simulated
  # device count is set, an optional heavy dependency), and the line's comment says so.
  unexplained = [f"{p.relative_to(ROOT)}:{n}: {text.strip()}" for p in _modules()
                 for n, text in _lazy_jaxpar_imports(p) if "#" not in text]
  assert not unexplained
