"""Input pipeline vs training step: examples/s of the loader alone and of the compiled step.

`python benchmarks/input_pipeline.py [--batches N] [--steps N] [--mock-examples N] [--out FILE]`.
Two cases: the default LM config (local_text, mesh 1x1x1) and configs/cifar10_cnn.yaml (mesh
8x1x1) on `tfds.testing.mock_data` examples, read through the real tfds.data_source path. The
loader must produce at least THRESHOLD times the examples the step consumes, so the step never
waits for data. Each rate is the best of three timed runs, which filters out other load. The
script writes JSON (default benchmarks/results/input_pipeline.json, git-ignored; the committed
figures are in benchmarks/reference/) and exits 0 whatever the figures are; the verdict is printed.
For the CNN it also times, for information, the loader with data.augment=true and the
record-by-record path (shards larger than CACHE_BYTES); with mock data the latter measures mostly
TFDS's random example generator.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpar.parallel import mesh as jmesh

jmesh.ensure_cpu_devices(8)  # before JAX starts: the CNN case runs on 8 simulated devices

import jax  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from jaxpar import config as jconfig  # noqa: E402
from jaxpar.data import make_loader, tfds_source  # noqa: E402
from jaxpar.train import hooks, loop  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

THRESHOLD = 10.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Untracked, so a run never rewrites the committed figures in benchmarks/reference/.
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "input_pipeline.json")


def loader_rate(cfg, workdir: str, batches: int, repeats: int = 3) -> dict:
  """Examples/s of make_loader(cfg) alone: the best of `repeats` runs of `batches` batches."""
  t0 = time.perf_counter()
  it = make_loader(cfg, workdir)
  it.next()  # start-up: building or caching the data, starting the threads
  startup = time.perf_counter() - t0
  rates = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(batches):
      it.next()
    rates.append(batches * cfg.train.batch_size / (time.perf_counter() - t0))
  it.close()
  return {"examples_per_sec": max(rates), "runs_examples_per_sec": rates, "batches": batches,
          "startup_s": startup}


def step_rate(cfg, mesh_shape, workdir: str, steps: int, repeats: int = 3) -> dict:
  """Examples/s of the compiled step on one fixed batch: the best of `repeats` runs of `steps`."""
  n = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]
  devices = jax.devices()[:n]  # the 8 simulated devices serve both meshes
  jmesh.check(mesh_shape, cfg, len(devices))
  trainer = Trainer(cfg, jmesh.make(mesh_shape, devices), loop.build_model(cfg))
  it = make_loader(cfg, workdir)
  abstract = loop._batch_abstract(it.element_spec, jax.process_count())
  shardings = trainer.batch_sharding(abstract)
  batch = hooks.global_batch(it.next(), shardings)
  it.close()
  compiled = trainer.lower(abstract).compile()
  state = trainer.init(cfg.train.seed)
  rates = []
  with jax.set_mesh(trainer.mesh):
    for _ in range(3):  # warm-up
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    for _ in range(repeats):
      t0 = time.perf_counter()
      for _ in range(steps):
        state, m = compiled(state, batch)
      jax.block_until_ready(m)
      rates.append(steps * cfg.train.batch_size / (time.perf_counter() - t0))
  return {"examples_per_sec": max(rates), "runs_examples_per_sec": rates, "steps": steps,
          "step_time_s": cfg.train.batch_size / max(rates)}


def case(name: str, cfg, mesh_shape, workdir: str, args) -> dict:
  loader = loader_rate(cfg, workdir, args.batches)
  step = step_rate(cfg, mesh_shape, workdir, args.steps)
  ratio = loader["examples_per_sec"] / step["examples_per_sec"]
  print(f"{name}: loader {loader['examples_per_sec']:,.0f} examples/s, step "
        f"{step['examples_per_sec']:,.0f} examples/s on {'x'.join(map(str, mesh_shape))}: "
        f"{ratio:.1f}x ({'ok' if ratio >= THRESHOLD else 'below'} the {THRESHOLD:.0f}x target)")
  return {"mesh": "x".join(map(str, mesh_shape)), "data_source": cfg.data.source,
          "data_name": cfg.data.name, "batch_size": cfg.train.batch_size,
          "workers": cfg.data.workers, "loader": loader, "step": step, "ratio": ratio,
          "meets_target": ratio >= THRESHOLD}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batches", type=int, default=100, help="loader batches per timed run")
  p.add_argument("--steps", type=int, default=20, help="training steps per timed run")
  p.add_argument("--mock-examples", type=int, default=10_000,
                 help="mock CIFAR-10 examples per split")
  p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  tfds.disable_progress_bar()
  # Other processes on the machine slow both sides; the load average says how busy it was.
  results = {"threshold": THRESHOLD, "cpu_count": os.cpu_count(), "devices": jax.device_count(),
             "platform": jax.devices()[0].platform, "load_average_at_start": os.getloadavg()[0]}
  with tempfile.TemporaryDirectory() as workdir:
    results["lm_local_text"] = case("LM (default config, local_text)", jconfig.load(), (1, 1, 1),
                                    workdir, args)
    cnn = jconfig.load(os.path.join(ROOT, "configs", "cifar10_cnn.yaml"))
    with tfds.testing.mock_data(num_examples=args.mock_examples):
      results["cnn_cifar10_mock"] = case("CNN (configs/cifar10_cnn.yaml, mock cifar10)", cnn,
                                         (8, 1, 1), workdir, args)
      results["cnn_cifar10_mock"]["mock_examples"] = args.mock_examples
      augmented = loader_rate(jconfig.override(cnn, data={"augment": True}), workdir, args.batches)
      results["cnn_cifar10_mock"]["loader_with_augment"] = augmented
      print(f"  (with data.augment=true: {augmented['examples_per_sec']:,.0f} examples/s)")
      cache = tfds_source.CACHE_BYTES
      tfds_source.CACHE_BYTES = 0  # every record read and decoded again each epoch
      try:
        streamed = loader_rate(cnn, workdir, max(args.batches // 10, 5), repeats=1)
      finally:
        tfds_source.CACHE_BYTES = cache
      results["cnn_cifar10_mock"]["loader_streamed_not_cached"] = streamed
      print(f"  (record-by-record, no cache: {streamed['examples_per_sec']:,.0f} examples/s, "
            f"bound by the mock generator)")
  results["load_average_at_end"] = os.getloadavg()[0]
  results["all_meet_target"] = all(results[k]["meets_target"]
                                   for k in ("lm_local_text", "cnn_cifar10_mock"))
  _jaxpar_bench.write_json(results, args.out, indent=2)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
