"""scripts/train.py under `tfds.testing.mock_data`: `python tests/mock_tfds_train.py N ARGS...`.

N random examples per split stand in for a prepared dataset; everything after N goes to train.py,
which then runs its real TFDS code path (tfds.data_source) against them.
"""
import importlib.util
import pathlib
import sys

import tensorflow_datasets as tfds

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
  n = int(sys.argv[1])
  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  train = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train)
  with tfds.testing.mock_data(num_examples=n):
    return train.main(sys.argv[2:])


if __name__ == "__main__":
  sys.exit(main())
