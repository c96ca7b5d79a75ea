"""Build a dataset of one's own for data.source=tfds: jaxpar-dataset images SOURCE --data-dir DIR
--name NAME (a folder of class subfolders of PNG/JPEG images, an .npz of images and labels, or an
.npy of images with --labels LABELS.npy), stored as array_record under DIR/local_images/NAME;
it prints the --set words that train the cnn on it. Also python -m jaxpar dataset, or python
scripts/dataset.py in a checkout."""
from __future__ import annotations

import os
import sys

from jaxpar.commands import cli


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  sub = p.add_subparsers(dest="kind", metavar="images", required=True, parser_class=cli.Parser)
  images = sub.add_parser("images", help="images with class labels, for model.kind=cnn")
  images.add_argument("source", help="FOLDER/CLASS/IMAGE.png (or FOLDER/train/CLASS/..., "
                                     "FOLDER/test/CLASS/...), FILE.npz or IMAGES.npy")
  images.add_argument("--labels", help="LABELS.npy, one per image, when SOURCE is an .npy")
  images.add_argument("--data-dir", required=True,
                      help="where the dataset goes (data.data_dir when training)")
  images.add_argument("--name", required=True, help="the dataset is local_images/NAME")
  images.add_argument("--size", metavar="HxW", help="resize every image to H x W pixels (or "
                                                    "SIDE x SIDE); needed when their sizes differ")
  images.add_argument("--validation", type=float, default=0.1, metavar="FRACTION",
                      help="held out as the validation split when SOURCE has no validation or "
                           "test split (default 0.1; 0 for none)")
  images.add_argument("--replace", action="store_true", help="rebuild a dataset of that name")
  images.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)

  def body():
    cli.check_outputs(("--data-dir", args.data_dir, "folder"))
    from jaxpar.data import local_images  # imports TFDS: only once the arguments are read
    size = local_images.parse_size(args.size) if args.size else None
    builder = local_images.build(args.source, args.data_dir, args.name, labels=args.labels,
                                 size=size, validation=args.validation, replace=args.replace)
    print(f"train on it with --set "
          f"{local_images.train_flags(builder, os.path.abspath(args.data_dir))}")
    return 0
  return cli.guard(body, args.debug, exit_on_signal=True)


if __name__ == "__main__":
  sys.exit(main())
