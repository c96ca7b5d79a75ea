"""`data.source=tfds`: any prepared TFDS dataset, read by random access and batched with grain.

Records come from `tfds.data_source` (array_record files, no TensorFlow). Text: every process
shuffles all windows every epoch from (seed, epoch), the same order everywhere, and reads its
contiguous part of each global batch, so the batches do not depend on the process count. Images:
each process reads a contiguous shard of the split (`shard_range`, the split grain's
`ShardOptions` make) and reshuffles that every epoch (a shard can be kept in memory); a
checkpoint stopped mid-epoch then resumes only with the same process count. Batches are built
in grain's background threads (`data.workers`), one batch per task, so normalising and augmenting
run vectorised over the batch.

Text datasets (a `Text` feature, preferably 'text') become byte tokens (or a tokenizer's ids):
every document followed by an end token, cut into `seq_len + 1` windows, with each token's
document as `segment_ids` under data.packing=documents (the default). Window boundaries depend
on all earlier documents, so every host first counts the tokens of every document (one streamed
pass over the split; see `windows.TokenWindows`); it then reads only the documents its part of a
batch overlaps, a batch at a time. Host memory is the count index (8 bytes a document), this
epoch's order of the windows (4 bytes a window) and the batches in flight, never the split.

Image datasets ('image' and a `ClassLabel` 'label') give float32 images normalised by per-channel
mean and std (estimated from a fixed sample of `data.split`, identical on every host) and int32
labels. A shard whose decoded images fit in `CACHE_BYTES` is read once and kept in memory (CIFAR-10
is 150 MB); larger shards are read record by record every epoch.
"""
from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import grain
import numpy as np
import tensorflow_datasets as tfds

from jaxpar.config import ConfigError
from jaxpar.data.tokens import SEPARATOR, VOCAB_SIZE
from jaxpar.data.windows import (DocumentWindows, TokenWindows, check_position, end_of_text_id,
                                  load_tokenizer, shuffled)
from jaxpar.logs import quiet_absl

CACHE_BYTES = 1 << 30  # a host keeps its image shard in memory up to this many decoded bytes
STATS_SAMPLE = 512  # images of the training split that estimate the per-channel mean and std
CROP_PAD = 4  # random crops: pad by this many pixels on each side, then crop back
_ENDLESS = sys.maxsize  # batches: the pipeline is indexed by the running batch count


def shard_range(num_records: int, options: grain.sharding.ShardOptions) -> tuple[int, int]:
  """[start, end) of the records shard `options.shard_index` reads.

  Contiguous, sizes differ by at most one, and all shards together cover every record: the
  interval grain gives `ShardOptions(index, count, drop_remainder=False)`.
  """
  per_shard, extra = divmod(num_records, options.shard_count)
  i = options.shard_index
  return per_shard * i + min(i, extra), per_shard * (i + 1) + min(i + 1, extra)


@dataclass(frozen=True)
class Dataset:
  """A TFDS dataset's identity and what jaxpar makes of its features."""
  name: str
  data_dir: str | None  # None = TFDS's default data dir
  kind: str  # "text" or "image"
  text_key: str = ""
  image_shape: tuple[int, int, int] = (0, 0, 0)  # (H, W, C)
  num_classes: int = 0


def _where(data_dir: str | None) -> str:
  return data_dir or "the TFDS default data dir (~/tensorflow_datasets or $TFDS_DATA_DIR)"


