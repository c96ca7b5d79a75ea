"""Token windows of a text split, read on demand: host memory follows the batch, not the split.

A split is the documents of a random-access record source (`tfds.data_source`, a builder's
`as_data_source`), each tokenised and followed by an end-of-document token, as one token stream
cut into windows of seq_len + 1 tokens; the tail shorter than a window is dropped. These are the
windows `loader.pack` makes, without ever holding the stream.

One streamed pass counts every document's tokens. Their running sum (8 bytes per document: 240 MB
for lm1b's 30M sentences, 0.4% of a split of 2 kB documents) maps a window's token offsets to the
documents it overlaps, and only those are read and tokenised when the window is asked for. A
document far longer than a window is read again for every window it feeds, so a batch costs
O(batch x (window + longest document)) memory and reading time.
"""
from __future__ import annotations

import os

import numpy as np

from jaxpar.config import ConfigError

COUNT_CHUNK = 64  # documents tokenised together by the counting pass: few, as they may be long
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


def end_of_text_id(tokenizer) -> int:
  """The tokenizer's end-of-document token (the first of END_OF_TEXT it knows), else id 0."""
  for token in END_OF_TEXT:
    i = tokenizer.token_to_id(token)
    if i is not None:
      return i
  return 0


def load_tokenizer(path: str):
  """A `tokenizers` JSON file (tokenizer.json, or a model folder holding one) -> Tokenizer; a
  bad path is one sentence."""
  if os.path.isdir(path):  # a Hugging Face model folder
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise ConfigError(f"data.tokenizer={path} does not exist (give a tokenizers JSON file, "
                      f"e.g. a tokenizer.json, or leave it empty for byte-level tokens)")
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # the library raises plain Exceptions for unparsable files
    raise ConfigError(f"data.tokenizer={path} is not a tokenizers JSON file ({e})") from None


def as_bytes(text) -> bytes:
  """A decoded Text feature (bytes, str or a 0-d array of either) as UTF-8 bytes."""
  if isinstance(text, np.ndarray):
    text = text.item()
  return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def shuffled(n: int, rng: np.random.Generator) -> np.ndarray:
  """rng.permutation(n), as int32 when n fits: [n], 4 bytes per entry instead of 8."""
  if n >= 2**31:
    return rng.permutation(n)
  out = np.arange(n, dtype=np.int32)
  rng.shuffle(out)  # the same order as rng.permutation(n): the shuffle does not depend on dtype
  return out


