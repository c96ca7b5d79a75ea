"""The compilation cache's folder (train.compile_cache): what jaxpar makes, trusts, reads, writes
and removes there.

The folder is the user's: jaxpar writes only into two subfolders of its own, `jaxpar-steps`
(the step store, executables.py) and `jax` (JAX's compiled programs), and removes only entries
it wrote there (a regular file of this user's, mode 0600, named and headed as an entry is).
Anything else, in the folder or in the subfolders, is left as it is.

Every program in either subfolder is code this process would run, so the folder is a trust
boundary:
- the folder's path is refused (one note; the run goes on without a cache) when any of its
  components belongs to a user other than this one or root, or its group or others may write it
  without the sticky bit (they could swap what the path names);
- the subfolders are made 0700 whatever the umask, and refused when they are not this user's or
  others may write them;
- each subfolder is opened once and held by its descriptor; entries are read, written, renamed
  and removed relative to it (os.open with dir_fd and O_NOFOLLOW), so a path repointed mid-run
  cannot redirect a read or a write;
- every entry opens with a header outside its payload (a format, a 64-hex-digit key and an
  HMAC-SHA256 over both and the payload under a per-user `secret`); an entry whose header, key or
  MAC does not match is a miss with a note, checked before a byte of it is used. JAX's programs
  get the same header: `SealedPrograms` replaces JAX's file cache (JAX's own carries no check).
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import pathlib
import secrets
import stat
import sys
import tempfile
import time
from typing import Callable

ENV_SECRET = "JAXPAR_STEP_SECRET"  # the secret's file, instead of the user's config folder's
JAX_FOLDER = "jax"  # JAX's programs, inside the cache folder
PROGRAM_MAGIC = b"jaxpar xla 1\n"  # a JAX program's first bytes; then its key, the MAC
PROGRAM_SUFFIX = ".xla"
_MAC_BYTES = 32
_STALE_TMP_S = 86400.0  # a write takes seconds: a file written aside a day ago was left
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_secret: bytes | None = None
_opened: dict[tuple[str, str], "Folder"] = {}


def note(text: str) -> None:
  """Says why the cache or the store is not used for something; the run goes on without it."""
  print(f"note: {text}", file=sys.stderr, flush=True)


def _uid() -> int:
  return os.getuid()


def _writers(mode: int) -> str:
  return " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                     (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                     (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link")):
    if test(mode):
      return name
  return "special file"


def refusal(path: str, why: str, unused: str = "no step store") -> str:
  """The note for a folder that is not trusted."""
  return (f"the folder {path} {why}, so another user could plant programs there that this run "
          f"would execute: it is not used ({unused}). Make it yours and run `chmod go-w {path}`, "
          f"or set train.compile_cache to another folder")


def _component_why(st: os.stat_result) -> str | None:
  if st.st_uid not in (0, _uid()):
    return f"belongs to user id {st.st_uid}, not to this user ({_uid()}) nor root"
  if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
    return f"is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def unsafe_path(path: str) -> tuple[str, str] | None:
  """(component, why) for the first folder on the way to the folder `path` (as written and as
  its links resolve) that another user could change: not this user's nor root's, or writable by
  its group or others without the sticky bit; None when every one that exists is safe."""
  for full in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
    parts, at = pathlib.PurePath(full).parts, ""
    for part in parts:
      at = os.path.join(at, part) if at else part
      try:
        st = os.stat(at)
      except FileNotFoundError:
        break
      if not stat.S_ISDIR(st.st_mode):
        break  # nothing can be made under it: the caller's making fails and says so
      why = _component_why(st)
      if why:
        return at, why
  return None


def make_folder(path: str) -> None:
  """Makes the folder `path` and each missing folder above it mode 0700, whatever the umask."""
  missing = []
  while not os.path.isdir(path):
    missing.append(path)
    path = os.path.dirname(path)
  for p in reversed(missing):
    try:
      os.mkdir(p, 0o700)
    except FileExistsError:
      continue  # made beside this process; checked below as any other
    os.chmod(p, 0o700)


class Folder:
  """A subfolder of jaxpar's, held by its descriptor; entries are opened relative to it."""

  def __init__(self, path: str, fd: int):
    self.path, self.fd = path, fd

  def why_not(self) -> str | None:
    """Why the folder must not be used now (not this user's, or others may write it), or None."""
    st = os.fstat(self.fd)
    if st.st_uid != _uid():
      return f"belongs to user id {st.st_uid}, not to this user ({_uid()})"
    if st.st_mode & 0o022:
      return f"is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):o})"
    return None

  def read(self, name: str) -> bytes | None:
    """The bytes of this user's regular file `name`, or None where there is none."""
    try:
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
    except FileNotFoundError:
      return None
    except OSError as e:
      if e.errno == errno.ELOOP:  # a symbolic link: never followed
        return None
      raise
    with os.fdopen(fd, "rb") as f:
      st = os.fstat(f.fileno())
      if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid():
        return None
      return f.read()

  def exists(self, name: str) -> bool:
    try:
      return stat.S_ISREG(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
    except OSError:
      return False

  def write(self, name: str, data: bytes) -> None:
    """Writes `name` whole or not at all (written aside, renamed), mode 0600."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                 dir_fd=self.fd)
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(data)
      os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
    except BaseException:
      try:
        os.unlink(tmp, dir_fd=self.fd)
      except OSError:
        pass
      raise

  def touch(self, name: str) -> None:
    """Marks `name` used now (the last entry a bound gives up); a read-only folder still loads."""
    try:
      os.utime(name, dir_fd=self.fd, follow_symlinks=False)
    except OSError:
      pass

  def mine(self, name: str, st: os.stat_result, magic: bytes, suffix: str) -> bool:
    """Whether `name` is an entry jaxpar wrote: this user's regular file, mode 0600, named
    <key><suffix>, opening with `magic` and that key."""
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or stat.S_IMODE(st.st_mode) != 0o600
        or not name.endswith(suffix) or name.startswith(".")):
      return False
    key = name[:-len(suffix)].encode()
    try:
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
    except OSError:
      return False
    with os.fdopen(fd, "rb") as f:
      return f.read(len(magic) + len(key)) == magic + key

  def prune(self, max_bytes: int, magic: bytes, suffix: str, keep: str | None = None,
            say: Callable[[str], None] = note) -> list[str]:
    """Removes the least recently used of jaxpar's entries (`mine`; used last at the later of
    their modification and access times) until those left take at most `max_bytes`; the entry
    `keep` stays even if it alone is larger. A file written aside (.*.tmp, this user's) and left
    by a process killed before its rename goes after a day. Anything else is left, with one
    note. Returns the keys removed; an entry another process removes first counts as gone."""
    entries, others, now = [], [], time.time()
    for entry in os.scandir(self.fd):
      name = entry.name
      try:
        st = entry.stat(follow_symlinks=False)
      except OSError:
        continue
      if self.mine(name, st, magic, suffix):
        entries.append((max(st.st_mtime, st.st_atime), name[:-len(suffix)], st.st_size))
      elif (name.startswith(".") and name.endswith(".tmp") and stat.S_ISREG(st.st_mode)
            and st.st_uid == _uid()):
        if now - st.st_mtime > _STALE_TMP_S:
          try:
            os.unlink(name, dir_fd=self.fd)
          except OSError:
            pass
      else:
        others.append(name)
    if others:
      say(f"{len(others)} file(s) in {self.path} were not written by jaxpar (e.g. "
          f"{sorted(others)[0]}): they are left as they are, never read")
    total, removed = sum(size for _, _, size in entries), []
    for _, key, size in sorted(entries):
      if total <= max_bytes:
        break
      if key == keep:
        continue
      try:
        os.unlink(key + suffix, dir_fd=self.fd)
      except FileNotFoundError:  # another process pruning beside this one took it
        total -= size
        continue
      except OSError:
        continue
      total -= size
      removed.append(key)
    return removed


def open_folder(cache: str, sub: str, say: Callable[[str], None] = note,
                unused: str = "no step store") -> Folder | None:
  """jaxpar's subfolder `sub` of the cache folder `cache`, made (0700) if missing and held
  open; None (one note) when the path is not safe (`unsafe_path`), the subfolder cannot be made
  or is not trusted. A folder once opened is reused: its path is not followed again."""
  cache = os.path.abspath(cache)
  held = _opened.get((cache, sub))
  if held is not None:
    return held
  try:
    make_folder(cache)
  except OSError as e:
    say(f"{unused}: {cache} cannot be made ({e.strerror})")
    return None
  bad = unsafe_path(cache)
  if bad:
    say(refusal(*bad, unused))
    return None
  try:
    top = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
  except OSError as e:
    say(f"{unused}: {cache} cannot be opened ({e.strerror})")
    return None
  try:
    why = _component_why(os.fstat(top))  # the folder checked above, not one put there since
    if why:
      say(refusal(cache, why, unused))
      return None
    where = os.path.join(cache, sub)
    try:
      os.mkdir(sub, 0o700, dir_fd=top)
    except FileExistsError:
      pass
    fd = os.open(sub, _DIR_FLAGS, dir_fd=top)
  except OSError as e:
    say(f"{unused}: {os.path.join(cache, sub)} cannot be made ({e.strerror})")
    return None
  finally:
    os.close(top)
  folder = Folder(where, fd)
  why = folder.why_not()
  if why:
    os.close(fd)
    say(refusal(where, why, unused))
    return None
  os.fchmod(fd, 0o700)  # this user's: whatever the umask made it, only this user reads it
  _opened[(cache, sub)] = folder
  return folder


def forget() -> None:
  """Closes the folders held open and forgets JAX's programs' places (a test's caches)."""
  for folder in _opened.values():
    os.close(folder.fd)
  _opened.clear()
  _installed.clear()


# -- the secret and the seal -----------------------------------------------------------------------

def secret_path(environ=None) -> str:
  """$JAXPAR_STEP_SECRET, else $XDG_CONFIG_HOME/jaxpar/step-secret (~/.config/jaxpar/...)."""
  environ = os.environ if environ is None else environ
  if environ.get(ENV_SECRET):
    return os.path.abspath(os.path.expanduser(environ[ENV_SECRET]))
  base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
  return os.path.join(base, "jaxpar", "step-secret")


def secret() -> bytes:
  """This user's key for the MACs (`secret_path`): made once (32 random bytes, mode 0600, in a
  0700 folder), then read. Raises ValueError with a sentence where the file is not a regular
  file, not this user's, others may read or write it, or it is too short: a key others know
  proves nothing."""
  global _secret
  if _secret is not None:
    return _secret
  path = secret_path()
  named = bool(os.environ.get(ENV_SECRET))
  if not os.path.lexists(path):
    make_folder(os.path.dirname(path))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".step-secret.")  # 0600
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
      try:
        os.link(tmp, path)  # whole or absent; a process making it at the same time wins alike
      except FileExistsError:
        pass
    finally:
      os.remove(tmp)
  # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer, and is refused below.
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    os.close(fd)
    default = secret_path({k: v for k, v in os.environ.items() if k != ENV_SECRET})
    way = (f"set {ENV_SECRET} to a file of your own (mode 600), or unset it and one is made in "
           f"{default}" if named else "remove it, and a file is made there")
    raise ValueError(f"the step store's secret {path} is a {_kind(st.st_mode)}, not a regular "
                     f"file: {way}")
  with os.fdopen(fd, "rb") as f:
    if st.st_uid != _uid() or st.st_mode & 0o077:
      raise ValueError(f"the step store's secret {path} must be this user's alone "
                       f"(`chmod 600 {path}`; it is mode {stat.S_IMODE(st.st_mode):o}, user id "
                       f"{st.st_uid})")
    key = f.read()
  if len(key) < 16:
    raise ValueError(f"the step store's secret {path} holds {len(key)} bytes; it needs at least "
                     f"16 (remove it, and one is made)")
  _secret = key
  return key


def mac(magic: bytes, key: str, payload: bytes) -> bytes:
  return hmac.new(secret(), magic + key.encode() + payload, hashlib.sha256).digest()


def seal(magic: bytes, key: str, payload: bytes) -> bytes:
  """`payload` behind its header: `magic`, `key` (64 hex digits) and their MAC."""
  return magic + key.encode() + mac(magic, key, payload) + payload


def unseal(magic: bytes, key: str, blob: bytes) -> tuple[bytes | None, str | None]:
  """(payload, None) where `blob` is what this user's jaxpar sealed under `key`, else
  (None, why). Raises ValueError where there is no secret."""
  head = len(magic) + 64 + _MAC_BYTES
  if len(blob) < head or not blob.startswith(magic):
    return None, "it is not an entry of this jaxpar (another format, or cut short)"
  at = len(magic)
  if blob[at:at + 64] != key.encode():
    return None, "it is labelled with another key"
  if not hmac.compare_digest(blob[at + 64:head], mac(magic, key, blob[head:])):
    return None, ("its MAC does not match (damaged, cut short, or written without this user's "
                  f"secret {secret_path()})")
  return blob[head:], None


# -- JAX's programs behind the seal ----------------------------------------------------------------

class SealedPrograms:
  """JAX's persistent cache (its CacheInterface: get and put) kept in the `jax` subfolder, each
  program sealed as the stored steps are; a program that fails its check is a miss, one note."""

  def __init__(self, folder: Folder, say: Callable[[str], None] = note):
    self.folder, self.say = folder, say
    self._path = pathlib.Path(folder.path)
    self.checked_s = 0.0  # seconds spent checking MACs, for the startup benchmark

  @staticmethod
  def name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()

  def get(self, key: str) -> bytes | None:
    name, why = self.name(key), self.folder.why_not()
    if why:
      return None
    try:
      blob = self.folder.read(name + PROGRAM_SUFFIX)
    except OSError:
      return None
    if blob is None:
      return None
    t0 = time.perf_counter()
    try:
      payload, why = unseal(PROGRAM_MAGIC, name, blob)
    except (OSError, ValueError) as e:  # no secret: nothing is trusted
      payload, why = None, str(e)
    self.checked_s += time.perf_counter() - t0
    if why:
      self.say(f"the compiled program {self.folder.path}/{name}{PROGRAM_SUFFIX} ({key}) is not "
               f"loaded: {why}; it is compiled and kept anew")
      return None
    self.folder.touch(name + PROGRAM_SUFFIX)
    return payload

  def put(self, key: str, value: bytes) -> None:
    name = self.name(key)
    try:
      if self.folder.why_not():
        return
      self.folder.write(name + PROGRAM_SUFFIX, seal(PROGRAM_MAGIC, name, value))
    except (OSError, ValueError) as e:
      self.say(f"the compiled program {key} could not be kept in {self.folder.path} "
               f"({getattr(e, 'strerror', None) or e}); the next run compiles it again")


_installed: dict[str, SealedPrograms] = {}


def install(cache: str, programs: SealedPrograms) -> bool:
  """Makes JAX keep its programs for the cache folder `cache` in `programs`; False where this
  JAX has no place for it (its file cache is then not used at all).

  JAX's compilation_cache builds its file cache by `get_file_cache(path)` whenever it
  (re)initialises: that one function is replaced, by one that returns `programs` for `cache` and
  JAX's own cache for any other folder a caller names."""
  from jax._src import compilation_cache as jcc  # private: JAX offers no public hook
  original = getattr(jcc, "get_file_cache", None)
  if original is None or not hasattr(jcc, "reset_cache"):
    return False
  original = getattr(original, "jaxpar_original", original)

  def get_file_cache(path):
    sealed = _installed.get(os.path.abspath(str(path)))
    return (sealed, str(path)) if sealed is not None else original(path)

  get_file_cache.jaxpar_original = original
  _installed[os.path.abspath(cache)] = programs
  jcc.get_file_cache = get_file_cache
  jcc.reset_cache()  # the next compile builds its cache afresh, through the function above
  return True
