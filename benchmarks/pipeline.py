"""Pipeline schedules on 1x1x4: compiled temp bytes and bubble for M in {4, 8, 16}, written to JSON.

python benchmarks/pipeline.py [--out FILE] [--set key=value ...]
Writes benchmarks/results/pipeline.json by default (git-ignored; the committed figures are in
benchmarks/reference/).
Each microbatch holds 4 samples (train.batch_size = 4·M). Numbers come from the compiled step's
memory_analysis() and from the executed schedule table; nothing is run.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxpar import config
from jaxpar.planning import plan  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

# Untracked, so a run never rewrites the committed figures in benchmarks/reference/.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline.json")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  p.add_argument("--set", nargs="+", action="extend", default=["model.n_layers=8"])
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  rows = []
  for name, V in (("gpipe", 1), ("1f1b", 1), ("circular", 2)):
    for M in (4, 8, 16):
      cfg = config.load(None, args.set + [f"parallel.schedule={name}", f"parallel.microbatches={M}",
                                          f"parallel.virtual_stages={V}", f"train.batch_size={4 * M}"])
      r = plan.plan(cfg, (1, 1, 4))
      row = {"schedule": name, "microbatches": M, "virtual_stages": V,
             "temp_bytes": r["compiled"]["temp_bytes"], "bubble_fraction": r["pipeline"]["bubble_fraction"],
             "ticks": r["pipeline"]["ticks"], "buffer_slots": r["pipeline"]["buffer_slots"],
             "collective_permute_bytes": r["collectives"]["collective-permute"]}
      rows.append(row)
      print(f"{name:>8} M={M:>2}  temp {row['temp_bytes'] / 2**20:8.2f} MiB  bubble "
            f"{row['bubble_fraction']:.3f}  slots {row['buffer_slots']}", flush=True)
  out = {"jax": jax.__version__, "backend": jax.default_backend(), "mesh": "1x1x4",
         "samples_per_microbatch": 4, "overrides": args.set, "rows": rows}
  _jaxpar_bench.write_json(out, args.out, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