@functools.lru_cache(maxsize=16)
def open_dataset(name: str, data_dir: str = "") -> Dataset:
  """Finds `name` and classifies its features; ConfigError when it is unknown or unusable."""
  try:
    with quiet_absl():  # "Variant folder ... has no dataset_info.json" when it is not built yet
      builder = tfds.builder(name, data_dir=data_dir or None)
      features = builder.info.features
  except tfds.core.registered.DatasetNotFoundError:
    raise ConfigError(f"data.name={name!r} is not a TFDS dataset "
                      f"(tfds.list_builders() lists the known names)") from None
  texts = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
  image = features["image"] if "image" in features else None
  label = features["label"] if "label" in features else None
  if isinstance(image, tfds.features.Image) and isinstance(label, tfds.features.ClassLabel):
    shape = tuple(image.shape)
    if len(shape) != 3 or None in shape:
      raise ConfigError(f"TFDS dataset {name} has images of shape {shape}; jaxpar needs one fixed "
                        f"(height, width, channels)")
    return Dataset(name, data_dir or None, "image", image_shape=shape,
                   num_classes=label.num_classes)
  if texts:
    return Dataset(name, data_dir or None, "text", text_key="text" if "text" in texts else texts[0])
  raise ConfigError(f"TFDS dataset {name} has neither a Text feature nor 'image' and 'label' "
                    f"features (it has {', '.join(features)})")


def data_source(ds: Dataset, split: str):
  """Random access to a split through `tfds.data_source`; ConfigError if it cannot be read."""
  try:
    with quiet_absl():
      return tfds.data_source(ds.name, split=split, data_dir=ds.data_dir, download=False)
  except Exception as e:  # tfds raises several types; decide from what is on disk
    with quiet_absl():
      builder = tfds.builder(ds.name, data_dir=ds.data_dir)
      prepared = builder.is_prepared()
    if not prepared:
      raise ConfigError(
          f"TFDS dataset {ds.name} is not prepared in {_where(ds.data_dir)}: run `tfds build "
          f"{ds.name} --file_format=array_record` on a machine with internet, copy the data dir "
          f"it writes here and set data.data_dir to it") from None
    fmt = builder.info.file_format
    if fmt is not None and fmt.value != "array_record":
      raise ConfigError(
          f"TFDS dataset {ds.name} in {builder.data_dir} is stored as {fmt.value}, which has no "
          f"random access: rebuild it with `tfds build {ds.name} --file_format=array_record`"
      ) from None
    splits = ", ".join(builder.info.splits)
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    raise ConfigError(f"TFDS dataset {ds.name} cannot read split {split!r} (its splits: {splits}; "
                      f"slices like train[:90%] work too): {reason}") from None


def _read_one(source, key: int) -> Any:
  """One decoded record; a missing image decoder becomes a one-sentence ConfigError."""
  try:
    return source[int(key)]
  except ImportError as e:
    raise ConfigError(f"decoding the images of this dataset needs pillow or opencv-python "
                      f"(pip install pillow): {type(e).__name__}") from None


def _stream(source, start: int, stop: int, fn: Callable[[Any], Any], workers: int):
  """fn(record) for records [start, stop) in order, read in grain's background threads."""
  ds = grain.MapDataset.range(start, stop).map(lambda k: fn(_read_one(source, k)))
  options = grain.ReadOptions(num_threads=max(workers, 1), prefetch_buffer_size=256)
  return ds.to_iter_dataset(options)


def text_windows(source, key: str, seq_len: int, tokenizer=None) -> TokenWindows:
  """Each document's tokens and an end token, in split order, as windows [N, seq_len + 1].

  Bytes (uint8, ended by SEPARATOR) without a tokenizer: the windows of `loader.pack`. With a
  `tokenizers.Tokenizer`: its ids (int32), each document ended by its end-of-text id. Rows are
  read when indexed; building it streams the split once to count tokens.
  """
  eos = SEPARATOR if tokenizer is None else end_of_text_id(tokenizer)
  return TokenWindows(source, key, seq_len, eos, tokenizer)


