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
