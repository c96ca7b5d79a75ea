"""Static plan of one training step, or a search for the best layout. Compiles, runs nothing.

jaxpar-plan --mesh DxMxP[xC] [--config FILE] [--set key=value ...] [--json] [--debug]
  one layout: shardings, bytes per device, collectives, FLOPs (jaxpar/planning/plan.py)
jaxpar-plan --auto --devices N [--memory-per-device BYTES] [--device-kind KIND]
    [--max-candidates K] [--time-limit S] [--top 5] [--config FILE] [--set ...] [--json]
  every DxMxP mesh (and DxMx1xC for long sequences) of N devices x ZeRO 0-3 x schedule x microbatches the model allows, each
  compiled on N simulated devices, ranked by predicted step time among those whose peak bytes per
  device fit the budget (jaxpar/planning/autoplan.py)
jaxpar-plan --analytic --devices N [--params PSI] [--state-bytes P,G,K] [...]
  the same ranking from formulas alone, with the ZeRO paper's model-state bytes per stage
Exit code: 0 with a result, 1 when a search finds no layout within the memory budget (the output
then names the one with the least memory), 2 for bad input.
(Also python -m jaxpar plan, or python scripts/plan.py in a checkout.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys

from jaxpar import config, kinds
from jaxpar.analysis import devices
from jaxpar.commands import cli
from jaxpar.parallel import mesh  # JAX's backends start only after the devices are set


def autoplan_kinds():
  return devices.DEVICE_KINDS  # the kinds --auto can be asked about (devices.py imports no JAX)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _bytes_arg(text: str) -> float:
  m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
  if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count such as 80e9 or 16GiB")
  return float(m.group(1)) * _UNITS[m.group(2)]


def _state_arg(text: str) -> tuple[float, float, float]:
  try:
    parts = tuple(float(x) for x in text.split(","))
  except ValueError:
    parts = ()
  if len(parts) != 3 or not all(math.isfinite(x) and x >= 0 for x in parts):
    raise argparse.ArgumentTypeError(f"{text!r} is not three byte counts P,G,K such as 2,2,12")
  return parts


def _args(argv):
  ap = cli.Parser(description="Report shardings, bytes per device, collectives and FLOPs of one "
                           "training step on --mesh, from the compiled program (nothing runs); "
                           "or, with --auto / --analytic, rank every layout of --devices devices "
                           "by predicted step time among those that fit in memory.")
  ap.add_argument("--mesh", metavar="DxMxP[xC]",
                  help="data x model x pipeline [x context], e.g. 2x4x1 or 2x2x1x2 (one layout)")
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument("--auto", action="store_true",
                    help="compile every layout of --devices devices and rank them")
  mode.add_argument("--analytic", action="store_true",
                    help="rank every layout from formulas alone (models too large to compile)")
  ap.add_argument("--devices", type=int, help="device count for --auto / --analytic")
  ap.add_argument("--device-kind", default="cpu", choices=autoplan_kinds(),
                  help="rates the prediction uses: cpu is measured here, GPUs from datasheets")
  ap.add_argument("--memory-per-device", type=_bytes_arg, metavar="BYTES",
                  help="budget, e.g. 80e9 or 16GiB (default: the device kind's memory; "
                       "on cpu the host's memory divided among the devices)")
  ap.add_argument("--max-candidates", type=int, metavar="K",
                  help="--auto: compile only the K layouts predicted fastest by the formulas")
  ap.add_argument("--time-limit", type=float, metavar="SECONDS",
                  help="--auto: start no compile after this many seconds")
  ap.add_argument("--top", type=int, default=5, help="layouts to print")
  ap.add_argument("--params", type=float, metavar="PSI",
                  help="--analytic: parameter count instead of the config model's, e.g. 7.5e9")
  ap.add_argument("--state-bytes", type=_state_arg, metavar="P,G,K",
                  help="--analytic: bytes per parameter of params, grads and optimizer state "
                       "(default from precision.param_dtype and AdamW; the ZeRO paper's mixed "
                       "precision Adam is 2,2,12)")
  ap.add_argument("--config", default=None, help="YAML file of overrides of the defaults")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides; a later one wins")
  ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
  cli.add_print_config(ap)
  ap.add_argument("--debug", action="store_true", help="show tracebacks of input errors")
  return ap.parse_args(argv)


def _search(args, cfg) -> int:
  """--auto / --analytic: the ranking on stdout (text or JSON)."""
  n = args.devices
  if args.auto and mesh.ensure_cpu_devices(n):
    print(f"plan: simulating {n} CPU devices (--xla_force_host_platform_device_count={n})",
          file=sys.stderr)
  from jaxpar.planning import autoplan  # imports JAX: after the simulated device count is set
  with contextlib.redirect_stdout(sys.stderr):
    rates = autoplan.rates(args.device_kind, n)
    budget = args.memory_per_device or rates.memory
    if args.auto:
      import jax
      if len(jax.devices()) < n:
        raise config.ConfigError(f"--devices {n} needs {n} devices, found {len(jax.devices())}")
      log = lambda line: print(line, file=sys.stderr, flush=True)
      result = autoplan.auto(cfg, n, rates, budget, max_candidates=args.max_candidates,
                             time_limit=args.time_limit, log=log)
    else:
      result = autoplan.analytic(cfg, n, rates, budget, args.params, args.state_bytes)
  print(json.dumps(result) if args.json else autoplan.format_result(result, args.top))
  return 0 if result["ranked"] else 1  # an answer, but no layout to train with


def _check_search_args(args) -> None:
  """One sentence for flags that do not go together."""
  search = args.auto or args.analytic
  if not search and not args.mesh:
    raise config.ConfigError("give --mesh DxMxP[xC] for one layout, or --auto / --analytic with "
                             "--devices N to rank layouts")
  if search and args.mesh:
    raise config.ConfigError("--mesh names one layout; --auto and --analytic choose it, "
                             "so give --devices N instead")
  if search and (args.devices is None or args.devices < 1):
    raise config.ConfigError(f"--auto and --analytic need --devices N with N >= 1, got "
                             f"{args.devices}")
  only = {"--max-candidates": args.max_candidates, "--time-limit": args.time_limit}
  for flag, value in only.items():
    if value is not None and not args.auto:
      raise config.ConfigError(f"{flag} applies to --auto only")
    if value is not None and not (math.isfinite(value) and value > 0):
      raise config.ConfigError(f"{flag} must be a positive number, got {value:g}")
  for flag, value in {"--params": args.params, "--state-bytes": args.state_bytes}.items():
    if value is not None and not args.analytic:
      raise config.ConfigError(f"{flag} applies to --analytic only")
  if args.params is not None and not (math.isfinite(args.params) and args.params > 0):
    raise config.ConfigError(f"--params must be a positive number, got {args.params:g}")
  if args.top < 1:
    raise config.ConfigError(f"--top must be at least 1, got {args.top}")


def main(argv=None) -> int:
  args = _args(argv)
  try:
    if args.print_config:  # the config a plan would compile, checked against --mesh if given
      cfg = kinds.check(config.load(args.config, args.overrides, base=cli.hf_model_keys,
                                    follow=cli.data_keys))
      if args.mesh:
        shape = mesh.parse(args.mesh)
        mesh.check(shape, cfg, math.prod(shape))
      return cli.print_config(cfg, args.mesh)
    _check_search_args(args)
    cfg = config.load(args.config, args.overrides, base=cli.hf_model_keys,
                      follow=cli.data_keys)
    cli.use_compile_cache(cfg)  # the cache train.py reads: a planned step is not compiled twice
    if args.auto or args.analytic:
      return _search(args, cfg)
    shape = mesh.parse(args.mesh)
    n = math.prod(shape)
    mesh.check(shape, cfg, n)  # the degrees against the model, before JAX starts
    # as train.py does (cli.setup): one device needs no flag, and XLA_FLAGS enter JAX's cache key
    if n > 1 and mesh.ensure_cpu_devices(n):
      print(f"plan: simulating {n} CPU devices (--xla_force_host_platform_device_count={n})",
            file=sys.stderr)
    from jaxpar.planning import plan  # imports JAX: after the simulated device count is set

    # stdout carries only the result; anything printed while compiling goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
      report = plan.plan(cfg, shape, store_step=True)  # what train.py then loads
  except config.ConfigError as e:
    if args.debug:
      raise
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2
  print(json.dumps(report) if args.json else plan.format_table(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
