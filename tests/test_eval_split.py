"""train.eval_steps=0 evaluates every example of the split: the last, partial batch is padded to
the batch's shape and its padding weighs 0, on a sharded layout as on one device."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_equivalence as eq

from jaxpar.data.loader import BatchIterator, TokenBatches, synthetic_windows
from jaxpar.data.tfds_source import Batches
from jaxpar.train import hooks
from jaxpar.train import metrics as jmetrics


class Watchdog:
  def at(self, *args, **kwargs):
    pass


def test_the_whole_split_is_every_example_on_2x2x2(monkeypatch):
  """10 examples, batches of 4: the eval is the mean over all 10 (a one-device forward over the
  10 as one batch), not over the 8 of the two full batches."""
  extra = ["train.batch_size=4", "train.eval_steps=0", "parallel.zero_stage=3",
           "parallel.microbatches=2"]
  cfg = eq.make_cfg(*extra)
  windows = synthetic_windows(cfg.model.seq_len, 1, n=10).astype(np.int32)
  evals = TokenBatches(BatchIterator(windows, 4, seed=0, prefetch=0))
  assert (evals.steps_per_epoch, evals.whole_split_steps) == (2, 3)
  t = eq.trainer(cfg, (2, 2, 2))
  state = t.init(cfg.train.seed)
  abstract = {"tokens": jax.ShapeDtypeStruct((4, cfg.model.seq_len + 1), jnp.int32)}
  ev = hooks.Evaluation(cfg, t, evals, abstract, t.batch_sharding(abstract), jmetrics.TimeSplit())
  got = ev(0, state, {}, Watchdog(), hooks.Throughput(resumed=False))["eval_loss"]

  one = eq.trainer(eq.make_cfg("train.batch_size=4"), (1, 1, 1))
  params = one.init(cfg.train.seed)["params"]  # the same values: init does not depend on layout

  def mean_over(rows):
    batch = {"tokens": jnp.asarray(windows[rows])}
    fn = one.eval_jitted(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                batch))
    with jax.set_mesh(one.mesh):
      return float(fn(params, batch)["loss"])
  want = mean_over(np.arange(10))
  # The two full batches alone (what was evaluated before): an untrained model's losses are all
  # near log(256), so the figures differ in the 5th digit, 40 times what the layouts differ by.
  before = mean_over(evals._it._plan.order(0)[:8])
  assert abs(got - want) < 1e-6 * want < abs(before - want) / 10, (got, want, before)


def test_eval_steps_below_the_whole_split_keeps_its_full_batches():
  windows = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
  it = BatchIterator(windows, 4, seed=0, prefetch=0)
  for k in range(2):  # the padded pass starts with the very batches of epoch 0
    batch, weight = it.padded_batch(k)
    assert np.array_equal(batch, it.next()) and weight.tolist() == [1] * 4
  batch, weight = it.padded_batch(2)
  assert weight.tolist() == [1, 1, 0, 0] and batch.shape == (4, 3)


@pytest.mark.parametrize("shared", [True, False], ids=["text-shared-order", "image-shards"])
@pytest.mark.parametrize("records,processes,local", [(10, 2, 2), (11, 2, 2), (13, 3, 2),
                                                     (9, 2, 4)])
def test_every_record_once_over_the_processes(shared, records, processes, local):
  """Each process's padded batches: every record of the split exactly once at weight 1, the
  same number of batches on every process (the eval step is a collective)."""
  seen, steps = collections.Counter(), set()
  for p in range(processes):
    lo = p * (records // processes) + min(p, records % processes)  # tfds_source.shard_range
    hi = (p + 1) * (records // processes) + min(p + 1, records % processes)
    shard = records if shared else hi - lo
    b = Batches(lambda keys: {"i": np.asarray(keys)}, shard, records // processes, local, 0,
                {"i": ((local,), np.dtype(np.int64))}, "test", workers=0, shard_index=p,
                shard_count=processes, shared=shared, records=records)
    steps.add(b.whole_split_steps)
    for k in range(b.whole_split_steps):
      out, weight = b.padded_batch(k)
      assert out["i"].shape == (local,) and weight.shape == (local,)
      seen.update((out["i"][weight > 0] + (0 if shared else lo)).tolist())
  assert steps == {-(-records // (local * processes))}
  assert seen == collections.Counter(range(records))
