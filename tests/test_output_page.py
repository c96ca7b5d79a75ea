"""docs/output.md names every field a run writes (test_goodput's and test_moe's runs check their
own rows against it with output_fields.undocumented), and no paragraph of the guides runs on."""
import pathlib
import re

from output_fields import named, undocumented
from test_docs import commands_in

from jaxpar.train import metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A paragraph of a guide is at most this many lines: longer ones go into lists or tables.
PARAGRAPH_LINES = 8


def paragraphs(text: str) -> list[tuple[int, int]]:
  """(first line, number of lines) of each paragraph of markdown prose: runs of text lines
  outside code blocks, cut at blank lines, headings, tables, comments and list items."""
  out, start, n, fence = [], 0, 0, False
  for i, line in enumerate(text.splitlines(), 1):
    s = line.strip()
    if s.startswith("```"):
      fence = not fence
    item = re.match(r"([-*+]|\d+\.)\s", s)
    if fence or s.startswith("```") or not s or s.startswith(("|", "#", "<!--")) or item:
      if n:
        out.append((start, n))
      start, n = i, (1 if item and not fence else 0)
      continue
    start, n = (i, 1) if not n else (start, n + 1)
  if n:
    out.append((start, n))
  return out


def test_no_paragraph_of_a_guide_runs_past_the_stated_lines():
  long = [f"{p.relative_to(ROOT)}:{start} ({n} lines)"
          for p in sorted((ROOT / "docs").glob("*.md"))
          for start, n in paragraphs(p.read_text()) if n > PARAGRAPH_LINES]
  assert not long, f"paragraphs over {PARAGRAPH_LINES} lines: {long}"


def test_the_paragraph_count_sees_a_long_paragraph_and_a_long_list_item():
  text = "# t\n\n" + "word\n" * 9 + "\n- item\n" + "  more\n" * 9 + "\n```\n" + "code\n" * 20 + "```\n"
  assert [n for _, n in paragraphs(text)] == [9, 10]


# Pages whose walkthroughs show commands the docs test cannot run as they stand: lookups rather
# than tasks (a refusal, the test suite). docs/config.md is generated from config.py.
NO_SCRIPT_WALKTHROUGH = {"contributing.md", "troubleshooting.md"}
FIRST_SCREEN = 40  # lines: a guide's first command is on its first screen


def test_every_guide_opens_with_a_walkthrough_whose_commands_the_docs_test_runs():
  for page in sorted((ROOT / "docs").glob("*.md")):
    if page.name == "config.md":
      continue
    text = page.read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    assert sections[1].startswith("Walkthrough"), f"{page.name}: the first section is not a walkthrough"
    if page.name in NO_SCRIPT_WALKTHROUGH:
      continue
    runs = commands_in(sections[1])
    assert runs, f"{page.name}: its walkthrough has no command the docs test runs"
    first = runs[0].split(":")[1] if runs[0].startswith("example:") else runs[0]
    line = next(i for i, l in enumerate(text.splitlines(), 1) if first in l)
    assert line <= FIRST_SCREEN, f"{page.name}: its first command is on line {line}"


def test_the_summary_text_points_to_the_page_and_each_line_is_named():
  s = {"steps": 4, "tokens_per_sec": 10.0, "mfu": 0.1, "peak_flops_per_device": 1e9,
       "peak_flops_source": "x", "peak_memory_bytes": 5, "wall_s": 2.0, "goodput": 0.5,
       "time_s": {"startup": 1.0, "compile": 0.5, "steps": 0.5}, "compile_cache": "hit",
       "rate_includes_warmup": True, "nothing_to_train": True,
       "profile": {"steps": [1, 2], "traced_steps": 0}}
  text = metrics.format_summary(s)
  assert text.splitlines()[-1] == f"what each line means: {metrics.OUTPUT_PAGE}"
  assert (ROOT / metrics.OUTPUT_PAGE).exists()
  assert undocumented([s], text) == []
  assert "nothing_to_train" in named() and "what" not in named()
  assert undocumented([{"not_a_field": 1}]) == ["not_a_field"]
