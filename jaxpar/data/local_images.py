"""`local_images`: one's own images as a TFDS dataset stored as array_record (no TensorFlow).

From a folder of class subfolders (the layout of torchvision's ImageFolder) or from numpy arrays
(.npz, or .npy images and labels), built once into `DATA_DIR/local_images/NAME/1.0.0`, which
`data.source=tfds data.name=local_images/NAME data.data_dir=DATA_DIR` reads like any prepared
TFDS dataset: features `image` (uint8 [H, W, C], stored as PNG) and `label` (a ClassLabel).
Pillow reads, resizes and encodes the images.

Every image of a dataset has one shape: the folder's images must share their size unless `size`
resizes them all; they are grayscale (C = 1) if every one is, else RGB (C = 3, alpha dropped).
Each split is stored in a fixed shuffled order (seed 0), so the contiguous shard a process reads
holds every class. A folder or arrays without a validation or test split give a fixed random
`validation` fraction of the examples to a `validation` split.

`prepare` is the same build at train time (data.source=images data.path=SOURCE): named after the
source, kept with a fingerprint of its files, rebuilt when they change, one process at a time.

Bad input (no images, mixed sizes, an unreadable file, labels that do not match the images, an
image of more than config.MAX_IMAGE_PIXELS pixels, more than MAX_CLASSES classes, a name that is
not UTF-8, an image path that is not a regular file) is one ConfigError sentence; the build goes
to a temporary folder renamed into place at the end, so nothing half-written is left, also when
the disk fills up (one RunError sentence).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tensorflow_datasets as tfds

from jaxpar.config import MAX_IMAGE_PIXELS, ConfigError, DataConfig, parse_image_size
from jaxpar.data import stamps
from jaxpar.logs import quiet_absl

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
SPLITS = {"train": "train", "validation": "validation", "val": "validation", "test": "test"}
GRAY_MODES = ("1", "L", "LA")  # Pillow modes stored as one channel
SEED = 0  # the validation hold-out and each split's stored order
DEFAULT_VALIDATION = 0.1
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
# The most classes a dataset may have: a label of 10**9 would otherwise name a billion classes.
# Far above ImageNet-21k's 21,841 and Google Landmarks v2's 203,094.
MAX_CLASSES = 1_000_000


@dataclass
class Images:
  """What a build reads: per split, (key, label) of each example in stored order, and how to
  get an example's image (a Pillow image of the final mode and size)."""
  source: str
  class_names: list[str]
  shape: tuple[int, int, int]  # (H, W, C) of the stored images
  splits: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
  image: Callable[[str], object] = None  # key -> PIL.Image


def _pil():
  try:
    from PIL import Image
  except ImportError:
    raise ConfigError("building an image dataset needs Pillow (pip install pillow)") from None
  return Image


def parse_size(text: str, what: str = "--size ") -> tuple[int, int]:
  """'32' or '32x48' -> (height, width), at most MAX_IMAGE_PIXELS; `what` names the setting."""
  return parse_image_size(text, what)


def _text_name(path: str) -> None:
  """ConfigError unless the last part of `path` is UTF-8 text (class names and keys are)."""
  try:
    os.fsencode(os.path.basename(path)).decode("utf-8")
  except UnicodeDecodeError:
    raise ConfigError(f"{stamps.shown(path)} has a name that is not UTF-8 text: rename it (class "
                      f"names and image names are stored as text)") from None


def _regular(path: str) -> None:
  """ConfigError unless `path` is a regular file (or a link to one): a FIFO would block the
  read forever, a device would be read without end."""
  try:
    mode = os.stat(path).st_mode
  except OSError as e:
    raise ConfigError(f"{stamps.shown(path)} cannot be read ({e.strerror})") from None
  if not stat.S_ISREG(mode):
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    raise ConfigError(f"{stamps.shown(path)} is {kind}, not a regular file: remove it or give "
                      f"the images as files")


def _ordered(examples: list, rng: np.random.Generator) -> list:
  return [examples[i] for i in rng.permutation(len(examples))]


