"""Static plan of one training step: `python scripts/plan.py --mesh DxMxP [--config FILE]
[--set key=value ...] [--json] [--debug]`. Compiles, runs nothing; see jaxpar/plan.py."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar import config, mesh  # pure Python: JAX is imported only after the devices are set


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line and exit 2, like every other bad input
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _args(argv):
  ap = _Parser(description="Report shardings, bytes per device, collectives and FLOPs of one "
                           "training step, from the compiled program (nothing runs).")
  ap.add_argument("--mesh", required=True, help="DxMxP: data x model x pipeline, e.g. 2x4x1")
  ap.add_argument("--config", default=None, help="YAML file of overrides of the defaults")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides; a later one wins")
  ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
  ap.add_argument("--debug", action="store_true", help="show tracebacks of input errors")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  args = _args(argv)
  try:
    shape = mesh.parse(args.mesh)
    cfg = config.load(args.config, args.overrides)
    n = shape[0] * shape[1] * shape[2]
    mesh.check(shape, cfg, n)  # the degrees against the model, before JAX starts
    if mesh.ensure_cpu_devices(n):
      print(f"plan: simulating {n} CPU devices (--xla_force_host_platform_device_count={n})",
            file=sys.stderr)
    from jaxpar import plan
    # stdout carries only the result; anything printed while compiling goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
      report = plan.plan(cfg, shape)
  except config.ConfigError as e:
    if args.debug:
      raise
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2
  print(json.dumps(report) if args.json else plan.format_table(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
