"""Byte-level tokens: the vocabulary every text source and the decoders share."""
from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256  # token = byte value
# NUL ends every document. local_text skips files that contain NUL, so the token is unambiguous.
SEPARATOR = 0


def tokenize(text: bytes | str) -> np.ndarray:
  """Bytes as tokens, a str as its UTF-8 bytes: [len] uint8. A str decoded from bytes with
  surrogateescape (argv and file names on Linux) gives back those bytes."""
  data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
  return np.frombuffer(data, dtype=np.uint8)
