"""Compile time is flat in depth on every schedule, and the pipeline's program flat in microbatches.

Two measures per program: the compiled HLO's instruction count, which no noise moves (a scan that
unrolled, or an executor that grew with M, would multiply it), and the time of
`Trainer.lower(batch).compile()` in this process's CPU seconds (wall seconds on a shared machine
measure the neighbours), kept as the least of up to two compiles, since load only ever adds time. Pipelines start at two layers per stage chunk: with one, XLA drops the stage's
scan and the shallow program is smaller than any deeper one (benchmarks/compile_time.py has those
figures too).
"""
import functools
import time

import jax
import pytest

from jaxpar import config
from jaxpar.analysis import hlo
from jaxpar.parallel import mesh as jmesh
from jaxpar.planning import plan
from jaxpar.train.step import Trainer

SMALL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.seq_len=32",
         "train.batch_size=16"]
# schedule -> (mesh, overrides, shallowest stack with two layers per stage chunk)
SCHEDULES = {
    "none": ("1x1x1", [], 2),
    "gpipe": ("1x1x2", ["parallel.schedule=gpipe"], 4),
    "1f1b": ("1x1x2", ["parallel.schedule=1f1b"], 4),
    "circular": ("1x1x2", ["parallel.schedule=circular", "parallel.virtual_stages=2"], 8),
}
DEEP = 32


@pytest.fixture(scope="module", autouse=True)
def no_compilation_cache():
  """Every compile here is a real one, whatever another test file left configured."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", before)


def compile_once(name: str, layers: int, micro: int = 4) -> tuple[float, int]:
  """(CPU seconds of lower + compile, compiled HLO instructions) of the step."""
  mesh_shape, overrides, _ = SCHEDULES[name]
  pipe = [f"parallel.microbatches={micro}"] if name != "none" else []
  cfg = config.load(None, SMALL + overrides + pipe + [f"model.n_layers={layers}"])
  shape = jmesh.parse(mesh_shape)
  mesh = jmesh.make(shape, jax.devices()[:shape[0] * shape[1] * shape[2]])
  trainer = Trainer(cfg, mesh, plan._model(cfg))
  t0 = time.process_time()
  compiled = trainer.lower(plan._batch_abstract(cfg)).compile()
  return time.process_time() - t0, hlo.instruction_count(compiled.as_text())


first = functools.lru_cache(maxsize=None)(compile_once)  # shared by the two tests below


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_compile_is_flat_in_depth(name):
  shallow = SCHEDULES[name][2]
  t_shallow, n_shallow = first(name, shallow)
  t_deep, n_deep = first(name, DEEP)
  assert n_deep <= 1.1 * n_shallow, (name, n_shallow, n_deep)
  if t_deep > 1.5 * t_shallow:  # once more each, keeping the fastest: noise only adds time
    t_shallow = min(t_shallow, compile_once(name, shallow)[0])
    t_deep = min(t_deep, compile_once(name, DEEP)[0])
  assert t_deep <= 1.5 * t_shallow, (name, shallow, t_shallow, DEEP, t_deep)


def test_pipeline_program_is_flat_in_microbatches():
  # One executor runs every schedule's table: 4x the microbatches, 4x the ticks, same program.
  _, n4 = first("1f1b", 4)  # the default 4 microbatches
  _, n16 = first("1f1b", 4, 16)
  assert n16 <= 1.1 * n4, (n4, n16)