class TokenWindows:
  """Windows [n, seq_len + 1] of a split's token stream; rows are read when indexed.

  Documents are UTF-8 bytes as tokens (uint8) without a tokenizer, else its ids (int32); `eos`
  follows each one. Indexing by an int, a slice or a 1-D int array returns a new array, as
  indexing the packed array would. Safe to index from several threads when the source is.
  """

  def __init__(self, source, key: str, seq_len: int, eos: int, tokenizer=None):
    self._source, self._key, self._tokenizer, self.eos = source, key, tokenizer, eos
    self.dtype = np.dtype(np.uint8 if tokenizer is None else np.int32)
    self.width = seq_len + 1
    # starts[d] is the offset of document d's first token in the stream; starts[-1] its length.
    self._starts = np.zeros(len(source) + 1, np.int64)
    for lo in range(0, len(source), COUNT_CHUNK):
      keys = np.arange(lo, min(lo + COUNT_CHUNK, len(source)))
      self._starts[keys + 1] = [len(t) for t in self._tokens(keys)]
    np.cumsum(self._starts, out=self._starts)
    self.n = int(self._starts[-1] // self.width)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.n, self.width)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def tokens(self) -> int:
    """Tokens in the stream, the dropped tail included."""
    return int(self._starts[-1])

  def __len__(self) -> int:
    return self.n

  def _tokens(self, docs: np.ndarray) -> list[np.ndarray]:
    """Each document's tokens followed by the end-of-document token: [len + 1] each."""
    # One record at a time: __getitems__ was no faster on array_record and mocks lack it.
    texts = [as_bytes(self._source[int(d)][self._key]) for d in docs]
    if self._tokenizer is None:
      return [np.frombuffer(t + bytes([self.eos]), np.uint8) for t in texts]
    strings = [t.decode("utf-8", errors="replace") for t in texts]
    encoded = self._tokenizer.encode_batch(strings, add_special_tokens=False)
    return [np.asarray(e.ids + [self.eos], np.int32) for e in encoded]

  def __getitem__(self, index) -> np.ndarray:
    """Rows `index` of the windows: [len(rows), seq_len + 1], or [seq_len + 1] for an int."""
    if isinstance(index, (int, np.integer)):
      return self[np.asarray([index])][0]
    if isinstance(index, slice):
      index = range(self.n)[index]
    rows = np.asarray(index, np.int64).reshape(-1)
    if rows.size and (rows.min() < -self.n or rows.max() >= self.n):
      raise IndexError(f"window index out of range for {self.n} windows")
    rows = np.where(rows < 0, rows + self.n, rows)
    first = rows * self.width  # stream offset of each window's first token
    # starts strictly increases (every document has its end token), so these are exact.
    lo = np.searchsorted(self._starts, first, "right") - 1  # the document holding it
    hi = np.searchsorted(self._starts, first + self.width, "left")  # one past the last one
    docs = np.unique(np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)] or [lo]))
    tokens = dict(zip(docs.tolist(), self._tokens(docs)))  # each document read once per call
    out = np.empty((len(rows), self.width), self.dtype)
    for i, (start, d) in enumerate(zip(first.tolist(), lo.tolist())):
      filled = 0
      while filled < self.width:
        doc = tokens[d]
        if len(doc) != self._starts[d + 1] - self._starts[d]:
          raise RuntimeError(f"document {d} now has {len(doc)} tokens, not the "
                             f"{self._starts[d + 1] - self._starts[d]} counted: the split or the "
                             f"tokenizer changed while training")
        piece = doc[start + filled - self._starts[d]:][:self.width - filled]
        out[i, filled:filled + len(piece)] = piece
        filled += len(piece)
        d += 1
    return out

  def segment_ids(self, index) -> np.ndarray:
    """The documents of rows `index` (a 1-D int array) as segment ids [len(rows), seq_len + 1]
    int32 (models/segments.py): 1 from each row's first token, one more at each document's first
    token (a document's end token is its last). A document cut by a window's end goes on in the
    next window as its segment 1. From the token counts alone: nothing is read."""
    rows = np.asarray(index, np.int64).reshape(-1)
    rows = np.where(rows < 0, rows + self.n, rows)
    offsets = rows[:, None] * self.width + np.arange(self.width)  # stream offsets
    doc = np.searchsorted(self._starts, offsets, "right") - 1
    return (doc - doc[:, :1] + 1).astype(np.int32)


class DocumentWindows:
  """A TokenWindows' rows with their documents (data.packing=documents): indexing by a 1-D int
  array gives {'tokens', 'segment_ids'}, each [len(rows), seq_len + 1] int32 (models/segments.py),
  the windows themselves those of the TokenWindows."""

  def __init__(self, windows: TokenWindows):
    self.windows = windows

  @property
  def shape(self) -> tuple[int, int]:
    return self.windows.shape

  @property
  def ndim(self) -> int:
    return 2

  def __len__(self) -> int:
    return len(self.windows)

  def element_spec(self, rows: int) -> dict:
    leaf = ((rows, self.windows.width), np.dtype(np.int32))
    return {"tokens": leaf, "segment_ids": leaf}

  def __getitem__(self, index) -> dict:
    return {"tokens": self.windows[index].astype(np.int32),
            "segment_ids": self.windows.segment_ids(index)}


def check_position(state: dict, steps_per_epoch: int) -> tuple[int, int]:
  """(epoch, position) of a checkpoint's data state; ConfigError if this data cannot have it."""
  epoch, position = int(state["epoch"]), int(state["position"])
  if epoch < 0 or not 0 <= position < steps_per_epoch:
    raise ConfigError(f"the checkpoint's data position (epoch {epoch}, batch {position}) does not "
                      f"fit this data's {steps_per_epoch} batches per epoch: the data changed "
                      f"since it was saved")
  return epoch, position
