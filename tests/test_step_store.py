"""The step store and JAX's compilation cache: where the folder comes from, what hits and misses,
the key, and the bound on the folder's size.

The subprocess runs use a tiny model and their own cache folder (never the session's, so no
other test's compiles decide a hit or a miss here).
"""
import os
import pathlib
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from jaxpar import config
from jaxpar.commands import cli
from jaxpar.train import loop
from test_goodput import PLAN, TINY, TRAIN, records, run


def test_the_cache_folder_comes_from_the_key_then_the_environment_then_the_user_cache():
  cfg = config.load(None, [])
  gpu = {"JAX_PLATFORMS": "cuda"}
  assert cli.compile_cache_dir(cfg, {**gpu, "HOME": "/h"}) == os.path.join(
      os.path.expanduser("~"), ".cache", "jaxpar", "xla")
  assert cli.compile_cache_dir(cfg, {**gpu, "XDG_CACHE_HOME": "/x"}) == "/x/jaxpar/xla"
  # On by default on the CPU too, except for the layout whose reload XLA:CPU crashes on, which
  # gets none there even when a folder is named (and keeps it on an accelerator).
  cpu = {"JAX_PLATFORMS": "cpu"}
  assert cli.compile_cache_dir(cfg, {**cpu, "XDG_CACHE_HOME": "/x"}) == "/x/jaxpar/xla"
  assert cli.compile_cache_dir(cfg, {**cpu, "JAXPAR_COMPILE_CACHE": "/p"}) == "/p"
  for zero, kept in [(1, True), (2, True), (3, False)]:
    circular = config.load(None, ["parallel.schedule=circular", "parallel.virtual_stages=2",
                                  f"parallel.zero_stage={zero}", "train.compile_cache=/c"])
    assert cli.compile_cache_dir(circular, {**cpu, "XDG_CACHE_HOME": "/x"}) == (
        "/c" if kept else None), zero
    assert cli.compile_cache_dir(circular, {**gpu, "XDG_CACHE_HOME": "/x"}) == "/c"
  gpipe = config.load(None, ["parallel.schedule=gpipe", "parallel.zero_stage=3"])
  assert cli.compile_cache_dir(gpipe, {**cpu, "XDG_CACHE_HOME": "/x"}) == "/x/jaxpar/xla"
  assert cli.compile_cache_dir(cfg, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  assert cli.compile_cache_dir(cfg, {"JAXPAR_COMPILE_CACHE": "/p", "XDG_CACHE_HOME": "/x"}) == "/p"
  assert cli.compile_cache_dir(cfg, {"JAXPAR_COMPILE_CACHE": "off"}) is None
  own = config.load(None, ["train.compile_cache=/c"])
  assert cli.compile_cache_dir(own, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/c"
  assert cli.compile_cache_dir(config.load(None, ["train.compile_cache=off"]), {}) is None
  assert cli.compile_cache_dir(cfg, {"JAX_ENABLE_COMPILATION_CACHE": "false",
                                    "JAX_COMPILATION_CACHE_DIR": "/j"}) is None


def test_plan_then_train_compiles_the_step_once_and_another_topology_misses(tmp_path):
  cache = tmp_path / "cache"
  common = ["--set", *TINY, f"train.compile_cache={cache}"]
  r = run([PLAN, "--mesh", "2x1x1", "--json", *common])
  assert r.returncode == 0, r.stderr
  assert any(p.name.startswith("jit_step_fn") for p in cache.iterdir())

  # plan.py compiled this layout's step: train.py loads it, and says so in its first metrics row
  # and in its summary.
  m = tmp_path / "m.jsonl"
  r = run([TRAIN, "--mesh", "2x1x1", "--workdir", str(tmp_path / "wd"), "--metrics-file", str(m),
           "--no-progress", *common])
  assert r.returncode == 0, r.stderr
  rows = records(m)
  assert rows[0]["compile_cache"] == "hit" and rows[0]["compile_s"] > 0
  assert rows[-1]["final"] and rows[-1]["compile_cache"] == "hit"
  assert "compile_cache: hit" in r.stdout

  # Loaded from JAX's cache, the step is not kept in jaxpar's step store: on XLA:CPU such an
  # executable serializes without its kernels (executables.save).
  store = cache / "jaxpar-steps"
  assert rows[0]["step_store"] == "miss" and not list(store.glob("*.pkl"))

  # Another topology (one device) is never served the 2-device program. Compiled here, its step
  # is kept in the store; a restart from step 2 loads it without tracing, reads the checkpoint
  # beside the load, and trains step 3 to the same loss.
  m1, wd1 = tmp_path / "m1.jsonl", tmp_path / "wd1"
  one = [TRAIN, "--mesh", "1x1x1", "--workdir", str(wd1), "--metrics-file", str(m1),
         "--no-progress", *common, "checkpoint.every=2"]
  r = run(one)
  assert r.returncode == 0, r.stderr
  first = records(m1)
  assert first[-1]["compile_cache"] == "miss" and first[-1]["step_store"] == "miss"
  assert len(list(store.glob("*.pkl"))) == 1
  shutil.rmtree(wd1 / "checkpoints" / "3")
  m1.unlink()
  r = run(one)
  assert r.returncode == 0, r.stderr
  again = records(m1)
  assert again[0]["step_store"] == "hit" and again[0]["compile_cache"] == "hit"
  assert [(x["step"], x["loss"]) for x in again[:-1]] == [(3, first[2]["loss"])]
  # The restart takes the peak FLOP/s the run measured (from the checkpoint), not a new matmul.
  assert again[-1]["peak_flops_per_device"] == first[-1]["peak_flops_per_device"]

  # A bound (train.compile_cache_max_gb) reaches both: a run of another step under a bound of
  # 0.2 MiB, below one stored step (~1 MiB), keeps its own step alone in the store, and the
  # programs the earlier runs left in JAX's cache (0.7 MiB) are cut to the bound as it starts.
  kept, bound = list(store.glob("*.pkl")), int(0.0002 * 2**30)
  before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.glob("*-cache")}
  assert sum(size for size, _ in before.values()) > bound
  r = run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd2"), "--no-progress",
           *common, "train.lr=0.5", "train.compile_cache_max_gb=0.0002"])
  assert r.returncode == 0, r.stderr
  assert len(list(store.glob("*.pkl"))) == 1 and not set(store.glob("*.pkl")) & set(kept)
  left = [size for p, (size, mtime) in before.items()  # not written again by this run
          if p.exists() and p.stat().st_mtime_ns == mtime]
  assert left and sum(left) <= bound


