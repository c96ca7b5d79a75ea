"""Build a dataset of one's own for data.source=tfds: jaxpar-dataset images SOURCE --data-dir DIR
--name NAME (a folder of class subfolders of PNG/JPEG images, an .npz of images and labels, or an
.npy of images with --labels LABELS.npy), stored as array_record under DIR/local_images/NAME;
it prints the --set words that train the cnn on it. Or a tokenizer: jaxpar-dataset tokenizer
FOLDER --out DIR [--vocab-size N] (a byte-level BPE trained on the folder's text files, with a
chat template, for data.tokenizer=DIR). Also python -m jaxpar dataset, or python
scripts/dataset.py in a checkout."""
from __future__ import annotations

import os
import sys

from jaxpar.commands import cli


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  sub = p.add_subparsers(dest="kind", metavar="{images,tokenizer}", required=True,
                         parser_class=cli.Parser)
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
  tok = sub.add_parser("tokenizer", help="a byte-level BPE tokenizer trained on a folder of text, "
                                         "with a chat template, for data.tokenizer")
  tok.add_argument("source", help="a folder of text files")
  tok.add_argument("--out", required=True, help="the folder to write tokenizer.json, "
                                                "tokenizer_config.json and chat_template.jinja to")
  tok.add_argument("--vocab-size", type=int, default=512, help="tokens, the 256 bytes included")
  tok.add_argument("--max-bytes", type=int, default=1 << 20, help="text read, at most")
  tok.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)
  if args.kind == "tokenizer":
    return cli.guard(lambda: _tokenizer(args), args.debug, exit_on_signal=True)

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


def _tokenizer(args) -> int:
  cli.check_outputs(("--out", args.out, "folder"))
  from jaxpar.data import bpe  # imports TFDS (through local_text): only once the arguments are read
  paths = bpe.train(args.source, args.out, args.vocab_size, args.max_bytes)
  print(f"wrote {', '.join(paths)}; train on it with --set data.tokenizer={args.out} "
        f"model.vocab_size={args.vocab_size}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
