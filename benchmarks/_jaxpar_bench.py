"""What the benchmarks share: jaxpar's one-device step with its batches, and writing results."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer


@dataclass
class OneDevice:
  """jaxpar's compiled GPT step on a 1x1x1 mesh (the path jaxpar.train.loop.run takes), its initial
  state, and the batches: `rows` as numpy (B, T+1) windows, `batches` placed for the step."""
  mesh: Any
  trainer: Trainer
  compiled: Any
  state: Any
  rows: list
  batches: list


def one_device(cfg, n_batches: int, device=None) -> OneDevice:
  """Builds, compiles and initialises the step; up to `n_batches` distinct synthetic batches."""
  from jaxpar.data import synthetic_windows
  device = device or jax.devices()[0]
  mc, tc = cfg.model, cfg.train
  mesh = jmesh.make((1, 1, 1), [device])
  trainer = Trainer(cfg, mesh, jmodel.gpt(cfg))
  abstract = {"tokens": jax.ShapeDtypeStruct((tc.batch_size, mc.seq_len + 1), jnp.int32)}
  compiled = trainer.lower(abstract).compile()
  state = trainer.init(tc.seed)
  windows = synthetic_windows(mc.seq_len, tc.seed).astype(np.int32)
  n = min(len(windows) // tc.batch_size, n_batches)
  rows = [windows[i * tc.batch_size:(i + 1) * tc.batch_size] for i in range(n)]
  sharding = trainer.batch_sharding(abstract)
  batches = [jax.device_put({"tokens": r}, sharding) for r in rows]
  return OneDevice(mesh, trainer, compiled, state, rows, batches)


def host_cpu() -> dict:
  """The host CPU the figures were taken on: its model name, core count and the vector
  extensions that decide matmul speed (the same benchmark differs about 2x between machines)."""
  info = {"model": platform.processor() or platform.machine(), "count": os.cpu_count(),
          "extensions": []}
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:  # not Linux
    return info
  first_cpu = text.split("\n\n")[0]  # every processor repeats the same block
  fields = dict(line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  info["model"] = fields.get("model name", info["model"])
  flags = set(fields.get("flags", "").split())
  info["extensions"] = sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16",
                                       "amx_tile"})
  return info


def write_json(result: Any, path: str, indent: int = 2) -> None:
  """Writes `result` to `path`, creating its folder."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=indent)