def image_stats(ds: Dataset, split: str) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and std of pixels / 255 over a fixed sample of `split`: ([C], [C]) float32."""
  source = data_source(ds, split)
  keys = np.unique(np.linspace(0, len(source) - 1, min(len(source), STATS_SAMPLE)).astype(np.int64))
  pixels = np.stack([np.asarray(_read_one(source, k)["image"]) for k in keys])
  pixels = pixels.reshape(-1, pixels.shape[-1]).astype(np.float64) / 255.0
  std = np.maximum(pixels.std(axis=0), 1e-3)  # a constant channel must not divide by zero
  return pixels.mean(axis=0).astype(np.float32), std.astype(np.float32)


def normalize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
  """uint8 [B, H, W, C] -> float32 [B, H, W, C], per-channel (x / 255 - mean) / std."""
  # Per-pixel copies of the per-channel factors: broadcasting a length-C last axis makes numpy
  # loop over C values at a time, which was 10x slower than broadcasting whole images.
  shape = images.shape[1:]
  scale = np.broadcast_to((1.0 / (255.0 * std)).astype(np.float32), shape)
  offset = np.broadcast_to((mean / std).astype(np.float32), shape)
  out = images.astype(np.float32)
  out *= np.ascontiguousarray(scale)
  out -= np.ascontiguousarray(offset)
  return out


def augment(images: np.ndarray, rng: np.random.Generator, pad: int = CROP_PAD) -> np.ndarray:
  """Random horizontal flips and `pad`-pixel random crops: [B, H, W, C] -> [B, H, W, C].

  A crop of the image zero-padded by `pad` is the image shifted by up to `pad` pixels with zeros
  shifted in, which after normalisation is the mean colour.
  """
  b, h, w, _ = images.shape
  flip = rng.random(b) < 0.5
  dy, dx = rng.integers(-pad, pad + 1, size=(2, b))
  out = np.zeros_like(images)
  for i in range(b):  # two slices per image: far cheaper than padding or gathering by index
    src = images[i, :, ::-1] if flip[i] else images[i]
    y, x = dy[i], dx[i]  # out[r, c] = src[r + y, c + x]
    out[i, max(-y, 0):h - max(y, 0), max(-x, 0):w - max(x, 0)] = \
        src[max(y, 0):h - max(-y, 0), max(x, 0):w - max(-x, 0)]
  return out


class Batches:
  """Endless per-host batches (dicts of arrays) from one shard, reshuffled every epoch.

  `read(keys)` turns shard-local record indices into a dict of stacked arrays; `transform(batch,
  rng)` may change it, rng drawn from (seed, epoch, position, shard_index). Epoch e uses the first
  steps_per_epoch * local_batch indices of the shard's permutation drawn from (seed, e).
  steps_per_epoch comes from the split size alone, so every host has the same one. Batch k is a
  pure function of k, which makes state() and restore() exact.
  """

  def __init__(self, read: Callable[[np.ndarray], dict], shard_size: int, records_per_host: int,
               local_batch: int, seed: int, element_spec: dict, what: str,
               transform: Callable[[dict, np.random.Generator], dict] | None = None,
               workers: int = 2, prefetch: int = 4, shard_index: int = 0, shard_count: int = 1,
               shared: bool = False, records: int | None = None):
    # records: the split's size (every shard's records), which sets whole_split_steps
    # shared: the "shard" is the whole split, and this process takes its contiguous part of each
    # global batch (shard_count parts), so the order does not depend on the process count.
    self._stride = local_batch * shard_count if shared else local_batch
    self._offset = local_batch * shard_index if shared else 0
    self.steps_per_epoch = records_per_host // local_batch
    if self.steps_per_epoch == 0:
      raise ConfigError(f"{what} gives each process {records_per_host} examples, fewer than its "
                        f"batch of {local_batch}; lower train.batch_size or use a larger split")
    records = records_per_host * shard_count if records is None else records
    # Shards differ by at most one record: the largest, ceil(records / shard_count), takes
    # ceil(records / global batch) batches, which every process runs.
    self.whole_split_steps = -(-records // (local_batch * shard_count))
    self.element_spec = element_spec  # name -> (shape, dtype) of this process's batch
    self._read, self._transform = read, transform
    self._shard_size, self._local, self._seed = shard_size, local_batch, seed % 2**32
    self._shard_index = shard_index
    self._per_process = None if shared else shard_count  # the order depends on it
    self._orders: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()
    self._options = grain.ReadOptions(num_threads=workers,
                                      prefetch_buffer_size=max(prefetch, workers) if workers else 0)
    self._dataset = grain.MapDataset.range(_ENDLESS).map(self.batch)
    self._count = 0  # batches handed out by next()
    self._iter = None

  def _order(self, epoch: int) -> np.ndarray:
    """Shard-local record indices of an epoch: a permutation of [0, shard_size)."""
    with self._lock:
      if epoch not in self._orders:
        self._orders[epoch] = shuffled(self._shard_size, np.random.default_rng([self._seed, epoch]))
        for old in [e for e in self._orders if e < epoch - 1]:  # threads may straddle one boundary
          del self._orders[old]
      return self._orders[epoch]

  def batch(self, k: int) -> dict:
    """The k-th batch this process hands out (k counts from the start of epoch 0)."""
    epoch, position = divmod(int(k), self.steps_per_epoch)
    start = position * self._stride + self._offset
    keys = self._order(epoch)[start:start + self._local]
    out = self._read(keys)
    if self._transform is not None:
      # Without the shard index, equal shard sizes give every host the same flips and crops.
      rng = np.random.default_rng([self._seed, epoch, position, 1, self._shard_index])
      out = self._transform(out, rng)
    return out

  def padded_batch(self, k: int) -> tuple[dict, np.ndarray]:
    """Batch k of epoch 0 with the remainder kept: (batch, weight [local] float32), rows past
    the shard's end repeating its first record at weight 0. The first steps_per_epoch are
    `batch(k)`."""
    order = self._order(0)
    start = k * self._stride + self._offset
    keys = order[start:start + self._local]
    weight = (np.arange(self._local) < len(keys)).astype(np.float32)
    keys = np.concatenate([keys, np.full(self._local - len(keys), order[0], order.dtype)])
    out = self._read(keys)
    if self._transform is not None:
      out = self._transform(out, np.random.default_rng([self._seed, 0, k, 1, self._shard_index]))
    return out, weight

  def next(self) -> dict:
    """The next batch: arrays shaped as element_spec."""
    if self._iter is None:
      self._iter = iter(self._dataset[self._count:].to_iter_dataset(self._options))
    out = next(self._iter)
    self._count += 1
    return out

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return self.next()

  def state(self) -> dict:
    """Where the next batch comes from: {'epoch': int, 'position': int}."""
    epoch, position = divmod(self._count, self.steps_per_epoch)
    state = {"epoch": int(epoch), "position": int(position)}
    if self._per_process:
      state["processes"] = self._per_process
    return state

  def restore(self, state: dict) -> None:
    """Continues exactly where the iterator that produced `state` would have."""
    epoch, position = check_position(state, self.steps_per_epoch)
    was = state.get("processes", self._per_process)
    if self._per_process and position and was != self._per_process:
      raise ConfigError(f"the checkpoint stopped mid-epoch with {was} processes; this dataset's "
                        f"images are shuffled per process, so resume it with {was} processes "
                        f"(another count would repeat and skip examples of the epoch)")
    self.close()
    self._count = epoch * self.steps_per_epoch + position

  def close(self) -> None:
    """Stops the background threads; next() starts them again."""
    if getattr(self, "_iter", None) is not None:  # __del__ may run on a half-built object
      self._iter.close()
      self._iter = None

  def __del__(self):
    self.close()


def _text_batches(ds: Dataset, source, cfg, global_batch: int, shard, workers: int, what: str):
  if cfg.model.kind == "cnn":  # the decoders (gpt, llama) read text
    raise ConfigError(f"model.kind={cfg.model.kind} needs images, but {what} is text")
  tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
  vocab = tokenizer.get_vocab_size() if tokenizer else VOCAB_SIZE
  if cfg.model.vocab_size < vocab:
    raise ConfigError(f"{'data.tokenizer' if tokenizer else 'byte-level tokens'} need"
                      f"{'s' if tokenizer else ''} model.vocab_size >= {vocab}, "
                      f"got {cfg.model.vocab_size}")
  seq = cfg.model.seq_len
  windows = text_windows(source, ds.text_key, seq, tokenizer)
  # One order of all windows, the same on every process: each takes its part of every global
  # batch, so the batches (and the losses) do not depend on how many processes read them.
  local = global_batch // shard.shard_count
  if cfg.data.packing == "documents":  # which document each token is of (models/segments.py)
    documents = DocumentWindows(windows)
    read, spec = documents.__getitem__, documents.element_spec(local)
  else:
    read = lambda keys: {"tokens": windows[keys].astype(np.int32)}
    spec = {"tokens": ((local, seq + 1), np.dtype(np.int32))}
  return Batches(read, len(windows), len(windows) // shard.shard_count, local, cfg.train.seed,
                 spec, f"{what} ({len(windows)} windows of {seq + 1} tokens)", workers=workers,
                 shard_index=shard.shard_index, shard_count=shard.shard_count, shared=True,
                 records=len(windows))


def _image_batches(ds: Dataset, source, cfg, global_batch: int, shard, train: bool,
                   workers: int, what: str):
  if cfg.model.kind != "cnn":
    raise ConfigError(f"model.kind={cfg.model.kind} needs text, but {what} is images")
  if ds.num_classes > cfg.model.num_classes:
    raise ConfigError(f"{what} has {ds.num_classes} classes, more than "
                      f"model.num_classes={cfg.model.num_classes}")
  mean, std = image_stats(ds, cfg.data.split)
  lo, hi = shard_range(len(source), shard)
  h, w, c = ds.image_shape
  if (hi - lo) * h * w * c <= CACHE_BYTES:
    images = np.empty((hi - lo, h, w, c), np.uint8)
    labels = np.empty((hi - lo,), np.int32)
    records = _stream(source, lo, hi, lambda ex: (ex["image"], ex["label"]), workers)
    for i, (image, label) in enumerate(records):
      images[i], labels[i] = image, label

    def read(keys):
      return {"image": images[keys], "label": labels[keys]}
  else:
    def read(keys):
      recs = [_read_one(source, lo + k) for k in keys]
      return {"image": np.stack([np.asarray(r["image"]) for r in recs]),
              "label": np.asarray([r["label"] for r in recs], np.int32)}

  def transform(batch, rng):
    image = normalize(batch["image"], mean, std)
    if train and cfg.data.augment:
      image = augment(image, rng)
    return {"image": image, "label": batch["label"]}
  local = global_batch // shard.shard_count
  spec = {"image": ((local, h, w, c), np.dtype(np.float32)),
          "label": ((local,), np.dtype(np.int32))}
  return Batches(read, hi - lo, len(source) // shard.shard_count, local, cfg.train.seed, spec, what,
                 transform=transform, workers=workers, shard_index=shard.shard_index,
                 shard_count=shard.shard_count, records=len(source))


def make_batches(cfg, split: str, process_index: int = 0, process_count: int = 1,
                 train: bool = True) -> Batches:
  """Batches of `split` of the configured TFDS dataset for one process (see the module doc)."""
  ds = open_dataset(cfg.data.name, cfg.data.data_dir)
  source = data_source(ds, split)
  shard = grain.sharding.ShardOptions(shard_index=process_index, shard_count=process_count)
  what = f"TFDS {ds.name} split {split!r}"
  if ds.kind == "text":
    return _text_batches(ds, source, cfg, cfg.train.batch_size, shard, cfg.data.workers, what)
  return _image_batches(ds, source, cfg, cfg.train.batch_size, shard, train, cfg.data.workers, what)
