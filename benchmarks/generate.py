"""Generation speed with and without the key/value cache, on one device.

`python benchmarks/generate.py [--prompt-tokens 64] [--new-tokens 256] [--repeats R]
[--set key=value ...] [--out FILE]`. The default model (config defaults, float32 compute) with
freshly initialised parameters continues a prompt of random byte tokens, greedily and without a
stop token, so both paths produce every new token; tokens/s is new tokens over the wall time of
the whole call (prompt encoding included), after an untimed call that compiles it; tokens per
CPU-second of this process are recorded too. The two paths
follow the same window rule (jaxpar/interop/generate.py), so their tokens are compared too. The
ratio is a measurement: the script exits 0 whatever it is and prints the verdict.
Writes benchmarks/results/generate.json by default (git-ignored; the committed figures are in
benchmarks/reference/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

from jaxpar import config as jconfig
from jaxpar.interop import generate

THRESHOLD = 5.0  # cached tokens/s over uncached
BASE = ["precision.compute_dtype=float32"]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generate.json")


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="tokens/s of generation with and without the KV cache")
  ap.add_argument("--prompt-tokens", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=3, help="timed calls per path, alternating")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides passed to jaxpar.config.load")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return ap


def main(argv=None) -> int:
  ap = parser()
  args = ap.parse_args(argv)
  if args.prompt_tokens < 1 or args.new_tokens < 1 or args.repeats < 1:
    ap.error("--prompt-tokens, --new-tokens and --repeats must be positive")
  try:
    cfg = jconfig.load(None, BASE + args.overrides)
    sampler = generate.Sampler.from_params(cfg, (1, 1, 1), seed=cfg.train.seed)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  prompt = np.random.default_rng(0).integers(0, cfg.model.vocab_size, args.prompt_tokens)

  def call(cache: bool) -> np.ndarray:
    return sampler.sample_tokens([prompt], args.new_tokens, temperature=0, stop_token=-1,
                                 cache=cache)
  sides = {"cached": True, "uncached": False}
  compile_s, tokens = {}, {}
  for name, cache in sides.items():
    t0 = time.perf_counter()
    tokens[name] = call(cache)  # compiles
    compile_s[name] = time.perf_counter() - t0

  load_before = os.getloadavg()[0]
  rates: dict[str, list[float]] = {name: [] for name in sides}
  cpu_rates: dict[str, list[float]] = {name: [] for name in sides}
  for r in range(args.repeats):
    for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):  # alternate who goes first
      t0, c0 = time.perf_counter(), time.process_time()
      call(sides[name])
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      rates[name].append(args.new_tokens / wall)
      cpu_rates[name].append(args.new_tokens / cpu)

  best = {name: max(v) for name, v in rates.items()}
  median = {name: statistics.median(v) for name, v in rates.items()}
  ratio = best["cached"] / best["uncached"]
  same = tokens["cached"] == tokens["uncached"]
  result = {
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      "devices_visible": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "cpu": _jaxpar_bench.host_cpu(),
      "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
      "config": jconfig.to_dict(cfg),
      "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batch": 1,
      "sampling": "greedy, no stop token", "repeats": args.repeats,
      "first_call_s": compile_s,
      "statistic": "best",
      "tokens_per_s": {name: {"repeats": rates[name], "best": best[name], "median": median[name]}
                       for name in sides},
      "tokens_per_cpu_s": {name: {"repeats": cpu_rates[name], "best": max(cpu_rates[name])}
                           for name in sides},
      "ratio": ratio,
      "ratio_median": median["cached"] / median["uncached"],
      # CPU time of this process: other processes on a shared machine disturb it less
      "ratio_cpu": max(cpu_rates["cached"]) / max(cpu_rates["uncached"]),
      "threshold": THRESHOLD,
      "pass": ratio >= THRESHOLD,
      # Greedy ties aside, both paths pick the same tokens; a difference ends the agreement there.
      "same_tokens": bool(same.all()),
      "tokens_agreeing": int(np.argmin(same[0])) if not same.all() else args.new_tokens,
  }
  _jaxpar_bench.write_json(result, args.out)
  verdict = "PASS" if result["pass"] else "FAIL"
  print(f"generate: cached {best['cached']:,.0f} tok/s, uncached {best['uncached']:,.0f} tok/s, "
        f"ratio {ratio:.2f} (median {result['ratio_median']:.2f}, per CPU-second "
        f"{result['ratio_cpu']:.2f}) {verdict} (>= {THRESHOLD:g}); "
        f"{args.new_tokens} tokens after {args.prompt_tokens}, same tokens: {result['same_tokens']}"
        f" on {jax.default_backend()} {jax.devices()[0].device_kind} -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
