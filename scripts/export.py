"""Export a checkpoint as one safetensors file: python scripts/export.py --workdir DIR [--step N]
--out FILE.safetensors (writes FILE.json beside it with the model config and jaxpar version)."""
from __future__ import annotations

import argparse
import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar import cli


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--workdir", required=True, help="the training run's workdir")
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
  p.add_argument("--out", required=True, help="FILE.safetensors to write")
  p.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)

  def body():
    from jaxpar import export
    info = export.export(args.workdir, args.out, args.step)
    print(f"wrote {args.out} ({info['n_tensors']} tensors, {info['n_params']:,} parameters, "
          f"step {info['step']}) and {export.config_path(args.out)}")
    return 0
  return cli.guard(body, args.debug)


if __name__ == "__main__":
  sys.exit(main())
