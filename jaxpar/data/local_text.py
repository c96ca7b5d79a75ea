"""`local_text`: a folder of text files as a TFDS dataset stored as array_record (no TensorFlow)."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import tensorflow_datasets as tfds

from jaxpar.config import DataConfig
from jaxpar.data import stamps
from jaxpar.logs import quiet_absl

DEFAULT_MAX_BYTES = 8_000_000
_STAMP_FORMAT = 1  # bump when what a build stores changes
VALIDATION_EVERY = 50  # every 50th accepted file goes to `validation`
# Installed packages live under the stdlib folder on many installs; they vary between machines.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_path() -> str:
  """The running Python's standard library folder."""
  return sysconfig.get_paths()["stdlib"]


def _read_text(path: str) -> bytes | None:
  """The file's bytes if they are non-empty UTF-8 text without NUL bytes, else None."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return None
  # NUL is the loader's document separator, so files holding it (binaries) are skipped.
  if not data or b"\0" in data:
    return None
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return None
  return data


def _candidates(root: str, only_py: bool) -> list[str]:
  """Paths relative to `root`, sorted, of the files worth reading; hidden files are skipped."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
    for name in filenames:
      if name.startswith(".") or (only_py and not name.endswith(".py")):
        continue
      full = os.path.join(dirpath, name)
      if os.path.isfile(full):
        out.append(os.path.relpath(full, root).replace(os.sep, "/"))
  return sorted(out)


def scan(root: str, only_py: bool, max_bytes: int) -> list[tuple[str, int]]:
  """(relative path, bytes kept) of the accepted files in path order, at most max_bytes in all."""
  kept, total = [], 0
  for rel in _candidates(root, only_py):
    data = _read_text(os.path.join(root, rel))
    if data is None:
      continue
    if max_bytes and total + len(data) >= max_bytes:
      n = len(_truncate(data, max_bytes - total))
      if n:
        kept.append((rel, n))
      break
    kept.append((rel, len(data)))
    total += len(data)
  return kept


def _truncate(data: bytes, n: int) -> bytes:
  """The first n bytes, less a UTF-8 character cut in half at the end."""
  return data[:n].decode("utf-8", errors="ignore").encode("utf-8")