def _hold_out(examples: list, fraction: float) -> dict[str, list]:
  """train and (a `fraction` of the examples, chosen at random with SEED) validation, each in
  a fixed shuffled order; no validation split when it would be empty."""
  order = _ordered(examples, np.random.default_rng(SEED))
  k = int(round(len(order) * fraction))
  if k == 0 or k == len(order):
    return {"train": order}
  return {"train": order[k:], "validation": order[:k]}


def _files(folder: str) -> list[str]:
  """Image files under `folder` (recursively), hidden ones skipped, sorted; ConfigError for one
  whose name is not UTF-8 or that is not a regular file."""
  out = []
  for dirpath, dirnames, filenames in os.walk(folder):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    out += [os.path.join(dirpath, n) for n in filenames
            if not n.startswith(".") and n.lower().endswith(EXTENSIONS)]
  for path in out:
    _text_name(path)
    _regular(path)
  return sorted(out)


def _subfolders(folder: str) -> list[str]:
  return sorted(d for d in os.listdir(folder)
                if not d.startswith(".") and os.path.isdir(os.path.join(folder, d)))


def _layout(root: str) -> tuple[dict[str, str], list[str]]:
  """({split: folder} ('' for a folder without splits), the class names) of an image folder."""
  if not os.path.isdir(root):
    raise ConfigError(f"{root} " + ("is not a folder, .npz or .npy file" if os.path.exists(root)
                                    else "does not exist"))
  top = _subfolders(root)
  if top and set(top) <= set(SPLITS) and "train" in top:
    split_dirs = {SPLITS[d]: os.path.join(root, d) for d in top}
  else:
    split_dirs = {"": root}
  classes = _subfolders(split_dirs.get("train", root))
  for name in classes:
    _text_name(os.path.join(split_dirs.get("train", root), name))
  if len(classes) > MAX_CLASSES:
    raise ConfigError(f"{root} has {len(classes):,} class folders, more than the {MAX_CLASSES:,} "
                      f"jaxpar builds")
  if not classes:
    raise ConfigError(f"{split_dirs.get('train', root)} has no class subfolders (images go in "
                      f"one folder per class: {root}/CLASS/IMAGE.png)")
  return split_dirs, classes


