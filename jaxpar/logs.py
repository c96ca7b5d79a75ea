"""Logging helpers every layer may use: the dependencies' warnings about what jaxpar does on
purpose held back (`quiet_absl`)."""
from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_absl():
  """absl's warnings held back for a block: orbax and TFDS warn through absl about what jaxpar
  does on purpose (a read-only checkpoint manager, a dataset built from a local folder)."""
  log = logging.getLogger("absl")
  level = log.level
  log.setLevel(logging.ERROR)
  try:
    yield
  finally:
    log.setLevel(level)
