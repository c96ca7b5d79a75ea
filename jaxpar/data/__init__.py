"""Data: byte-level text from a local folder (TFDS array_record) or synthetic bytes, batched."""
from jaxpar.data.loader import (SEPARATOR, VOCAB_SIZE, BatchIterator, inputs_targets, make_batches,
                                pack, synthetic_windows, tokenize)

__all__ = ["SEPARATOR", "VOCAB_SIZE", "BatchIterator", "inputs_targets", "make_batches", "pack",
           "synthetic_windows", "tokenize"]
