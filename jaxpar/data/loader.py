"""Byte-level tokens, packing into fixed windows, and a deterministic, resumable batch iterator.

Numpy only: the caller passes jax.process_index()/process_count(), so this module never imports JAX.
`make_loader` is what the training loop uses: dict batches for every data.source. A local_text
split is never held whole: its windows are `TokenWindows`, read a batch at a time.
"""
from __future__ import annotations

import os
import queue
import threading
import zlib
from typing import Iterable

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.tokens import SEPARATOR, VOCAB_SIZE, tokenize
from jaxpar.data.windows import (DocumentWindows, TokenWindows, check_position, end_of_text_id,
                                  load_tokenizer, shuffled)

SYNTHETIC_WINDOWS = 4096


def pack(docs: Iterable[bytes | str], seq_len: int) -> np.ndarray:
  """Documents, each followed by SEPARATOR, cut into disjoint windows: [N, seq_len + 1] uint8.

  The tail shorter than a window is dropped.
  """
  sep = bytes([SEPARATOR])
  stream = b"".join((d.encode("utf-8") if isinstance(d, str) else d) + sep for d in docs)
  n = len(stream) // (seq_len + 1)
  return tokenize(stream[:n * (seq_len + 1)]).reshape(n, seq_len + 1)


def inputs_targets(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """[B, seq_len + 1] -> inputs [B, seq_len], targets [B, seq_len] (inputs shifted by one)."""
  return batch[:, :-1], batch[:, 1:]


def synthetic_windows(seq_len: int, seed: int, n: int = SYNTHETIC_WINDOWS) -> np.ndarray:
  """Seeded bytes a model can learn: [n, seq_len + 1] uint8.

  Each byte is followed by a fixed successor 3 times in 4, else by a random byte, so the loss of a
  model that learns the chain drops well below log(256).
  """
  rng = np.random.default_rng([seed % 2**32, 0x5EED])
  successor = rng.permutation(VOCAB_SIZE).astype(np.uint8)
  noise = rng.integers(0, VOCAB_SIZE, (n, seq_len + 1), dtype=np.uint8)
  follow = rng.random((n, seq_len + 1)) < 0.75
  out = noise.copy()
  for t in range(1, seq_len + 1):
    out[:, t] = np.where(follow[:, t], successor[out[:, t - 1]], noise[:, t])
  return out


class _Plan:
  """Which rows of `windows` make batch (epoch, position) for one process; caches one epoch.

  `windows` is an array [N, seq_len + 1] or a `TokenWindows`, which reads only the rows asked for,
  or a `jsonl.PackedRecords`, whose rows are dicts of such arrays.
  """

  def __init__(self, windows, global_batch, seed, process_index, process_count):
    self.windows = windows
    self.global_batch = global_batch
    self.seed = seed % 2**32
    self.local = global_batch // process_count
    self.offset = process_index * self.local
    self.steps_per_epoch = len(windows) // global_batch
    self._epoch, self._order = -1, None
    self._full = None  # epoch 0's whole order (padded)

  def order(self, epoch: int) -> np.ndarray:
    """Shuffled window indices of an epoch, remainder dropped: [steps_per_epoch * global_batch]."""
    if epoch != self._epoch:
      perm = shuffled(len(self.windows), np.random.default_rng([self.seed, epoch]))
      self._epoch, self._order = epoch, perm[:self.steps_per_epoch * self.global_batch]
    return self._order

  def batch(self, epoch: int, position: int) -> np.ndarray:
    """This process's contiguous share of global batch `position`: [local, seq_len + 1] int32."""
    start = position * self.global_batch + self.offset
    rows = self.order(epoch)[start:start + self.local]
    return self.take(rows)

  def take(self, rows: np.ndarray):
    """Windows `rows`: [len(rows), seq_len + 1] int32, or a dict of such arrays."""
    out = self.windows[rows]
    return out if isinstance(out, dict) else out.astype(np.int32)

  def whole(self) -> int:
    """Batches that cover every window once, the last one padded (`padded`)."""
    return -(-len(self.windows) // self.global_batch)

  def padded(self, position: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `position` of epoch 0's order with the remainder kept: (this process's share
    [local, seq_len + 1] int32, weight [local] float32, 0 on rows past the split's end, which
    repeat its first window). The first steps_per_epoch are `batch(0, position)`."""
    if self._full is None:
      self._full = shuffled(len(self.windows), np.random.default_rng([self.seed, 0]))
    start = position * self.global_batch + self.offset
    rows = self._full[start:start + self.local]
    weight = (np.arange(self.local) < len(rows)).astype(np.float32)
    rows = np.concatenate([rows, np.full(self.local - len(rows), self._full[0], rows.dtype)])
    return self.take(rows), weight

  def after(self, epoch: int, position: int) -> tuple[int, int]:
    position += 1
    return (epoch + 1, 0) if position == self.steps_per_epoch else (epoch, position)


def _produce(plan: _Plan, epoch: int, position: int, out: queue.Queue, stop: threading.Event):
  """Prefetch thread: fills `out` with (epoch, position, batch) in order until `stop` is set."""
  def put(item) -> bool:
    while not stop.is_set():
      try:
        out.put(item, timeout=0.05)
        return True
      except queue.Full:
        pass
    return False

  while True:
    try:
      item = (epoch, position, plan.batch(epoch, position))
    except BaseException as e:  # handed to the consumer, which re-raises it
      put((epoch, position, e))
      return
    if not put(item):
      return
    epoch, position = plan.after(epoch, position)


class BatchIterator:
  """Endless batches [global_batch // process_count, seq_len + 1] int32, reshuffled every epoch.

  Every process computes the same permutation from (seed, epoch) and takes rows
  [pi * B / pc, (pi + 1) * B / pc) of each global batch, so hosts read disjoint windows.
  state() counts batches handed out by next(), never those only prefetched.
  """

  def __init__(self, windows: np.ndarray, global_batch: int, seed: int, process_index: int = 0,
               process_count: int = 1, prefetch: int = 2):
    if windows.ndim != 2 or windows.shape[1] < 2:
      raise ValueError(f"windows must have shape [N, seq_len + 1], got {windows.shape}")
    if global_batch <= 0 or global_batch % process_count:
      raise ValueError(f"global_batch={global_batch} must be a positive multiple of "
                       f"process_count={process_count}")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    if len(windows) < global_batch:
      raise ValueError(f"the dataset has {len(windows)} windows of {windows.shape[1]} tokens, "
                       f"fewer than one global batch of {global_batch}.")
    self._plan = _Plan(windows, global_batch, seed, process_index, process_count)
    self.prefetch = prefetch
    self.epoch, self.position = 0, 0
    self._thread = None
    self._start()

  @property
  def steps_per_epoch(self) -> int:
    return self._plan.steps_per_epoch

  @property
  def whole_split_steps(self) -> int:
    """Padded batches that cover every window (the last one partly padding)."""
    return self._plan.whole()

  def padded_batch(self, position: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch, weight) `position` of the whole split in epoch 0's order (_Plan.padded)."""
    return self._plan.padded(position)

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    return self.next()

  def next(self) -> np.ndarray:
    """The next batch for this process: [global_batch // process_count, seq_len + 1] int32."""
    if self._thread is None:
      batch = self._plan.batch(self.epoch, self.position)
    else:
      epoch, position, batch = self._queue.get()
      if isinstance(batch, BaseException):
        self._stop()
        raise batch
      assert (epoch, position) == (self.epoch, self.position)
    self.epoch, self.position = self._plan.after(self.epoch, self.position)
    return batch

  def state(self) -> dict:
    """Where the next batch comes from: {'epoch': int, 'position': int} (plain ints)."""
    return {"epoch": int(self.epoch), "position": int(self.position)}

  def restore(self, state: dict) -> None:
    """Continues exactly where the iterator that produced `state` would have."""
    epoch, position = check_position(state, self.steps_per_epoch)
    self._stop()
    self.epoch, self.position = epoch, position
    self._start()

  def close(self) -> None:
    """Stops the prefetch thread; next() still works, without prefetching."""
    self._stop()

  def __del__(self):
    self._stop()

  def _start(self):
    if self.prefetch <= 0:
      return
    self._queue = queue.Queue(maxsize=self.prefetch)
    self._stop_event = threading.Event()
    # The thread gets the plan, not self, so a dropped iterator can still be collected.
    self._thread = threading.Thread(
        target=_produce, name="jaxpar-prefetch", daemon=True,
        args=(self._plan, self.epoch, self.position, self._queue, self._stop_event))
    self._thread.start()

  def _stop(self):
    thread = getattr(self, "_thread", None)
    if thread is None:
      return
    self._stop_event.set()
    thread.join()
    self._thread = None


def make_batches(data_cfg, seq_len: int, global_batch: int, seed: int, workdir: str,
                 process_index: int = 0, process_count: int = 1, split: str = "train",
                 prefetch: int = 2, tokenizer=None, documents: bool = False) -> BatchIterator:
  """Iterator over data_cfg.source: batches [global_batch // process_count, seq_len + 1] int32
  (jsonl: dicts of them, jsonl.PackedRecords' rows).

  local_text's documents are bytes, or the ids of `tokenizer` (a `tokenizers.Tokenizer`), each
  ended by its end-of-text id; with `documents` (make_loader's under data.packing=documents) a
  batch is {'tokens', 'segment_ids'} (windows.DocumentWindows)."""
  if data_cfg.source == "synthetic":
    # at least one global batch (more windows than the default only when the batch needs them)
    windows = synthetic_windows(seq_len, seed + zlib.crc32(split.encode()),
                                max(SYNTHETIC_WINDOWS, global_batch))
    what = "synthetic data"
  elif data_cfg.source == "local_text":
    from jaxpar.data import local_text  # imports TFDS, which synthetic data does not need
    data_dir = data_cfg.data_dir or os.path.join(workdir, "data")
    builder = local_text.prepare(data_dir, data_cfg.path, data_cfg.max_bytes,
                                 data_cfg.lock_timeout)
    source = local_text.data_source(builder, split)
    windows = (TokenWindows(source, "text", seq_len, end_of_text_id(tokenizer), tokenizer)
               if tokenizer is not None else TokenWindows(source, "text", seq_len, SEPARATOR))
    if documents:  # which document each token is of, beside the tokens (models/segments.py)
      windows = DocumentWindows(windows)
    what = f"local_text split {split!r} ({builder.builder_config.description})"
  elif data_cfg.source == "jsonl":
    from jaxpar.data import jsonl  # reads JSON Lines; transformers or jinja2 for chat templates
    encoder = jsonl.Encoder(tokenizer, data_cfg.tokenizer if tokenizer is not None else "")
    windows = jsonl.PackedRecords(jsonl.split_file(data_cfg.path, split), seq_len, encoder,
                                  split_long=data_cfg.long_records == "split")
    what = (f"jsonl split {split!r} ({windows.records} records, {windows.tokens} tokens, "
            f"{windows.padding():.1%} padding)")
  elif data_cfg.source == "tfds":
    raise ValueError("data.source=tfds is not supported yet by make_batches, which yields token "
                     "arrays; make_loader reads it")
  else:
    raise ValueError(f"unknown data.source {data_cfg.source!r}; use local_text, jsonl or "
                     f"synthetic")
  if len(windows) < global_batch:
    raise ValueError(f"{what} yields {len(windows)} windows of seq_len + 1 = {seq_len + 1} tokens, "
                     f"fewer than one global batch of {global_batch}.")
  return BatchIterator(windows, global_batch, seed, process_index, process_count, prefetch)


class TokenBatches:
  """A BatchIterator's batches as {'tokens': [global_batch // process_count, seq_len + 1] int32}
  (and, from jsonl, 'segment_ids' int32 and 'loss_mask' float32 of that shape)."""

  def __init__(self, it: BatchIterator):
    self._it = it
    self.steps_per_epoch = it.steps_per_epoch
    plan = it._plan
    self.element_spec = (plan.windows.element_spec(plan.local)
                         if hasattr(plan.windows, "element_spec") else
                         {"tokens": ((plan.local, plan.windows.shape[1]), np.dtype(np.int32))})
    # how the records packed (jsonl's windows), a line for the run's start-up; None otherwise
    self.summary = plan.windows.summary() if hasattr(plan.windows, "summary") else None

  def next(self) -> dict:
    return self._as_dict(self._it.next())

  @staticmethod
  def _as_dict(batch) -> dict:
    return batch if isinstance(batch, dict) else {"tokens": batch}

  @property
  def whole_split_steps(self) -> int:
    return self._it.whole_split_steps

  def padded_batch(self, position: int) -> tuple[dict, np.ndarray]:
    batch, weight = self._it.padded_batch(position)
    return self._as_dict(batch), weight

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return self.next()

  def state(self) -> dict:
    return self._it.state()

  def restore(self, state: dict) -> None:
    self._it.restore(state)

  def close(self) -> None:
    self._it.close()


def make_loader(cfg, workdir: str, process_index: int = 0, process_count: int = 1,
                split: str | None = None, train: bool = True):
  """Dict batches of `split` (default data.split) for one process, for any data.source.

  The result has next() -> {name: [global_batch // process_count, ...] array}, `element_spec`
  ({name: (shape, dtype)} of those arrays), `steps_per_epoch`, state(), restore() and close();
  for evaluation, `whole_split_steps` and padded_batch(k) -> (batch, weight [local] float32):
  batch k of epoch 0 with the remainder kept, rows past the split's end weight 0.
  `train=False` turns augmentation off. Bad data settings raise ConfigError.
  """
  split = split or cfg.data.split
  if cfg.data.source == "images":
    cfg = images_as_tfds(cfg, workdir)
  if cfg.data.source == "tfds":
    from jaxpar.data import tfds_source  # imports grain and TFDS only when needed
    return tfds_source.make_batches(cfg, split, process_index, process_count, train)
  if cfg.model.kind == "cnn":  # the decoders (gpt, llama) read text
    raise ConfigError(f"model.kind={cfg.model.kind} needs images: set data.source=images and "
                      f"data.path to a folder of them, or data.source=tfds and data.name to an "
                      f"image dataset such as cifar10")
  tokenizer = None
  if cfg.data.tokenizer:
    if cfg.data.source not in ("local_text", "jsonl"):
      raise ConfigError(f"data.tokenizer applies to text files (data.source=local_text or "
                        f"jsonl) and TFDS text; data.source={cfg.data.source} gives byte tokens "
                        f"(unset data.tokenizer)")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
  vocab = tokenizer.get_vocab_size() if tokenizer is not None else VOCAB_SIZE
  if cfg.model.vocab_size < vocab:  # an id past the embedding would make the loss NaN
    raise ConfigError(f"data.tokenizer needs model.vocab_size >= {vocab}, got "
                      f"{cfg.model.vocab_size}" if tokenizer is not None else
                      f"data.source={cfg.data.source} gives byte tokens, which need "
                      f"model.vocab_size >= {VOCAB_SIZE} (it is {cfg.model.vocab_size})")
  try:
    it = make_batches(cfg.data, cfg.model.seq_len, cfg.train.batch_size, cfg.train.seed, workdir,
                      process_index, process_count, split=split,
                      prefetch=2 if cfg.data.workers else 0,  # one thread, two batches ahead
                      tokenizer=tokenizer, documents=cfg.data.packing == "documents")
  except ValueError as e:
    raise ConfigError(str(e).rstrip(".")) from None
  return TokenBatches(it)


def images_as_tfds(cfg, workdir: str):
  """`cfg` (data.source=images) reading the TFDS dataset its data.path is built into under
  data.data_dir (default <workdir>/data): built now if missing or stale (local_images.prepare)."""
  import dataclasses

  from jaxpar.data import local_images, tfds_source  # import TFDS and grain only when needed
  data = cfg.data
  data_dir = os.path.abspath(data.data_dir or os.path.join(workdir, "data"))
  size = local_images.parse_size(data.image_size, "data.image_size=") if data.image_size else None
  classes = local_images.class_names(data.path)
  if len(classes) > cfg.model.num_classes:  # said before anything is built
    raise ConfigError(f"data.path={data.path} has {len(classes)} classes, more than "
                      f"model.num_classes={cfg.model.num_classes} (left unset, it follows the "
                      f"classes)")
  name, built = local_images.prepare(data.path, data_dir, size, lock_timeout=data.lock_timeout)
  if built:  # a dataset of that name read before in this process is gone
    tfds_source.open_dataset.cache_clear()
  data = dataclasses.replace(data, source="tfds", name=f"local_images/{name}", data_dir=data_dir)
  return dataclasses.replace(cfg, data=data)


def image_shape(data_cfg) -> tuple[int, int, int]:
  """(height, width, channels) of the configured image dataset; ConfigError if there is none."""
  if data_cfg.source == "images":  # read from the images themselves: nothing is built
    from jaxpar.data import local_images  # imports TFDS: only for images
    size = (local_images.parse_size(data_cfg.image_size, "data.image_size=")
            if data_cfg.image_size else None)
    return local_images.read(local_images.source_path(data_cfg.path), None, size).shape
  if data_cfg.source != "tfds":
    raise ConfigError(f"model.kind=cnn needs images, but data.source={data_cfg.source} is text: "
                      f"set data.source=tfds and data.name to an image dataset such as cifar10")
  from jaxpar.data import tfds_source  # imports grain and TFDS only when needed
  ds = tfds_source.open_dataset(data_cfg.name, data_cfg.data_dir)
  if ds.kind != "image":
    raise ConfigError(f"model.kind=cnn needs images, but TFDS dataset {ds.name} is text")
  return ds.image_shape


def batch_spec(cfg) -> dict:
  """{name: (shape, dtype)} of the global batch the model takes, from the config alone.

  For tools that compile the step without reading data (plan.py); the loop uses its loader's
  element_spec instead.
  """
  b = cfg.train.batch_size
  if cfg.model.kind == "cnn":
    return {"image": ((b, *image_shape(cfg.data)), np.dtype(np.float32)),
            "label": ((b,), np.dtype(np.int32))}
  shape = (b, cfg.model.seq_len + 1)
  if cfg.data.source == "jsonl":  # packed records: which record each token is of, and answers
    return {"tokens": (shape, np.dtype(np.int32)), "segment_ids": (shape, np.dtype(np.int32)),
            "loss_mask": (shape, np.dtype(np.float32))}
  if cfg.data.source in ("local_text", "tfds") and cfg.data.packing == "documents":
    return {"tokens": (shape, np.dtype(np.int32)), "segment_ids": (shape, np.dtype(np.int32))}
  return {"tokens": (shape, np.dtype(np.int32))}
