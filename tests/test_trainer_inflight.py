"""Trainer.step bounds the steps in flight: a loop that dispatches steps without ever waiting
(here 300 on 8 simulated CPU devices) finishes, and no more than `in_flight` steps are ever
unfinished at once."""
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import child_env
from flax import nnx

import jaxpar
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import step as jstep

# A user's loop as the issue ran it: numpy batches, results never read until the end. Unbounded,
# it aborted on 8x1x1 in XLA:CPU's all-reduce rendezvous (40 s timeout) between steps 100 and 200.
LOOP = """
import jax, numpy as np, optax
from flax import nnx
import jaxpar

class MLP(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(32, 256, rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)))
    self.down = nnx.Linear(256, 10, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))
  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))

def loss_fn(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

cfg = jaxpar.config.load(None, ["train.batch_size=64", "train.lr=1e-2"])
trainer = jaxpar.Trainer(cfg, jaxpar.make_mesh("8x1x1"), jaxpar.from_nnx(MLP, loss_fn))
state = trainer.init(seed=0)
rng = np.random.default_rng(0)
metrics = []
for _ in range(300):
  x = rng.normal(size=(64, 32)).astype(np.float32)
  state, m = trainer.step(state, {"x": x, "y": x[:, :10].argmax(-1).astype(np.int32)})
  metrics.append(m)
print("done", len(metrics), float(metrics[0]["loss"]), float(metrics[-1]["loss"]))
"""


def test_a_loop_that_never_waits_finishes_on_8x1x1():
  # One run here to stay cheap; the 5 runs of 5 were run by hand (see the commit).
  env = child_env()
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  r = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=300,
                     env=env)
  assert r.returncode == 0, r.stderr[-2000:]
  done, n, first, last = r.stdout.split()
  assert (done, n) == ("done", "300") and float(last) < float(first)


class Pending:
  """A step's output on a device that finishes a step only when someone waits for it."""

  def __init__(self):
    self.done = False

  def block_until_ready(self):
    self.done = True
    return self


class Linear(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def trainer_with_slow_device(monkeypatch, **kw):
  """A Trainer whose compiled step is a fake recording, at each dispatch, how many steps are
  unfinished."""
  loss = lambda out, batch: (optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
                             .mean(), {})
  model = jaxpar.from_nnx(Linear, loss, path_rules=[("bias", (None,)), ("kernel", (None, None))])
  cfg = jaxpar.config.load(None, ["train.batch_size=2"])
  t = jaxpar.Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), model, **kw)
  issued, unfinished = [], []

  def run(state, batch):
    unfinished.append(sum(not p.done for p in issued))  # before this one is dispatched
    issued.append(Pending())
    return state, {"loss": issued[-1]}
  monkeypatch.setattr(t, "lower", lambda abstract: type("Lowered", (), {"compile": lambda: run}))
  return t, issued, unfinished


@pytest.mark.parametrize("in_flight", [1, 2, 3, None])
def test_no_more_than_in_flight_steps_are_unfinished(monkeypatch, in_flight):
  kw = {} if in_flight == 2 else {"in_flight": in_flight}  # 2: the default
  t, issued, unfinished = trainer_with_slow_device(monkeypatch, **kw)
  state = {"params": {}}
  batch = {"x": np.zeros((2, 4), np.float32), "y": np.zeros((2,), np.int32)}
  for _ in range(20):
    state, metrics = t.step(state, batch)
    assert not metrics["loss"].done  # the newest step is never waited for
  if in_flight is None:
    assert unfinished == list(range(20))  # unbounded: the queue only grows
  else:
    assert max(unfinished) == in_flight - 1  # with the one dispatched: in_flight
    assert sum(not p.done for p in issued) == in_flight  # the oldest were waited for, in order
    assert all(p.done for p in issued[:-in_flight])


def test_in_flight_must_be_a_positive_count():
  assert jstep.IN_FLIGHT == 2
  model = jaxpar.from_nnx(Linear, lambda out, b: (out.sum(), {}),
                          path_rules=[("bias", (None,)), ("kernel", (None, None))])
  for bad in (0, -1, 1.5, True):
    with pytest.raises(jaxpar.ConfigError, match=r"in_flight=.* must be a whole number of steps"):
      jaxpar.Trainer(jaxpar.config.load(None, []), jmesh.make((1, 1, 1), jax.devices()[:1]),
                     model, in_flight=bad)