def _header(Image, path: str) -> tuple[tuple[int, int], str]:
  """((width, height), Pillow mode) from the image's header; ConfigError for an unreadable one or
  one of more than MAX_IMAGE_PIXELS pixels (refused before a byte of it is decoded)."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      with Image.open(path) as im:  # reads the header only
        size, mode = im.size, im.mode
  except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
    pixels = re.search(r"\((\d+) pixels\)", str(e))
    size, mode = None, f"{int(pixels.group(1)):,} pixels" if pixels else "too many pixels"
  except (OSError, ValueError) as e:
    raise ConfigError(f"{stamps.shown(path)} is not a readable image ({type(e).__name__})") from None
  if size is None or size[0] * size[1] > MAX_IMAGE_PIXELS:
    what = mode if size is None else f"{size[0]}x{size[1]}, {size[0] * size[1]:,} pixels"
    raise ConfigError(f"{stamps.shown(path)} is {what}, more than the {MAX_IMAGE_PIXELS:,} "
                      f"(8192x8192) jaxpar decodes (a decompression bomb, or an image to shrink "
                      f"first)")
  return size, mode


def read_folder(root: str, size: tuple[int, int] | None, validation: float) -> Images:
  """A folder of class subfolders of images, or of train/validation(val)/test subfolders that
  each hold the class subfolders."""
  Image = _pil()
  split_dirs, classes = _layout(root)
  per_split: dict[str, list[tuple[str, int]]] = {}
  sizes, gray = {}, True
  for split, folder in split_dirs.items():
    examples = []
    for label, name in enumerate(classes):
      for path in _files(os.path.join(folder, name)):
        found, mode = _header(Image, path)
        sizes.setdefault(found, os.path.relpath(path, root))
        gray = gray and mode in GRAY_MODES
        examples.append((os.path.relpath(path, root), label))
    unknown = set(_subfolders(folder)) - set(classes)
    if unknown:
      raise ConfigError(f"{folder} has class folders that train has not: "
                        f"{', '.join(sorted(unknown))}")
    if not examples:
      raise ConfigError(f"{folder} holds no images ({', '.join(EXTENSIONS)}) in its class "
                        f"subfolders {', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}")
    per_split[split] = examples
  if size is None and len(sizes) > 1:
    (a, first), (b, second) = list(sizes.items())[:2]
    raise ConfigError(f"the images differ in size ({first} is {a[0]}x{a[1]}, {second} is "
                      f"{b[0]}x{b[1]} pixels): resize them all with --size HEIGHTxWIDTH "
                      f"(data.image_size=HEIGHTxWIDTH when training on the folder)")
  h, w = size or next(iter(sizes))[::-1]
  mode = "L" if gray else "RGB"

  def image(key):
    with Image.open(os.path.join(root, key)) as im:
      im = im.convert(mode)
      return im.resize((w, h), Image.Resampling.BILINEAR) if im.size != (w, h) else im
  if "" in per_split:
    splits = _hold_out(per_split[""], validation)
  else:
    splits = {s: _ordered(ex, np.random.default_rng([SEED, i]))
              for i, (s, ex) in enumerate(sorted(per_split.items()))}
  return Images(root, classes, (h, w, 1 if gray else 3), splits, image)


def _images_uint8(x: np.ndarray, what: str) -> np.ndarray:
  """[N, H, W] or [N, H, W, C] (C 1, 3 or 4) integer values 0..255 -> uint8 [N, H, W, C]."""
  if x.ndim == 3:
    x = x[..., None]
  if x.ndim != 4 or x.shape[-1] not in (1, 3, 4):
    raise ConfigError(f"{what} has shape {x.shape}; images are [N, H, W] or [N, H, W, C] with C "
                      f"1, 3 or 4")
  if x.dtype == np.uint8:
    return x
  if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
    raise ConfigError(f"{what} holds {x.dtype} values; images are numbers 0..255")
  lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
  if lo < 0 or hi > 255 or (np.issubdtype(x.dtype, np.floating) and not np.all(x == np.round(x))):
    raise ConfigError(f"{what} holds values from {lo:g} to {hi:g}; images are whole numbers "
                      f"0..255 (scale them, e.g. (x * 255).round().astype(np.uint8))")
  return x.astype(np.uint8)


def _labels(ys: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
  """Labels of every split as int class indices and the class names: integers 0..K-1 are
  their own classes (K = the largest + 1); strings are classes in sorted order."""
  if all(np.issubdtype(y.dtype, np.integer) for y in ys.values()):
    top = max(int(y.max()) for y in ys.values() if y.size)
    if min(int(y.min()) for y in ys.values() if y.size) < 0:
      raise ConfigError("labels must not be negative (class indices 0..K-1)")
    if top >= MAX_CLASSES:
      raise ConfigError(f"a label is {top}: class indices 0..K-1 with K at most {MAX_CLASSES:,}")
    return {s: y.astype(np.int64) for s, y in ys.items()}, [str(i) for i in range(top + 1)]
  if all(y.dtype.kind in "USO" for y in ys.values()):
    names = sorted({str(v) for y in ys.values() for v in y})
    if len(names) > MAX_CLASSES:
      raise ConfigError(f"the labels name {len(names):,} classes, more than the {MAX_CLASSES:,} "
                        f"jaxpar builds")
    index = {n: i for i, n in enumerate(names)}
    return {s: np.asarray([index[str(v)] for v in y], np.int64) for s, y in ys.items()}, names
  kinds = ", ".join(sorted({str(y.dtype) for y in ys.values()}))
  raise ConfigError(f"labels are {kinds}; give integer class indices or class names (strings)")


def read_arrays(path: str, labels_path: str | None, size: tuple[int, int] | None,
                validation: float) -> Images:
  """An .npz with `images` and `labels` (or `x_train`, `y_train` and optionally `x_test`,
  `y_test`), or an .npy of images with `labels_path` an .npy of labels."""
  Image = _pil()
  _regular(path)
  if labels_path:
    _regular(labels_path)
  try:
    if path.endswith(".npz"):
      if labels_path:
        raise ConfigError(f"--labels is for an .npy of images; {path} holds its labels itself")
      data = np.load(path, allow_pickle=False)
      keys = set(data.files)
      if {"images", "labels"} <= keys:
        pairs = {"": ("images", "labels")}
      elif {"x_train", "y_train"} <= keys:
        pairs = {"train": ("x_train", "y_train")}
        if {"x_test", "y_test"} <= keys:
          pairs["test"] = ("x_test", "y_test")
      else:
        raise ConfigError(f"{path} holds {', '.join(sorted(keys)) or 'no arrays'}; it needs "
                          f"`images` and `labels` (or x_train, y_train[, x_test, y_test])")
      xs = {s: data[x] for s, (x, _) in pairs.items()}
      ys = {s: data[y] for s, (_, y) in pairs.items()}
      names = {s: (f"{path}'s {x}", f"{path}'s {y}") for s, (x, y) in pairs.items()}
    elif path.endswith(".npy"):
      if not labels_path:
        raise ConfigError(f"{path} holds images only: pass --labels LABELS.npy")
      xs, ys = {"": np.load(path, allow_pickle=False)}, {"": np.load(labels_path,
                                                                     allow_pickle=False)}
      names = {"": (path, labels_path)}
    else:
      raise ConfigError(f"{path} is not a folder, .npz or .npy file")
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, MemoryError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f"{path} cannot be read as numpy arrays ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
  for s in xs:
    xs[s] = _images_uint8(xs[s], names[s][0])
    ys[s] = ys[s].reshape(-1) if ys[s].ndim == 2 and ys[s].shape[1] == 1 else ys[s]
    if ys[s].ndim != 1 or len(ys[s]) != len(xs[s]):
      raise ConfigError(f"{names[s][1]} has shape {ys[s].shape}, but {names[s][0]} holds "
                        f"{len(xs[s])} images: one label per image")
    if not len(xs[s]):
      raise ConfigError(f"{names[s][0]} holds no images")
  shapes = {x.shape[1:] for x in xs.values()}
  if len(shapes) > 1 and size is None:
    raise ConfigError(f"the splits' images differ in shape ({', '.join(map(str, shapes))}): pass "
                      f"--size HEIGHTxWIDTH to resize them all")
  ys, classes = _labels(ys)
  keys = {s: [(f"{s or 'all'}/{i}", int(y[i])) for i in range(len(y))] for s, y in ys.items()}
  splits = (_hold_out(keys[""], validation) if "" in keys else
            {s: _ordered(k, np.random.default_rng([SEED, i]))
             for i, (s, k) in enumerate(sorted(keys.items()))})
  c = next(iter(xs.values())).shape[-1]
  h, w = size or next(iter(xs.values())).shape[1:3]

  def image(key):
    s, i = key.rsplit("/", 1)
    x = xs["" if s == "all" else s][int(i)]
    im = Image.fromarray(np.ascontiguousarray(x[..., 0] if c == 1 else x))  # L, RGB or RGBA
    return im.resize((w, h), Image.Resampling.BILINEAR) if im.size != (w, h) else im
  return Images(path, classes, (h, w, c), splits, image)


class LocalImagesConfig(tfds.core.BuilderConfig):
  """One dataset: its name and what it is built from."""

  def __init__(self, *, name: str, images: Images):
    self.images = images
    super().__init__(name=name, description=f"images from {stamps.shown(images.source)}")


class LocalImages(tfds.core.GeneratorBasedBuilder):
  """Images and class labels, one example {'image', 'label'} per image."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}

  def __init__(self, *, config: LocalImagesConfig, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    self.failure = ""  # the sentence of a file that could not be read during the build
    super().__init__(config=config, **kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    return None  # as local_text.LocalText: no download checksums to find

  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _info(self) -> tfds.core.DatasetInfo:
    images = self.builder_config.images
    return tfds.core.DatasetInfo(
        builder=self,
        description=f"Images with class labels, from {stamps.shown(images.source)}.",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=images.shape, encoding_format="png"),
            "label": tfds.features.ClassLabel(names=images.class_names)}),
        supervised_keys=("image", "label"))

  def _split_generators(self, dl_manager):
    return {s: self._generate_examples(ex) for s, ex in self.builder_config.images.splits.items()}

  def _generate_examples(self, examples):
    images = self.builder_config.images
    for key, label in examples:
      try:
        image = images.image(key)
      except (OSError, ValueError) as e:
        self.failure = (f"{os.path.join(images.source, key)} could not be decoded "
                        f"({type(e).__name__}: {e})")
        raise
      yield key, {"image": image, "label": label}


