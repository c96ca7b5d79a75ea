"""Sample text from a checkpoint: python scripts/generate.py --workdir DIR --prompt TEXT
[--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--mesh DxMxP] [--step N]."""
from __future__ import annotations

import os
import sys

try:
  import jaxpar  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar import cli
from jaxpar import mesh as jmesh


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  p.add_argument("--workdir", required=True, help="the training run's workdir")
  p.add_argument("--prompt", default="", help="text the sample continues (a document's start)")
  p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to sample")
  p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest bytes (0 = all)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1)
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
  p.add_argument("--mesh", default="1x1x1", help="data x model x pipeline to shard the parameters over")
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                 help="overrides of the checkpoint's config, e.g. precision.compute_dtype=bfloat16")
  p.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)

  def body():
    shape = jmesh.parse(args.mesh)
    n = shape[0] * shape[1] * shape[2]
    if n > 1 and jmesh.ensure_cpu_devices(n):  # before JAX starts
      print(f"jaxpar: simulating {n} CPU devices for mesh {args.mesh} "
            f"(XLA_FLAGS=--xla_force_host_platform_device_count={n})", file=sys.stderr)
    from jaxpar import generate
    sampler = generate.Sampler(args.workdir, shape, args.step, args.set)
    texts = sampler.generate(args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                             args.seed, args.num_samples)
    for i, text in enumerate(texts):
      if i:
        print("\n" + "-" * 40)
      print(args.prompt + text)
    return 0
  return cli.guard(body, args.debug, exit_on_signal=True)


if __name__ == "__main__":
  sys.exit(main())