class LocalTextConfig(tfds.core.BuilderConfig):
  """Folder and byte cap; the name hashes both so each pair gets its own dataset dir."""

  def __init__(self, *, path: str = "", max_bytes: int = DEFAULT_MAX_BYTES):
    self.only_py = not path
    self.root = os.path.realpath(path or default_path())
    self.max_bytes = int(max_bytes)
    key = os.fsencode(f"{int(self.only_py)}\0{self.root}\0{self.max_bytes}")
    digest = hashlib.sha256(key).hexdigest()[:12]
    super().__init__(
        name=f"{'stdlib' if self.only_py else 'dir'}_{digest}",
        description=f"{'*.py files' if self.only_py else 'text files'} under "
                    f"{stamps.shown(self.root)}, "
                    f"max_bytes={self.max_bytes or 'unlimited'}")


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Text files under a folder, one example {'text': bytes} per file; splits train/validation."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}

  def __init__(self, *, path: str = "", max_bytes: int = DEFAULT_MAX_BYTES,
               config: LocalTextConfig | None = None, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(config=config or LocalTextConfig(path=path, max_bytes=max_bytes), **kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    # TFDS only uses it to find download checksums, which a local folder has none of; its default
    # needs the `importlib_resources` backport for builders defined inside a package.
    return None

  # TFDS prints "Downloading and preparing dataset Unknown size ..." and "... downloaded and
  # prepared ..." around a build; nothing is downloaded here, and `prepare` says what was built.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _info(self) -> tfds.core.DatasetInfo:
    # A builder outside a dataset package must pass itself: there is no metadata folder to find.
    return tfds.core.DatasetInfo(
        builder=self,
        description="Text files from a local folder, one example per file.",
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    if not os.path.isdir(cfg.root):
      raise ValueError(f"local_text folder {cfg.root} "
                       + ("is a file; data.path names a folder of text files"
                          if os.path.exists(cfg.root) else "does not exist"))
    files = scan(cfg.root, cfg.only_py, cfg.max_bytes)
    if not files:
      raise ValueError(f"local_text folder {cfg.root} holds no readable text files")
    val = [f for i, f in enumerate(files) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    splits = {"train": self._generate_examples(train)}
    if val:  # TFDS refuses an empty split, so small folders have `train` only
      splits["validation"] = self._generate_examples(val)
    return splits

  def _generate_examples(self, files):
    root = self.builder_config.root
    for rel, n in files:
      data = _read_text(os.path.join(root, rel)) or b""
      # the key as bytes: a name need not be UTF-8 (the same hash as the str of one that is)
      yield os.fsencode(rel), {"text": _truncate(data, n) if n < len(data) else data}


def fingerprint(cfg: LocalTextConfig) -> str:
  """What a build of `cfg` reads: every candidate file's path, size and mtime (`stamps`)."""
  header = f"local_text {_STAMP_FORMAT}\0{cfg.name}"
  return stamps.fingerprint(header, cfg.root, _candidates(cfg.root, cfg.only_py))


def prepare(data_dir: str, path: str = "", max_bytes: int = DEFAULT_MAX_BYTES,
            lock_timeout: float = DataConfig.lock_timeout) -> LocalText:
  """The builder for (path, max_bytes) under data_dir: built on first use, reused while the
  folder's files are unchanged (`fingerprint`), rebuilt when they change.

  Processes sharing data_dir take turns under a file lock: the first builds, the others find
  it built (waiting at most `lock_timeout` seconds, `stamps.locked`). A build happens in a
  temporary folder renamed into place with its stamp inside, so a stopped build, or one that
  fills the disk (one RunError sentence), leaves nothing half-written. A folder that is gone leaves its last build in
  use. TFDS's warnings are held back; a build reports itself in one line on stderr.
  """
  cfg = LocalTextConfig(path=path, max_bytes=max_bytes)
  final = os.path.join(data_dir, "local_text", cfg.name)
  with (stamps.building(f"local_text/{cfg.name}", data_dir),  # a full disk, from the lock on
        stamps.locked(os.path.dirname(final), cfg.name, lock_timeout)):
    with quiet_absl():
      builder = LocalText(config=cfg, data_dir=data_dir)
      have = builder.is_prepared()
    if have and not os.path.isdir(cfg.root):
      return builder
    stamp = fingerprint(cfg) if os.path.isdir(cfg.root) else ""
    if have and stamps.read(final) == stamp:
      return builder
    if have:
      print(f"jaxpar: the files under {cfg.root} changed since local_text/{cfg.name} was "
            f"built; rebuilding it", file=sys.stderr)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f".local_text-{cfg.name}-", dir=data_dir)
    try:
      with quiet_absl():
        tfds.disable_progress_bar()  # a build of a few seconds; its bars would bury the run's own
        LocalText(config=cfg, data_dir=tmp).download_and_prepare(file_format="array_record")
        stamps.write(os.path.join(tmp, "local_text", cfg.name), stamp)
      if os.path.exists(final):  # the old build goes only once the new one is complete
        shutil.rmtree(final)
      os.replace(os.path.join(tmp, "local_text", cfg.name), final)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    with quiet_absl():
      builder = LocalText(config=cfg, data_dir=data_dir)
  splits = builder.info.splits
  n = {s: splits[s].num_examples for s in ("train", "validation") if s in splits}
  counts = " and ".join(f"{k:,} {s}" for s, k in n.items())
  print(f"jaxpar: built the local_text dataset ({cfg.description}: {counts} "
        f"file{'s' if sum(n.values()) != 1 else ''}) in {time.perf_counter() - t0:.1f} s under "
        f"{builder.data_dir}; later runs reuse it while the files are unchanged", file=sys.stderr)
  return builder


def data_source(builder: LocalText, split: str = "train"):
  """Random access to the documents ({'text': bytes}) of a prepared split (no TensorFlow)."""
  if split not in builder.info.splits:
    raise ValueError(f"local_text has no split {split!r} (has {', '.join(builder.info.splits)}); "
                     f"a folder needs {VALIDATION_EVERY} files for a validation split")
  return builder.as_data_source(split=split)


def read_texts(builder: LocalText, split: str = "train") -> list[bytes]:
  """All documents of a prepared split, in stored order: for small splits and tests."""
  source = data_source(builder, split)
  return [ex["text"] for ex in source.__getitems__(range(len(source)))]