def read(source: str, labels: str | None = None, size: tuple[int, int] | None = None,
         validation: float = DEFAULT_VALIDATION) -> Images:
  """The images of a folder or of numpy arrays (see read_folder, read_arrays)."""
  if not 0 <= validation < 1:
    raise ConfigError(f"--validation {validation} must be in [0, 1)")
  if os.path.isdir(source):
    if labels:
      raise ConfigError(f"--labels is for an .npy of images; the folder {source} is labelled by "
                        f"its class subfolders")
    return read_folder(source, size, validation)
  if not os.path.exists(source):
    raise ConfigError(f"{source} does not exist")
  return read_arrays(source, labels, size, validation)


def build(source: str, data_dir: str, name: str, labels: str | None = None,
          size: tuple[int, int] | None = None, validation: float = DEFAULT_VALIDATION,
          replace: bool = False, stamp: str = "") -> tfds.core.DatasetBuilder:
  """Builds `local_images/name` under data_dir from `source`; returns its (read-only) builder.
  A `stamp` (`fingerprint`) is written into the dataset's folder before it is renamed into
  place."""
  if not _NAME.fullmatch(name):
    raise ConfigError(f"--name {name} must be lowercase letters, digits and underscores")
  final = os.path.join(data_dir, "local_images", name)
  if os.path.exists(final) and not replace:
    raise ConfigError(f"{final} already holds a dataset {name}: pass --replace to rebuild it, or "
                      f"choose another --name")
  images = read(source, labels, size, validation)
  t0 = time.perf_counter()
  made = [d for d in (os.path.dirname(final), data_dir) if not os.path.isdir(d)]
  os.makedirs(data_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".local_images-{name}-", dir=data_dir)
  done = False
  try:
    with stamps.building(f"local_images/{name}", data_dir), quiet_absl():
      builder = LocalImages(config=LocalImagesConfig(name=name, images=images), data_dir=tmp)
      tfds.disable_progress_bar()
      try:
        builder.download_and_prepare(file_format="array_record")
      except Exception:
        if builder.failure:
          raise ConfigError(builder.failure) from None
        raise
      os.makedirs(os.path.dirname(final), exist_ok=True)
      if stamp:
        stamps.write(os.path.join(tmp, "local_images", name), stamp)
    if os.path.exists(final):  # --replace: the old one goes only once the new one is complete
      shutil.rmtree(final)
    os.replace(os.path.join(tmp, "local_images", name), final)
    done = True
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    for folder in made if not done else ():  # a failed build leaves not even its folders
      with contextlib.suppress(OSError):
        os.rmdir(folder)
  with quiet_absl():
    built = tfds.builder(f"local_images/{name}", data_dir=data_dir)
  splits = built.info.splits
  counts = " and ".join(f"{splits[s].num_examples:,} {s}" for s in ("train", "validation", "test")
                        if s in splits)
  h, w, c = images.shape
  print(f"jaxpar: built local_images/{name} ({counts} images of {h}x{w}x{c}, "
        f"{len(images.class_names)} classes, from {source}) in {time.perf_counter() - t0:.1f} s "
        f"under {os.path.abspath(data_dir)}", file=sys.stderr)
  return built


