"""python scripts/plan.py --mesh DxMxP [...]: jaxpar-plan from a checkout (jaxpar/commands/plan.py)."""
from __future__ import annotations

import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar.commands.plan import autoplan_kinds, main  # noqa: E402,F401


if __name__ == "__main__":
  sys.exit(main())
