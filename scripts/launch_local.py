"""python scripts/launch_local.py --processes N -- scripts/train.py [...]: jaxpar-launch from a
checkout (jaxpar/commands/launch.py)."""
from __future__ import annotations

import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar.commands.launch import (  # noqa: E402,F401  (tests use these by this path)
    Launcher, Prefixer, child_env, free_port, main, mesh_devices)


if __name__ == "__main__":
  sys.exit(main())