def train_flags(builder, data_dir: str) -> str:
  """The --set words that train the cnn on a built dataset."""
  return (f"model.kind=cnn data.source=tfds data.name={builder.info.full_name.rsplit('/', 1)[0]} "
          f"data.data_dir={data_dir} model.num_classes={builder.info.features['label'].num_classes}")


# Built at train time (data.source=images): DATA_DIR/local_images/<folder name>_<hash of its
# path and size>, rebuilt when the fingerprint of its files no longer matches the one kept beside.
_STAMP_FORMAT = 1  # bump when what a build stores changes


def source_path(source: str) -> str:
  """The real path of data.path for data.source=images; ConfigError when it cannot be one."""
  if not source:
    raise ConfigError("data.source=images needs data.path: a folder of class subfolders of "
                      "images (FOLDER/CLASS/IMAGE.png) or an .npz of images and labels")
  if source.endswith(".npy") and not os.path.isdir(source):
    raise ConfigError(f"data.path={source} holds images only; train on a folder or an .npz of "
                      f"images and labels, or build it with jaxpar-dataset images {source} "
                      f"--labels LABELS.npy and train with data.source=tfds")
  if not os.path.exists(source):
    raise ConfigError(f"data.path={source} does not exist")
  return os.path.realpath(source)


def class_names(source: str) -> list[str]:
  """The classes a build of `source` (a folder or an .npz) would have, read cheaply."""
  source = source_path(source)
  if os.path.isdir(source):
    return _layout(source)[1]
  return read_arrays(source, None, None, 0.0).class_names


