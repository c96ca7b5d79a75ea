"""The fields of a run's output that docs/output.md must name: every key of a metrics row and of
the final row, and the label of every summary line. Used by the tests whose runs write them
(test_goodput's summary, test_moe's metrics file) and by tests/test_output_page.py."""
import pathlib
import re

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "output.md"


def named() -> set[str]:
  """Every `code` span of the page's tables (a field or a summary line's label)."""
  rows = [line for line in PAGE.read_text().splitlines() if line.startswith("|")]
  return {name.rstrip(":") for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def generic(key: str) -> str:
  """moe_load/03 -> moe_load/NN; eval_<anything> -> eval_<metric>."""
  key = re.sub(r"/\d+$", "/NN", key)
  return "eval_<metric>" if key.startswith("eval_") else key


def undocumented(rows: list[dict], summary_text: str = "") -> list[str]:
  """The fields of `rows` (metrics rows, the final row) and the labels of `summary_text`'s lines
  that docs/output.md does not name."""
  keys = {generic(k) for row in rows for k in row}
  labels = {line.split(":")[0] for line in summary_text.splitlines() if ":" in line}
  labels = {generic(label) for label in labels if label != "what each line means"}
  labels = {"profile" if label.startswith("profile steps") else label for label in labels}
  return sorted((keys | labels) - named())
