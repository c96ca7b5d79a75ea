"""What one device can do: the one table of datasheet peaks, and the measured peaks where there is
no datasheet (a CPU host, an unknown accelerator).

`peak_flops_per_device` is MFU's denominator (train/metrics.py); `rates` are the planner's
denominators (planning/autoplan.py, analysis/profile.py). JAX is imported only inside the
functions that measure, so commands can list the kinds before the devices are set.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from typing import Any

from jaxpar.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sheet:
  """One device's datasheet: dense (no sparsity) bf16 tensor-core FLOP/s; for the parts the
  planner knows, NVLink bytes/s in one direction (half the bidirectional total datasheets quote)
  and memory bytes."""
  flops: float
  link: float | None = None
  memory: float | None = None
  source: str = ""


# Matched as substrings of the lower-cased `device_kind`, first match wins, so longer names come
# first ("h100 pcie" before "h100", "l40s" before "l40" before "l4").
#   H100 SXM5: 989 TFLOP/s, NVLink 4 900 GB/s, 80 GB HBM3   (NVIDIA H100 Tensor Core GPU datasheet)
#   H200 SXM:  989 TFLOP/s, NVLink 900 GB/s, 141 GB HBM3e   (NVIDIA H200 Tensor Core GPU datasheet)
#   A100 SXM 80GB: 312 TFLOP/s, NVLink 3 600 GB/s, 80 GB HBM2e (NVIDIA A100 Tensor Core GPU datasheet)
DATASHEETS: dict[str, Sheet] = {
  "gb200": Sheet(2.5e15),
  "b200": Sheet(2.25e15),
  "b100": Sheet(1.75e15),
  "h200 nvl": Sheet(835e12),
  "h200": Sheet(989e12, 450e9, 141e9, "NVIDIA H200 SXM datasheet"),  # also GH200
  "h100 pcie": Sheet(756e12),
  "h100 nvl": Sheet(835e12),
  "h100": Sheet(989e12, 450e9, 80e9, "NVIDIA H100 SXM datasheet"),  # e.g. "NVIDIA H100 80GB HBM3"
  "h800": Sheet(989e12),
  "a100": Sheet(312e12, 300e9, 80e9, "NVIDIA A100 SXM 80GB datasheet"),
  "a800": Sheet(312e12),
  "l40s": Sheet(362e12),
  "l40": Sheet(181e12),
  "l4": Sheet(121e12),
  "v100": Sheet(125e12),  # no bf16: fp16 tensor-core peak
  "tesla t4": Sheet(65e12),  # no bf16: fp16 tensor-core peak
  "mi300x": Sheet(1307e12),
}
# The kinds the planner can be asked about (--device-kind): a measured CPU host, and the GPUs
# whose link bandwidth and memory the table holds.
DEVICE_KINDS = ("cpu",) + tuple(k for k, s in DATASHEETS.items() if s.link and s.memory)


def sheet_for(device_kind: str) -> tuple[str, Sheet] | None:
  """The first table entry whose name is in the lower-cased `device_kind`."""
  lowered = device_kind.lower()
  return next(((name, s) for name, s in DATASHEETS.items() if name in lowered), None)


def _best_matmul_flops(device: Any, n: int, dtype: Any, repeats: int) -> float:
  """Best FLOP/s of an n×n @ n×n matmul on `device` over `repeats` timed runs after a warm-up."""
  import jax
  import jax.numpy as jnp
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  b = jax.device_put(jnp.ones((n, n), dtype), device)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()  # compile and warm caches outside the timing
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


_PEAK_CACHE: dict[tuple[str, str, int], tuple[float, str]] = {}
_HOST_CACHE: dict[tuple[str, int], tuple[int, int, int]] = {}
_HOSTS = "jaxpar/hosts/"  # key prefix in JAX's coordination service: each process's host
_HOST_PEAK = "jaxpar/host_peak/"  # ... and the peak the first process on a host measured
_EXCHANGE_MS = 300_000  # how long a process waits for the others' host, or its host's peak


def _host(platform: str, n_local: int) -> tuple[int, int, int]:
  """(devices of `platform` on this host over every process of the run, processes on it, the
  lowest of them), from each process's host name and device count in JAX's coordination
  service; (n_local, 1, this process) for one process. Every process must call it."""
  import jax
  key = (platform, n_local)
  if key in _HOST_CACHE:
    return _HOST_CACHE[key]
  me, pc = jax.process_index(), jax.process_count()
  client = None
  if pc > 1:
    from jax._src import distributed as jd  # the coordination service's key-value store
    client = jd.global_state.client
  if client is None:
    _HOST_CACHE[key] = (n_local, 1, me)
    return _HOST_CACHE[key]
  host = socket.gethostname()
  client.key_value_set(f"{_HOSTS}{me}", json.dumps([host, n_local]), allow_overwrite=True)
  hosts = [json.loads(client.blocking_key_value_get(f"{_HOSTS}{p}", _EXCHANGE_MS))
           for p in range(pc)]
  same = [p for p, (h, _) in enumerate(hosts) if h == host]
  _HOST_CACHE[key] = (sum(hosts[p][1] for p in same), len(same), min(same))
  return _HOST_CACHE[key]


def _cpu_model() -> str:
  """The host CPU's model name ("" where /proc/cpuinfo is not there)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def _measured_for(device: Any, n_devices: int) -> list:
  """What a measured peak holds for: the device kind and count (on a CPU, of the whole host, over
  every process on it), and on a CPU host its core count and model."""
  what = [device.platform, device.device_kind, n_devices]
  return what + [os.cpu_count(), _cpu_model()] if device.platform == "cpu" else what


