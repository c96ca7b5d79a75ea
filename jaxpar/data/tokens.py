"""Byte-level tokens: the vocabulary every text source and the decoders share."""
from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256  # token = byte value
# NUL ends every document. local_text skips files that contain NUL, so the token is unambiguous.
SEPARATOR = 0


def tokenize(text: bytes | str) -> np.ndarray:
  """UTF-8 bytes as tokens: [len] uint8."""
  data = text.encode("utf-8") if isinstance(text, str) else text
  return np.frombuffer(data, dtype=np.uint8)
