"""jaxpar's one-device training step against Hugging Face GPT-2 + torch.optim.AdamW (eager).

`python benchmarks/vs_pytorch.py [--steps N] [--warmup N] [--repeats R] [--threads N]
[--phases] [--torch-in-process] [--set key=value ...] [--out FILE]`. Needs the `benchmark` extra
(torch, transformers).

Both sides train the same fp32 GPT-2 (4 layers, d_model 256, 4 heads, d_ff 1024, T 128, batch 16,
vocab 256 by default): jaxpar.Trainer on a 1x1x1 mesh with jaxpar's GPT, and `GPT2LMHeadModel`
(untied head, like jaxpar's; dropout 0) with global-norm clipping and `torch.optim.AdamW` over the
same learning-rate schedule and weight-decay mask. The torch model starts from jaxpar's initial
parameters and both see the same batches, so the first-step losses must agree before any timing
counts. Windows alternate between the sides (who goes first alternates too) so a burst of load
from other processes hits both; the ratio is of medians over the repeats, with the spread of the
per-repeat ratios. `--phases` also times forward and forward+backward alone on each side.

Each side has its process: torch in benchmarks/_torch_gpt2.py (driven window by window over a
pipe, timing itself), jaxpar in this one, so jaxpar's malloc setting for one-device CPU runs
(jaxpar/parallel/hostmem.py; JAXPAR_HOST_MALLOC=off turns it off) does not reach torch.
`--torch-in-process` runs torch here instead. The ratio is a measurement: the script exits 0
whatever it is. Writes benchmarks/results/vs_pytorch.json by default (git-ignored; committed
figures are in benchmarks/reference/).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import config as jconfig
from jaxpar.parallel import hostmem
from jaxpar.parallel.context import StepContext
from jaxpar.train import optim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jaxpar_bench  # noqa: E402  (beside this file)
import _torch_gpt2  # noqa: E402  (beside this file; imports neither jax nor jaxpar)

TORCH_SIDE = _torch_gpt2.__file__

TARGET = 1.2  # jaxpar / torch tokens/s this benchmark is tuned towards
LOSS_RTOL = 1e-4  # fp32, two implementations of the same sums
BASE = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
        "model.seq_len=128", "model.vocab_size=256", "train.batch_size=16",
        "precision.compute_dtype=float32"]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vs_pytorch.json")


# -- the two sides -----------------------------------------------------------------------------------

class JaxparSide:
  """jaxpar's compiled step in this process: `steps(n)` -> {'loss', 'wall', 'cpu'}."""
  name = "jaxpar"

  def __init__(self, compiled, state, batches, mesh):
    self.compiled, self.state, self.batches, self.mesh = compiled, state, batches, mesh
    self.i = 0

  def steps(self, n):
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = None
    with jax.set_mesh(self.mesh):
      for _ in range(n):
        self.state, metrics = self.compiled(self.state, self.batches[self.i % len(self.batches)])
        self.i += 1
    loss = float(metrics["loss"])  # waits for the last step
    return {"loss": loss, "wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}


class TorchProcess:
  """The torch side in a process of its own (benchmarks/_torch_gpt2.py), without jaxpar's malloc
  setting, as torch users run it. Same interface as _torch_gpt2.Runner."""
  name = "torch"

  def __init__(self, setup: dict):
    fd, self.setup_path = tempfile.mkstemp(suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
      pickle.dump(setup, f)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", hostmem.ENV)}
    self.proc = subprocess.Popen([sys.executable, TORCH_SIDE, self.setup_path], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self._info = self._ask({"info": 1})  # waits until torch is loaded: nothing overlaps a timing

  def _ask(self, cmd: dict) -> dict:
    self.proc.stdin.write(json.dumps(cmd) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the torch process exited with {self.proc.wait()}")
    return json.loads(line)

  def steps(self, n):
    return self._ask({"steps": n})

  def phases(self, n):
    return self._ask({"phases": n})

  def info(self):
    return self._info

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.write(json.dumps({"quit": 1}) + "\n")
      self.proc.stdin.flush()
      self.proc.wait(timeout=60)
    os.remove(self.setup_path)


def jaxpar_phases(trainer, jstate, jbatch, n):
  """Median seconds of jaxpar's forward and forward+backward alone."""
  params = jax.tree_util.tree_map(jnp.copy, jstate["params"])
  loss = lambda p, b: trainer.model.loss(p, b, StepContext(trainer.compute_dtype))[0]
  fwd = jax.jit(loss)
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  return {"forward": _torch_gpt2.timed(lambda: fwd(params, jbatch).block_until_ready(), n),
          "forward_backward": _torch_gpt2.timed(
              lambda: jax.block_until_ready(fwd_bwd(params, jbatch)), n)}


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description="tokens/s of jaxpar's one-device step over HF GPT-2 + "
                                           "torch AdamW on the same shape (fp32, CPU)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps per window")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each window")
  ap.add_argument("--repeats", type=int, default=5, help="windows per side, interleaved")
  ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  ap.add_argument("--phases", action="store_true",
                  help="also time forward and forward+backward alone on each side")
  ap.add_argument("--torch-in-process", action="store_true",
                  help="run torch in this process (sharing jaxpar's malloc settings), not its own")
  ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                  metavar="KEY=VALUE", help="config overrides passed to jaxpar.config.load")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return ap


def comparison_config(overrides: list[str]) -> jconfig.Config:
  """The fp32 GPT both sides run: BASE + `overrides`. ConfigError (one sentence) when the
  benchmark extra is missing or the config is not one torch's GPT-2 can match."""
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError as e:
    raise jconfig.ConfigError(f"{e.name} is missing; install the benchmark extra: "
                              f"pip install -e '.[benchmark]'") from None
  cfg = jconfig.load(None, BASE + overrides)
  if cfg.model.kind != "gpt" or cfg.precision.compute_dtype != "float32":
    raise jconfig.ConfigError("the comparison is of the fp32 GPT: model.kind=gpt, "
                              "precision.compute_dtype=float32")
  return cfg


def main(argv=None) -> int:
  ap = parser()
  args = ap.parse_args(argv)
  if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
    ap.error("--steps, --repeats and --threads must be positive, --warmup not negative")
  try:
    cfg = comparison_config(args.overrides)
    hostmem.configure(1)  # as train.py on one CPU device, before JAX starts (parallel/hostmem.py)
  except jconfig.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  device = jax.devices()[0]
  mc, tc = cfg.model, cfg.train
  tokens_per_step = tc.batch_size * mc.seq_len
  one = _jaxpar_bench.one_device(cfg, args.warmup + args.steps, device)
  trainer, compiled, jstate, jbatches = one.trainer, one.compiled, one.state, one.batches
  rows = [r.astype(np.int64) for r in one.rows]

  n_steps = 2 + args.repeats * (args.warmup + args.steps)
  cfg_dict = jconfig.to_dict(cfg)
  setup = {"model": cfg_dict["model"], "train": cfg_dict["train"],
           "params": jax.tree_util.tree_map(np.asarray, jstate["params"]), "rows": rows,
           "lr_at": [float(v) for v in jax.vmap(optim.schedule(tc))(jnp.arange(n_steps))],
           "threads": args.threads}
  # --torch-in-process: torch here, sharing jaxpar's malloc setting
  torch_side = _torch_gpt2.Runner(setup) if args.torch_in_process else TorchProcess(setup)
  try:
    return compare(args, cfg, device, tokens_per_step, trainer, compiled, jstate, jbatches,
                   torch_side)
  finally:
    torch_side.close()


def compare(args, cfg, device, tokens_per_step, trainer, compiled, jstate, jbatches,
            torch_side) -> int:
  """The timed windows, the loss checks and the JSON."""
  phase_s = None
  if args.phases:  # before training, while both sides still hold the same parameters
    phase_s = {"jaxpar": jaxpar_phases(trainer, jstate, jbatches[0], 2 * args.steps),
               "torch": torch_side.phases(2 * args.steps)}
  sides = [JaxparSide(compiled, jstate, jbatches, trainer.mesh), torch_side]
  wall = {s.name: [] for s in sides}
  cpu = {s.name: [] for s in sides}

  # Same parameters, same batch: the first losses must agree before any timing counts.
  first = [s.steps(1)["loss"] for s in sides]
  rel = abs(first[0] - first[1]) / abs(first[1])
  if rel > LOSS_RTOL:
    raise AssertionError(f"first-step losses differ: jaxpar {first[0]!r}, torch {first[1]!r} "
                         f"(relative {rel:.2e} > {LOSS_RTOL:g}); not the same computation")

  load_before = os.getloadavg()
  for r in range(args.repeats):
    for s in (sides if r % 2 == 0 else sides[::-1]):
      if args.warmup:
        s.steps(args.warmup)
      t = s.steps(args.steps)
      wall[s.name].append(tokens_per_step * args.steps / t["wall"])
      cpu[s.name].append(tokens_per_step * args.steps / t["cpu"])
  load_after = os.getloadavg()
  last = [s.steps(1)["loss"] for s in sides]  # same batches in the same order: still close

  med = {k: statistics.median(v) for k, v in wall.items()}
  med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
  per_repeat = [a / b for a, b in zip(wall["jaxpar"], wall["torch"])]
  ratio = med["jaxpar"] / med["torch"]
  result = {
      "jax_version": jax.__version__, **torch_side.info(),
      "torch_process": "this" if args.torch_in_process else "its own",
      "backend": jax.default_backend(), "device_kind": device.device_kind,
      "cpu_count": os.cpu_count(),
      "cpu": _jaxpar_bench.host_cpu(),
      "load_average": {"before": load_before, "after": load_after},
      # glibc's allocator settings change XLA:CPU's per-step cost; recorded with the figures
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
      "host_malloc_kept": hostmem.applied,  # jaxpar.parallel.hostmem, in jaxpar's process
      "config": jconfig.to_dict(cfg),
      "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
      "tokens_per_step": tokens_per_step,
      "tokens_per_s": {k: {"repeats": v, "median": med[k]} for k, v in wall.items()},
      "tokens_per_cpu_s": {k: {"repeats": v, "median": med_cpu[k]} for k, v in cpu.items()},
      "ratio": ratio,
      "ratio_per_repeat": per_repeat,
      "ratio_spread": [min(per_repeat), max(per_repeat)],
      "ratio_cpu": med_cpu["jaxpar"] / med_cpu["torch"],
      "target": TARGET,
      "phases_s": phase_s,
      "loss_check": {"first": {"jaxpar": first[0], "torch": first[1], "relative": rel},
                     "last": {"jaxpar": last[0], "torch": last[1],
                              "relative": abs(last[0] - last[1]) / abs(last[1])}},
  }
  _jaxpar_bench.write_json(result, args.out)
  if phase_s:
    for name, p in phase_s.items():
      print(f"{name:>6}: forward {p['forward'] * 1e3:.0f} ms, forward+backward "
            f"{p['forward_backward'] * 1e3:.0f} ms")
  cpu = result["cpu"]
  print(f"vs_pytorch: jaxpar {med['jaxpar']:,.0f} tok/s, torch {med['torch']:,.0f} tok/s "
        f"(medians of {args.repeats}x{args.steps} steps; torch in {result['torch_process']} "
        f"process), ratio {ratio:.3f} (per repeat {min(per_repeat):.3f}-{max(per_repeat):.3f}, "
        f"per CPU-second {result['ratio_cpu']:.3f}; target {TARGET}) "
        f"load {load_before[0]:.2f}->{load_after[0]:.2f}; {cpu['count']} cores, "
        f"{'avx512f' if 'avx512f' in cpu['extensions'] else 'no avx512f'} -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
