"""A restart takes the peak FLOP/s its checkpoint recorded only where it was measured for the same
devices: the same device kind, the same number of local devices and (on a CPU) the same host. The
devices are changed under the record, not the record under the devices, so a record that drops a
field and a comparison that skips one both fail here (test_goodput.py's check edits only the count
in the record, so a record without the device kind still passed it).

The matmul that measures a CPU peak is replaced by a constant: measured = that constant / devices.
"""
import types

import jax
import pytest

from jaxpar.analysis import devices

HOST_FLOPS = 8e9  # what the stubbed matmul "measures" for the whole host
RECORDED = 123.0  # a peak no measurement here gives


@pytest.fixture
def stubbed(monkeypatch):
  """No cached peak and no timing: a measurement is HOST_FLOPS over the local devices."""
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})
  monkeypatch.setattr(devices, "_best_matmul_flops", lambda *a, **k: HOST_FLOPS)
  return monkeypatch


def as_if(monkeypatch, kind=None, count=None):
  """Make jax.local_devices() report CPU devices of `kind` and `count` (defaults: the real ones)."""
  real = jax.local_devices()
  kind = real[0].device_kind if kind is None else kind
  fake = [types.SimpleNamespace(platform="cpu", device_kind=kind, id=i)
          for i in range(len(real) if count is None else count)]
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: fake)
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})


def taken(record) -> bool:
  peak, source = devices.peak_flops_per_device(record)
  if peak == RECORDED:
    assert source == "recorded"
    return True
  assert "measured fp32 matmul peak" in source and peak == HOST_FLOPS / len(jax.local_devices())
  return False


def test_the_same_devices_take_the_record(stubbed):
  as_if(stubbed)
  record = devices.peak_record(RECORDED, "recorded")
  assert taken(record)


@pytest.mark.parametrize("change", ["device kind", "device count", "host cores", "host cpu model"])
def test_other_devices_measure_their_own_peak(stubbed, change):
  as_if(stubbed)
  record = devices.peak_record(RECORDED, "recorded")
  if change == "device kind":
    as_if(stubbed, kind="another cpu")
  elif change == "device count":
    as_if(stubbed, count=len(jax.local_devices()) // 2)
  elif change == "host cores":
    stubbed.setattr(devices.os, "cpu_count", lambda: 1000)
    as_if(stubbed)
  else:
    stubbed.setattr(devices, "_cpu_model", lambda: "another CPU model")
    as_if(stubbed)
  assert not taken(record)
  # and back on the devices it was made for, it is taken again
  stubbed.undo()
  stubbed.setattr(devices, "_PEAK_CACHE", {})
  stubbed.setattr(devices, "_best_matmul_flops", lambda *a, **k: HOST_FLOPS)
  assert taken(record)


class Store:
  """JAX's coordination service's key-value store as the peak's exchange uses it."""

  def __init__(self, entries):
    self.entries = dict(entries)

  def key_value_set(self, key, value, allow_overwrite=False):
    self.entries[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    return self.entries[key]  # (a KeyError: the exchange waited for a key nobody writes)


def as_process(monkeypatch, index, store):
  """Make this process `index` of 2, with `store` as the coordination service's."""
  from jax._src import distributed as jd
  monkeypatch.setattr(jax, "process_index", lambda: index)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jd.global_state, "client", store)
  monkeypatch.setattr(devices, "_HOST_CACHE", {})
  monkeypatch.setattr(devices, "_PEAK_CACHE", {})


def test_processes_on_one_host_divide_its_peak_among_all_their_devices(stubbed):
  """Two processes of 4 CPU devices each on one host: the first measures the host (alone: at
  once, each would measure a share of its cores) and both divide it among the host's 8 devices,
  not each among its own 4 (which halved MFU); a record of those 8 devices is taken by a resume
  with one process of 8 as with two of 4; a process on another host does not count."""
  import socket
  host = socket.gethostname()
  as_if(stubbed, count=4)
  store = Store({"jaxpar/hosts/1": f'["{host}", 4]'})
  as_process(stubbed, 0, store)
  peak, source = devices.peak_flops_per_device()
  assert peak == HOST_FLOPS / 8 and "divided among 8 devices of 2 processes on it" in source
  assert store.entries[f"jaxpar/host_peak/{host}"] == repr(HOST_FLOPS)
  record = devices.peak_record(peak, source)
  assert record["for"][2] == 8
  # the second process takes the first one's figure and measures nothing
  store = Store({"jaxpar/hosts/0": f'["{host}", 4]', f"jaxpar/host_peak/{host}": repr(3 * HOST_FLOPS)})
  as_process(stubbed, 1, store)
  stubbed.setattr(devices, "_best_matmul_flops", lambda *a, **k: pytest.fail("measured twice"))
  assert devices.peak_flops_per_device()[0] == 3 * HOST_FLOPS / 8
  # one process of 8 devices on the same host takes the record of two processes of 4
  stubbed.setattr(devices, "_best_matmul_flops", lambda *a, **k: HOST_FLOPS)
  stubbed.setattr(jax, "process_count", lambda: 1)
  stubbed.setattr(jax, "process_index", lambda: 0)
  stubbed.setattr(devices, "_HOST_CACHE", {})
  as_if(stubbed, count=8)
  assert devices.peak_flops_per_device(record) == (peak, source)
  # a process on another host: each host's devices alone
  as_if(stubbed, count=4)
  as_process(stubbed, 0, Store({"jaxpar/hosts/1": '["another-host", 4]'}))
  assert devices.peak_flops_per_device() == (
      HOST_FLOPS / 4, devices.peak_flops_per_device()[1])
  assert "among 4 local devices" in devices.peak_flops_per_device()[1]
