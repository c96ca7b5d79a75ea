"""Data: local text, synthetic bytes or any prepared TFDS dataset, as per-host dict batches."""
from jaxpar.data.loader import (BatchIterator, TokenBatches, batch_spec, image_shape,
                                inputs_targets, make_batches, make_loader, pack, synthetic_windows)
from jaxpar.data.tokens import SEPARATOR, VOCAB_SIZE, tokenize
from jaxpar.data.windows import TokenWindows

__all__ = ["SEPARATOR", "VOCAB_SIZE", "BatchIterator", "TokenBatches", "batch_spec", "image_shape",
           "inputs_targets", "make_batches", "make_loader", "pack", "synthetic_windows", "tokenize",
           "TokenWindows"]
