"""Datasets built from a user's files at train time: a fingerprint of the files kept in the build,
so a build is reused only while its files are unchanged, and one process at a time builds.

A build is made in a temporary folder and renamed into place with its stamp inside, so a folder
holding a stamp is a whole build; processes sharing a data dir take turns under a file lock, whose
holder writes its pid and host into it so that a waiting process can say whom it waits for.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator

from jaxpar.config import RunError

STAMP = "source.sha256"
# What a full disk, a file size limit, a quota or a read-only file system say (as export.writes).
FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)
_POLL_S = 0.2  # how often a waiting process tries the lock again


def shown(path: str) -> str:
  """`path` as text: bytes that are not UTF-8 (which Python holds as surrogates) as \\xNN."""
  return os.fsencode(path).decode("utf-8", "backslashreplace")


def fingerprint(header: str, root: str, rels: Iterable[str]) -> str:
  """sha256 of `header` and each file's (path relative to root, type, size, mtime, ctime,
  inode): it changes when a file is added, removed, replaced or written to, without reading the
  files. The ctime is the kernel's, set on every write and not settable by a user, so an edit in
  place that puts the size and the mtime back (touch -r, rsync -t) still changes it; a chmod or
  chown changes it too, and rebuilds for nothing. One stat per file, as before the ctime was
  added: no byte of a file is read."""
  h = hashlib.sha256(os.fsencode(f"{header}\n"))  # a path in it need not be UTF-8
  for rel in rels:
    st = os.stat(os.path.join(root, rel))
    h.update(os.fsencode(rel) + f"\0{st.st_mode >> 12}\0{st.st_size}\0{st.st_mtime_ns}\0"
                                f"{st.st_ctime_ns}\0{st.st_ino}\n".encode())
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


def _disk_full(e: BaseException | None) -> str | None:
  """What says that `e` (or an exception it came from) is a full disk (FULL); None if nothing.
  array_record's writer says it in words only: RuntimeError('... write() failed: No space left
  on device; ...')."""
  while e is not None:
    if isinstance(e, OSError) and e.errno in FULL:
      return e.strerror or os.strerror(e.errno)
    if isinstance(e, RuntimeError):
      for said in map(os.strerror, FULL):
        if said in str(e):
          return said
    e = e.__cause__ or e.__context__
  return None


@contextlib.contextmanager
def building(what: str, where: str) -> Iterator[None]:
  """A build that runs out of space (FULL) becomes one RunError sentence (exit 1); the caller
  removes its temporary folder, so nothing of the build is left."""
  try:
    yield
  except (OSError, RuntimeError) as e:
    said = None if isinstance(e, RunError) else _disk_full(e)
    if said is None:
      raise
    raise RunError(f"could not build {what} under {where} ({said}): nothing of the build is "
                   f"left; free space there or point data.data_dir elsewhere") from e


def _holder(path: str) -> tuple[int, str] | None:
  """(pid, host) the lock file at `path` names; None when it names none (yet)."""
  try:
    with open(path) as f:
      pid, host = f.read().split()[:2]
    return int(pid), host
  except (OSError, ValueError):
    return None


def _stopped(pid: int) -> bool:
  """Whether process `pid` of this host is stopped (SIGSTOP, ^Z) or traced: it will not go on."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


def _try_lock(f) -> bool:
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False


def _wait(lock, path: str, name: str, timeout: float, here: str) -> None:
  """Takes the lock another process holds once it lets go (see `locked`)."""
  start, said = time.monotonic(), False
  while True:
    time.sleep(_POLL_S)  # also lets a holder that has just taken the lock write its name
    if _try_lock(lock):
      return
    held = _holder(path)
    by = f"pid {held[0]} on host {held[1]}" if held else "another process"
    if not said:
      print(f"jaxpar: waiting for {by}, which is building {name} (lock {path}); giving up after "
            f"{timeout:g} s (data.lock_timeout)", file=sys.stderr)
      said = True
    if held and held[1] == here and _stopped(held[0]):
      raise RunError(f"pid {held[0]} on this host holds the lock {path} on building {name} but "
                     f"is stopped: continue it (kill -CONT {held[0]}) or end it, then run again")
    if time.monotonic() - start > timeout:
      raise RunError(f"gave up after {timeout:g} s (data.lock_timeout) waiting for {by} to finish "
                     f"building {name} (lock {path})")


@contextlib.contextmanager
def locked(folder: str, name: str, timeout: float) -> Iterator[None]:
  """Holds `folder/.name.lock` exclusively: processes building the same dataset take turns.

  A process that has to wait says once whom it waits for (the holder's pid and host, which the
  holder writes into the lock file) and for how long it will; it gives up with a RunError
  sentence after `timeout` seconds, or at once when the holder is a stopped process of this
  host."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f".{name}.lock")
  here = socket.gethostname()
  with open(path, "a+") as lock:
    if not _try_lock(lock):
      _wait(lock, path, name, timeout, here)
    try:
      with contextlib.suppress(OSError):  # a full disk: the build then says so itself
        lock.truncate(0)
        lock.write(f"{os.getpid()} {here}\n")
        lock.flush()
      yield
    finally:
      with contextlib.suppress(OSError):
        lock.truncate(0)
      fcntl.flock(lock, fcntl.LOCK_UN)
