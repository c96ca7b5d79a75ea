"""python scripts/dataset.py images SOURCE --data-dir DIR --name NAME: jaxpar-dataset from a
checkout (jaxpar/commands/dataset.py)."""
from __future__ import annotations

import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar.commands.dataset import main  # noqa: E402


if __name__ == "__main__":
  sys.exit(main())