def test_a_cache_folder_that_cannot_be_made_is_one_sentence(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  r = run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd"), "--no-progress",
           "--set", *TINY, f"train.compile_cache={blocker}/sub"])
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith(
      f"error: train.compile_cache={blocker}/sub cannot be made"), r.stderr
  assert not (tmp_path / "wd").exists()


def test_the_step_store_keys_what_makes_the_step_and_a_bad_entry_is_a_miss(tmp_path, monkeypatch):
  import jaxpar
  from jaxpar.planning import plan
  from jaxpar.train import executables
  from jaxpar.parallel import mesh as jmesh

  def prepare(cfg, shape):
    return loop.Trainer(cfg, jmesh.make(shape, jax.devices()[:shape[0]]), loop.build_model(cfg))

  cfg = config.load(None, TINY)
  trainer = prepare(cfg, (2, 1, 1))
  batch = plan._batch_abstract(cfg)
  sharding = trainer.batch_sharding(batch)
  key = executables.fingerprint(trainer, batch, sharding)
  assert executables.fingerprint(prepare(cfg, (2, 1, 1)), batch, sharding) == key
  # Whatever makes another step makes another key: a setting, the batch, the devices, the
  # XLA flags, jaxpar's own files.
  other = prepare(config.override(cfg, train={"lr": 0.5}), (2, 1, 1))
  assert executables.fingerprint(other, batch, sharding) != key
  bigger = plan._batch_abstract(config.override(cfg, train={"batch_size": 8}))
  assert executables.fingerprint(trainer, bigger, trainer.batch_sharding(bigger)) != key
  four = prepare(cfg, (4, 1, 1))
  assert executables.fingerprint(four, batch, four.batch_sharding(batch)) != key
  with monkeypatch.context() as m:
    m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert executables.fingerprint(trainer, batch, sharding) != key
  with monkeypatch.context() as m:
    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.dirname(jaxpar.__file__), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    m.setattr(jaxpar, "__file__", str(pkg / "__init__.py"))
    m.setattr(executables, "_source", None)
    copy = executables.fingerprint(trainer, batch, sharding)
    (pkg / "train" / "optim.py").write_text((pkg / "train" / "optim.py").read_text() + "#\n")
    m.setattr(executables, "_source", None)
    assert executables.fingerprint(trainer, batch, sharding) != copy

  # A step compiled here (not loaded from JAX's cache) comes back onto its mesh's devices, in
  # the mesh's order (here not the devices' own), and computes the same numbers.
  devs = [jax.devices()[i] for i in (2, 0, 3, 1)]
  trainer = loop.Trainer(cfg, jmesh.make((2, 2, 1), devs), loop.build_model(cfg))
  sharding = trainer.batch_sharding(batch)
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    compiled = trainer.lower(batch).compile()
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
  where = str(tmp_path / "store")
  assert executables.save(where, key, compiled)
  args, devs = (trainer.abstract_state, batch), list(trainer.mesh.devices.flat)
  loaded = executables.load(where, key, args, devs)
  tokens = np.random.default_rng(0).integers(0, 256, batch["tokens"].shape, np.int32)
  data = {"tokens": jax.device_put(tokens, sharding["tokens"])}
  ran = [c(trainer.init(0), data) for c in (compiled, loaded)]
  assert float(ran[0][1]["loss"]) == float(ran[1][1]["loss"])
  for a, b in zip(*(jax.tree_util.tree_leaves(r[0]["params"]) for r in ran)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Anything else is a miss, never an error: another key, other arguments, a damaged entry.
  assert executables.load(where, "0" * 64, args, devs) is None
  assert executables.load(where, key, (trainer.abstract_state, bigger), devs) is None
  assert executables.load(where, key, (trainer.abstract_state, {"x": batch["tokens"]}),
                          devs) is None
  path = pathlib.Path(where) / f"{key}.pkl"
  os.utime(path, (1e9, 1e9))
  assert executables.load(where, key, args, devs) is not None
  assert path.stat().st_mtime > time.time() - 600  # a load marks its entry used
  path.write_bytes(path.read_bytes()[:1000])
  assert executables.load(where, key, args, devs) is None
  assert [p.name for p in pathlib.Path(where).iterdir()] == [path.name]  # nothing half-written


def test_a_watch_of_this_threads_compiles_ignores_a_compile_beside_it():
  from jaxpar.train import metrics
  import jax.numpy as jnp
  step = jax.jit(lambda x: x * 3.25)
  step.lower(jnp.ones(7)).compile()  # now in the session's persistent cache
  for this_thread, seen in ((True, "hit"), (False, "miss")):
    jax.clear_caches()  # what this process compiled: only the persistent cache has it now
    size = 11 if this_thread else 13  # a program no cache holds, compiled beside the watch
    beside = threading.Thread(target=lambda: jax.jit(lambda x: x - 7.5).lower(
        jnp.ones(size)).compile())
    with metrics.compile_watch(this_thread=this_thread) as watch:
      beside.start()
      beside.join()
      step.lower(jnp.ones(7)).compile()
    assert watch["compile_cache"] == seen


def test_the_cache_and_the_step_store_keep_at_most_their_bound_least_recently_used_first(
    tmp_path, monkeypatch):
  from jaxpar.train import executables
  where = tmp_path / "store"
  where.mkdir()
  now = time.time()
  for i, (key, size) in enumerate((("a", 400), ("b", 300), ("c", 200), ("d", 100))):
    (where / f"{key}.pkl").write_bytes(b"x" * size)
    os.utime(where / f"{key}.pkl", (now - 1000 + i, now - 1000 + i))  # a is the least recent
  (where / ".d.left.tmp").write_bytes(b"x")  # a save killed two days ago, and one under way
  os.utime(where / ".d.left.tmp", (now - 2 * 86400, now - 2 * 86400))
  (where / ".c.now.tmp").write_bytes(b"x")
  assert executables.prune(str(where), 500) == ["a", "b"]  # 1000 -> 300: the oldest go first
  assert sorted(p.name for p in where.iterdir()) == [".c.now.tmp", "c.pkl", "d.pkl"]
  os.utime(where / "d.pkl", (now - 5000, now - 5000))  # d least recently used, but kept
  assert executables.prune(str(where), 50, keep="d") == ["c"]
  assert executables.prune(str(where), 50, keep="d") == []  # d alone is over the bound: stays
  assert sorted(p.name for p in where.iterdir()) == [".c.now.tmp", "d.pkl"]
  # Two processes pruning at once: an entry the other took first counts as gone, so no more go.
  for key in ("e", "f", "g"):
    (where / f"{key}.pkl").write_bytes(b"x" * 100)
  real_remove = os.remove
  def raced(path):
    real_remove(path)
    if path.endswith("e.pkl"):
      raise FileNotFoundError(path)
  monkeypatch.setattr(os, "remove", raced)
  assert executables.prune(str(where), 250) == ["d"]  # then e went (the other's): enough
  monkeypatch.setattr(os, "remove", real_remove)
  assert sorted(p.name for p in where.iterdir()) == [".c.now.tmp", "f.pkl", "g.pkl"]

  # JAX's programs: train.compile_cache_max_gb (10 GiB by default) bounds them too, kept as a run
  # starts, unless 0 or the environment (JAX's own eviction) says otherwise.
  cfg = config.load(None, [])
  assert cfg.train.compile_cache_max_gb == 10.0
  assert cli.cache_max_bytes(cfg, {}) == 10 * 2**30
  assert cli.cache_max_bytes(config.load(None, ["train.compile_cache_max_gb=0.5"]), {}) == 2**29
  assert cli.cache_max_bytes(config.load(None, ["train.compile_cache_max_gb=0"]), {}) == 0
  assert cli.cache_max_bytes(cfg, {"JAX_COMPILATION_CACHE_MAX_SIZE": "99"}) == 0
  with pytest.raises(config.ConfigError, match="must not be negative"):
    config.load(None, ["train.compile_cache_max_gb=-1"])
  cache = tmp_path / "cache"
  (cache / "jaxpar-steps").mkdir(parents=True)
  for i, key in enumerate(("jit_old", "jit_new")):
    (cache / f"{key}-cache").write_bytes(b"x" * 600)
    (cache / f"{key}-atime").write_bytes(b"t" * 8)  # JAX's eviction's file, where it was on
    os.utime(cache / f"{key}-cache", (now - 100 + i, now - 100 + i))
  updates = {}
  monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  cli.use_compile_cache(config.load(None, [f"train.compile_cache={cache}",
                                           "train.compile_cache_max_gb=1e-6"]))  # 1073 bytes
  assert updates["jax_compilation_cache_dir"] == str(cache)
  assert "jax_compilation_cache_max_size" not in updates  # JAX's eviction stays off
  assert sorted(p.name for p in cache.iterdir()) == ["jaxpar-steps", "jit_new-atime",
                                                      "jit_new-cache"]
