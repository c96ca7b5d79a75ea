"""MkDocs hooks (mkdocs.yml): the repository's own README.md, BUILD.md and ARCHITECTURE.md become
pages of the site, and links are rewritten between the two places the pages live.

On GitHub a guide links `../BUILD.md` and the README `docs/own-model.md`; in the site every page
sits in one folder (README.md as index.md, BUILD.md as build.md). The rewrite happens before
MkDocs resolves links, so `mkdocs build --strict` still checks every target and anchor.
"""
from __future__ import annotations

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = {"README.md": "index.md", "BUILD.md": "build.md", "ARCHITECTURE.md": "architecture.md"}
_TOP = re.compile(r"\]\((?:\.\./)?(README|BUILD|ARCHITECTURE)\.md")


def on_files(files, config):
  for name, uri in PAGES.items():
    files.append(File.generated(config, uri, abs_src_path=str(ROOT / name)))
  return files


def on_page_markdown(markdown: str, page, config, files) -> str:
  markdown = _TOP.sub(lambda m: "](" + PAGES[m.group(1) + ".md"], markdown)
  if page.file.src_uri in PAGES.values():  # a top-level file: its links into docs/ lose docs/
    markdown = markdown.replace("](docs/", "](")
  return markdown