def auto_name(source: str, size: tuple[int, int] | None) -> str:
  """The dataset name a train-time build of `source` at `size` gets."""
  source = source_path(source)
  stem = re.sub(r"[^a-z0-9_]+", "_", os.path.splitext(os.path.basename(source))[0].lower())
  stem = stem.strip("_")[:40] or "images"
  digest = hashlib.sha256(os.fsencode(f"{source}\0{size}")).hexdigest()[:12]
  return f"{stem}_{digest}"


def fingerprint(source: str, size: tuple[int, int] | None, validation: float) -> str:
  """sha256 of what a build reads: every non-hidden file under a folder or the .npz (their
  stat: path, size, mtime, ctime, inode; `stamps.fingerprint`), with the build's settings; it
  changes when the images do, an edit in place that keeps the size and the mtime included."""
  source = source_path(source)
  header = f"{_STAMP_FORMAT}\0{source}\0{size}\0{validation!r}"
  if not os.path.isdir(source):
    return stamps.fingerprint(header, os.path.dirname(source), [os.path.basename(source)])
  rels = []
  for dirpath, dirnames, filenames in os.walk(source):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    rels += [os.path.relpath(os.path.join(dirpath, n), source)
             for n in sorted(n for n in filenames if not n.startswith("."))]
  return stamps.fingerprint(header, source, rels)


def prepare(source: str, data_dir: str, size: tuple[int, int] | None = None,
            validation: float = DEFAULT_VALIDATION,
            lock_timeout: float = DataConfig.lock_timeout) -> tuple[str, bool]:
  """(name, built): the dataset of `source` under data_dir, built when missing or when its
  images changed since (`fingerprint`). Processes sharing data_dir take turns under a file lock:
  the first builds, the others wait (at most `lock_timeout` seconds, `stamps.locked`) and find it
  built. A build is complete or absent (renamed
  into place with its stamp inside), so a stamp that matches is a whole dataset."""
  name = auto_name(source, size)
  final = os.path.join(data_dir, "local_images", name)
  stamp = fingerprint(source, size, validation)
  with (stamps.building(f"local_images/{name}", data_dir),  # a full disk, from the lock on
        stamps.locked(os.path.dirname(final), name, lock_timeout)):
    if stamps.read(final) == stamp and os.path.isdir(os.path.join(final, str(LocalImages.VERSION))):
      return name, False
    if os.path.exists(final):
      print(f"jaxpar: the images of {source} changed since local_images/{name} was built; "
            f"rebuilding it", file=sys.stderr)
    build(source, data_dir, name, size=size, validation=validation, replace=True, stamp=stamp)
    return name, True
