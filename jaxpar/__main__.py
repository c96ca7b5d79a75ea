"""python -m jaxpar COMMAND [ARGS ...]: the console script jaxpar-COMMAND, from any Python that
can import jaxpar (no installed script on PATH needed)."""
from __future__ import annotations

import importlib
import sys

from jaxpar.commands import NAMES

USAGE = f"python -m jaxpar {{{','.join(NAMES)}}} [ARGS ...]; ARGS --help for a command's own"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] in (["-h"], ["--help"]):
    print(f"usage: {USAGE}")
    return 0
  if not argv or argv[0] not in NAMES:
    what = f"{argv[0]!r} is not a jaxpar command" if argv else "give a jaxpar command"
    print(f"error: {what}; choose one of {', '.join(NAMES)}: {USAGE}", file=sys.stderr)
    return 2
  sys.argv[0] = f"python -m jaxpar {argv[0]}"  # argparse's name for the program in its messages
  return importlib.import_module(f"jaxpar.commands.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
  sys.exit(main())
