"""docs/output.md names every field a run writes (test_goodput's and test_moe's runs check their
own rows against it with output_fields.undocumented), and no paragraph of the guides runs on."""
import pathlib
import re

from output_fields import named, undocumented

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