def peak_flops_per_device(earlier: dict | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one local device, where the number came from); measured once per process.

  GPUs use the datasheet dense bf16 peak for their `device_kind`; unknown accelerators are
  measured with a bf16 matmul. On CPU the host peak is measured with an fp32 1024³ matmul on one
  device (XLA:CPU spreads it over all cores) and divided by the number of CPU devices on this
  host, every process's (simulated devices, --xla_force_host_platform_device_count, share those
  cores): with several processes on one host the first of them measures while the others wait,
  and they take its figure from JAX's coordination service.
  `earlier` is what `peak_record` made of a measurement by an earlier process of the same run (a
  restart reads it from its checkpoint): where it was measured for the same devices it is taken
  as it is, so MFU stays comparable across restarts and the matmul (0.1 s on a CPU) is not run.
  """
  import jax
  import jax.numpy as jnp
  device = jax.local_devices()[0]
  n_local = len(jax.local_devices(backend=device.platform))
  key = (device.platform, device.device_kind, n_local)
  if key in _PEAK_CACHE:
    return _PEAK_CACHE[key]
  kind = device.device_kind
  match = sheet_for(kind) if device.platform != "cpu" else None
  on_host, processes, first = (_host(device.platform, n_local) if device.platform == "cpu"
                               else (n_local, 1, 0))
  if match is None and earlier and earlier.get("for") == _measured_for(device, on_host):
    peak, source = float(earlier["flops"]), str(earlier["source"])
  elif device.platform == "cpu":
    host = _host_peak(device, processes, first)
    peak = host / on_host
    devices = (f"{on_host} devices of {processes} processes on it" if processes > 1 else
               f"{on_host} local device" + ("s" if on_host > 1 else ""))
    source = (f"measured fp32 matmul peak of this CPU host ({host / 1e9:.1f} GFLOP/s) divided "
              f"among {devices}: {peak / 1e9:.1f} GFLOP/s per device")
  elif match is not None:
    peak = match[1].flops
    source = f"datasheet dense bf16 peak of {kind}: {peak / 1e12:.0f} TFLOP/s"
  else:
    peak = _best_matmul_flops(device, 8192, jnp.bfloat16, repeats=10)
    source = f"measured bf16 matmul peak of this {kind}: {peak / 1e12:.1f} TFLOP/s"
  _PEAK_CACHE[key] = (peak, source)
  return peak, source


def _host_peak(device: Any, processes: int, first: int) -> float:
  """The host's fp32 matmul FLOP/s: measured here when this is the first (or only) process on
  the host, else the first one's figure (measured while the others wait: at once, each would
  measure a share of the cores)."""
  import jax
  import jax.numpy as jnp
  if processes == 1:
    return _best_matmul_flops(device, 1024, jnp.float32, repeats=5)
  from jax._src import distributed as jd  # the coordination service's key-value store
  client, key = jd.global_state.client, f"{_HOST_PEAK}{socket.gethostname()}"
  if jax.process_index() == first:
    host = _best_matmul_flops(device, 1024, jnp.float32, repeats=5)
    client.key_value_set(key, repr(host), allow_overwrite=True)
    return host
  return float(client.blocking_key_value_get(key, _EXCHANGE_MS))


def peak_record(peak: float, source: str) -> dict:
  """A peak as a checkpoint keeps it, for `peak_flops_per_device(earlier=...)` of a restart."""
  import jax
  device = jax.local_devices()[0]
  n_local = len(jax.local_devices(backend=device.platform))
  on_host = _host(device.platform, n_local)[0] if device.platform == "cpu" else n_local
  return {"flops": peak, "source": source, "for": _measured_for(device, on_host)}


@dataclasses.dataclass(frozen=True)
class Rates:
  """What one device does per second and holds: the denominators of the prediction."""
  kind: str
  flops: float  # FLOP/s
  link: float  # bytes/s one device sends
  memory: float  # bytes
  source: str


def memcpy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
  """Best bytes/s of one numpy copy of `nbytes` on this host: simulated devices' collectives are
  copies between buffers of one process."""
  import numpy as np
  src = np.ones(nbytes // 8)
  dst = np.empty_like(src)
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return nbytes / best


def rates(kind: str, n_devices: int) -> Rates:
  """Rates of one of `n_devices` devices of `kind`: datasheet figures for GPUs, measured on CPU.

  Simulated CPU devices share the host: its measured matmul FLOP/s, memcpy bandwidth and physical
  memory are divided by `n_devices`.
  """
  if kind != "cpu" and kind in DEVICE_KINDS:
    s = DATASHEETS[kind]
    return Rates(kind, s.flops, s.link, s.memory,
                 f"{s.source}: {s.flops / 1e12:.0f} TFLOP/s dense bf16, NVLink "
                 f"{s.link / 1e9:.0f} GB/s each way, {s.memory / 1e9:.0f} GB")
  if kind != "cpu":
    raise ConfigError(f"--device-kind {kind!r} is not one of {', '.join(DEVICE_KINDS)}")
  import jax
  per_local, _ = peak_flops_per_device()
  host_flops = per_local * len(jax.local_devices())
  host_link = memcpy_bandwidth()
  host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  n = n_devices
  return Rates("cpu", host_flops / n, host_link / n, host_memory / n,
               f"this host, measured: fp32 matmul {host_flops / 1e9:.1f} GFLOP/s, memcpy "
               f"{host_link / 1e9:.1f} GB/s, {host_memory / 1e9:.1f} GB of memory, each shared by "
               f"{n} simulated devices")
