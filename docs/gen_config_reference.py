"""Writes docs/config.md, every key of jaxpar/config.py with its type, default and meaning.

The meaning of a field is the comment block directly above it (no blank line between) and the
comment on its own line; a field with neither points to the nearest field above it that has a
block, which describes a group. `python docs/gen_config_reference.py --check` exits 1 when
docs/config.md differs from what the code gives (tests/test_config_reference.py runs it).
"""
from __future__ import annotations

import ast
import dataclasses
import io
import pathlib
import sys
import tokenize
import typing

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's jaxpar, installed or not

from jaxpar import config  # noqa: E402

SOURCE = ROOT / "jaxpar" / "config.py"
PAGE = ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

Every key of the run's configuration, its type, its default and what it means. This page is
generated from the dataclasses of `jaxpar/config.py` and the comments beside their fields by
`python docs/gen_config_reference.py`; `tests/test_config_reference.py` fails when the page and
the code differ. Set a key with `--set section.key=value` or in a YAML file given to `--config`
(only what differs from the defaults, e.g. `train: {steps: 10}`); an unknown key, a wrong type
or a value out of range is one sentence and exit code 2. `--print-config` on `train.py` and
`plan.py` prints the resolved configuration as YAML and exits without training.
"""


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
  """{line: comment text} of every comment, and the lines that hold nothing but a comment."""
  text, code = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      text[tok.start[0]] = tok.string.lstrip("#").strip()
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      code.add(tok.start[0])
  return text, set(text) - code


def meanings(source: str) -> dict[str, str]:
  """{'section.key': meaning} for the fields of the section classes in `source`."""
  comments, alone = _comments(source)
  classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
  out = {}
  for section in dataclasses.fields(config.Config):
    group = None  # the nearest field above with a block of its own
    for node in classes[section.default_factory.__name__].body:
      if not isinstance(node, ast.AnnAssign):
        continue
      key, line = f"{section.name}.{node.target.id}", node.lineno
      block, above = [], line - 1
      while above in alone:
        block.insert(0, comments[above])
        above -= 1
      own = " ".join(block + ([comments[line]] if line in comments and line not in alone else []))
      if block:
        group = key
      out[key] = own or (f"see `{group}`" if group else "")
  return out


def _default(value) -> str:
  return f'`"{value}"`' if isinstance(value, str) else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def render(source: str | None = None) -> str:
  meaning = meanings(SOURCE.read_text() if source is None else source)
  parts = [HEADER]
  for section in dataclasses.fields(config.Config):
    cls = section.default_factory
    hints = typing.get_type_hints(cls)
    parts.append(f"\n## {section.name}\n\n")
    for f in dataclasses.fields(cls):
      key = f"{section.name}.{f.name}"
      text = meaning[key].replace("&", "&amp;").replace("<", "&lt;")  # markdown reads <x> as HTML
      parts.append(f"- `{key}` ({hints[f.name].__name__}, default {_default(f.default)}): "
                   f"{text}\n")
  return "".join(parts)


def main(argv: list[str]) -> int:
  page = render()
  if "--check" in argv:
    if PAGE.read_text() != page:
      print(f"{PAGE.relative_to(ROOT)} differs from jaxpar/config.py: run python "
            f"docs/gen_config_reference.py", file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(page)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
