"""Datasets built from a user's files at train time: a fingerprint of the files kept in the build,
so a build is reused only while its files are unchanged, and one process at a time builds.

A build is made in a temporary folder and renamed into place with its stamp inside, so a folder
holding a stamp is a whole build; processes sharing a data dir take turns under a file lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterable, Iterator

STAMP = "source.sha256"


def fingerprint(header: str, root: str, rels: Iterable[str]) -> str:
  """sha256 of `header` and each file's (path relative to root, size, mtime): it changes when a
  file is added, removed, resized or written to, without reading the files."""
  h = hashlib.sha256(f"{header}\n".encode())
  for rel in rels:
    st = os.stat(os.path.join(root, rel))
    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
  return h.hexdigest()


def read(folder: str) -> str:
  """The stamp kept in a build's folder; '' when there is none (no build, or an older one)."""
  try:
    with open(os.path.join(folder, STAMP)) as f:
      return f.read()
  except OSError:
    return ""


def write(folder: str, stamp: str) -> None:
  with open(os.path.join(folder, STAMP), "w") as f:
    f.write(stamp)


@contextlib.contextmanager
def locked(folder: str, name: str) -> Iterator[None]:
  """Holds `folder/.name.lock` exclusively: processes building the same dataset take turns."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, f".{name}.lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
