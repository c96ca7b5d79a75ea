"""The step store and JAX's compilation cache: where the folder comes from, what hits and misses,
the key, and the bound on the folder's size.

The subprocess runs use a tiny model and their own cache folder (never the session's, so no
other test's compiles decide a hit or a miss here).
"""
import errno
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jaxpar import config
from jaxpar.commands import cli
from jaxpar.train import executables, loop
from test_goodput import PLAN, ROOT, TINY, TRAIN, child_env, records, run


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


class Planted:
  """A pickle that makes the folder `marker` when it is unpickled (as a planted entry would run
  any command)."""

  def __init__(self, marker):
    self.marker = str(marker)

  def __reduce__(self):
    return (os.mkdir, (self.marker,))


def store_run(args, secret):
  """run(args) with the step store's secret in `secret` (never the user's own)."""
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180,
                        env={**child_env(), executables.ENV_SECRET: str(secret)}, cwd=ROOT)


def test_plan_stores_the_step_train_loads_it_and_a_planted_entry_is_never_unpickled(tmp_path):
  cache, secret = tmp_path / "cache", tmp_path / "config" / "secret"
  common = ["--set", *TINY, f"train.compile_cache={cache}"]
  r = store_run([PLAN, "--mesh", "2x1x1", "--json", *common], secret)
  assert r.returncode == 0, r.stderr
  # plan.py kept the step it compiled, under the key train.py looks up; the folders are this
  # user's alone, the entry and the secret readable by this user only.
  store = cache / "jaxpar-steps"
  [entry] = store.glob("*.pkl")
  for path, mode in ((cache, 0o700), (store, 0o700), (entry, 0o600), (secret, 0o600)):
    assert path.stat().st_mode & 0o777 == mode, path
  assert entry.read_bytes().startswith(executables.MAGIC)

  # train.py loads it without tracing, though train.log_every and checkpoint.every differ from
  # plan.py's: neither enters the step.
  m, wd = tmp_path / "m.jsonl", tmp_path / "wd"
  two = [TRAIN, "--mesh", "2x1x1", "--workdir", str(wd), "--metrics-file", str(m),
         "--no-progress", *common, "train.log_every=2", "checkpoint.every=2"]
  r = store_run(two, secret)
  assert r.returncode == 0, r.stderr
  first = records(m)
  assert first[0]["step_store"] == "hit" and first[0]["compile_cache"] == "hit"
  assert first[-1]["final"] and first[-1]["step_store"] == "hit"
  assert "compile_cache: hit" in r.stdout and "note:" not in r.stderr

  # A pickle planted under the step's key is not unpickled: the run says why, compiles the step
  # (past JAX's cache, so that it can be kept) and stores it anew.
  marker = tmp_path / "planted-ran"
  entry.write_bytes(pickle.dumps(Planted(marker)))
  r = store_run([TRAIN, "--mesh", "2x1x1", "--workdir", str(tmp_path / "wd1"), "--no-progress",
                 *common], secret)
  assert r.returncode == 0, r.stderr
  assert not marker.exists()
  notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
  assert len(notes) == 1 and f"the stored step {entry} is not loaded" in notes[0], r.stderr
  assert "step_store: miss" in r.stdout
  assert entry.read_bytes().startswith(executables.MAGIC)

  # A restart from step 2 loads that step without tracing, reads the checkpoint beside the load,
  # and trains step 3 to the first run's loss; it takes the peak FLOP/s the run measured.
  shutil.rmtree(wd / "checkpoints" / "3")
  m.unlink()
  r = store_run(two, secret)
  assert r.returncode == 0, r.stderr
  again = records(m)
  assert again[0]["step_store"] == "hit" and again[0]["compile_cache"] == "hit"
  assert [(x["step"], x["loss"]) for x in again[:-1]] == [(3, first[1]["loss"])]
  assert again[-1]["peak_flops_per_device"] == first[-1]["peak_flops_per_device"]

  # A bound (train.compile_cache_max_gb) reaches both: a run of another step under a bound of
  # 0.1 MiB, below one stored step (~0.8 MiB), keeps its own step alone in the store, and the
  # programs the earlier runs left in JAX's cache (0.2 MiB: the steps are not there) are cut to
  # the bound as it starts.
  kept, bound = list(store.glob("*.pkl")), int(0.0001 * 2**30)
  before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.glob("*-cache")}
  assert sum(size for size, _ in before.values()) > bound
  r = store_run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd2"), "--no-progress",
                 *common, "train.lr=0.5", "train.compile_cache_max_gb=0.0001"], secret)
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


@pytest.fixture
def own_secret(tmp_path, monkeypatch):
  """The step store's secret in a fresh file of this test's."""
  monkeypatch.setenv(executables.ENV_SECRET, str(tmp_path / "secret"))
  monkeypatch.setattr(executables, "_secret", None)
  return tmp_path / "secret"


def test_the_step_store_keys_what_makes_the_step_and_a_bad_entry_is_a_miss(
    tmp_path, monkeypatch, own_secret):
  import jaxpar
  from jaxpar.planning import plan
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
  # XLA flags, JAX's options, the host's CPU, jaxpar's own files.
  other = prepare(config.override(cfg, train={"lr": 0.5}), (2, 1, 1))
  assert executables.fingerprint(other, batch, sharding) != key
  bigger = plan._batch_abstract(config.override(cfg, train={"batch_size": 8}))
  assert executables.fingerprint(trainer, bigger, trainer.batch_sharding(bigger)) != key
  four = prepare(cfg, (4, 1, 1))
  assert executables.fingerprint(four, batch, four.batch_sharding(batch)) != key
  with monkeypatch.context() as m:
    m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert executables.fingerprint(trainer, batch, sharding) != key
  with monkeypatch.context() as m:  # a cluster job's own coordinator port: the same step
    m.setenv("JAX_COORDINATOR_PORT", "61234")
    m.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:61234")
    assert executables.fingerprint(trainer, batch, sharding) == key
  precision = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", "highest")
  try:
    assert executables.fingerprint(trainer, batch, sharding) != key
  finally:
    jax.config.update("jax_default_matmul_precision", precision)
  with monkeypatch.context() as m:  # a host of another generation: one instruction set fewer
    first, rest = pathlib.Path(executables._CPUINFO).read_text().split("\n\n", 1)
    fewer = "\n".join(line.rsplit(" ", 1)[0] if line.startswith(("flags", "Features")) else line
                       for line in first.splitlines())
    (tmp_path / "cpuinfo").write_text(fewer + "\n\n" + rest)
    m.setattr(executables, "_CPUINFO", str(tmp_path / "cpuinfo"))
    m.setattr(executables, "_cpu", None)
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
  # What only the host reads (cadences, timeouts, the guard, paths, the cache) keeps the key; so
  # does the seed of a model without dropout, and the cache's own JAX options and variables.
  changed = {"train.log_every": 7, "train.eval_every": 5, "train.eval_steps": 3,
             "checkpoint.every": 9, "checkpoint.keep": 1, "train.spike_factor": 2.0,
             "train.spike_steps": 3, "train.spike_window": 20, "train.max_rollbacks": 1,
             "train.stall_timeout": 99.0, "train.first_step_timeout": 99.0,
             "train.compile_cache": "/elsewhere", "train.compile_cache_max_gb": 1.0,
             "model.init_from": "/a/model", "data.source": "local_text", "data.name": "x",
             "data.split": "test", "data.data_dir": "/d", "data.path": "/p",
             "data.max_bytes": 5, "data.eval_split": "test", "data.augment": True,
             "data.tokenizer": "/t.json", "data.workers": 0, "data.image_size": "8x8",
             "train.seed": 5}
  assert sorted(changed) == sorted(executables.EXCLUDED + ("train.seed",))
  for name, value in changed.items():
    section, field = name.split(".")
    moved = prepare(config.override(cfg, **{section: {field: value}}), (2, 1, 1))
    assert executables.fingerprint(moved, batch, sharding) == key, name
  with monkeypatch.context() as m:
    m.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least + 1.0)
    try:
      assert executables.fingerprint(trainer, batch, sharding) == key
    finally:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
  dropout = config.load(None, TINY + ["model.dropout=0.1"])
  seeded = [executables.fingerprint(prepare(config.override(dropout, train={"seed": s}),
                                            (2, 1, 1)), batch, sharding) for s in (0, 5)]
  assert seeded[0] != seeded[1]  # dropout's masks follow the seed: it enters that step

  # A step compiled here (not loaded from JAX's cache) comes back onto its mesh's devices, in
  # the mesh's order (here not the devices' own), and computes the same numbers.
  devs = [jax.devices()[i] for i in (2, 0, 3, 1)]
  trainer = loop.Trainer(cfg, jmesh.make((2, 2, 1), devs), loop.build_model(cfg))
  sharding = trainer.batch_sharding(batch)
  compiled = executables.compile_fresh(trainer.lower(batch))
  where = tmp_path / "store"
  assert executables.save(str(where), key, compiled)
  assert where.stat().st_mode & 0o777 == 0o700 and own_secret.stat().st_mode & 0o777 == 0o600
  args, devs = (trainer.abstract_state, batch), list(trainer.mesh.devices.flat)
  loaded = executables.load(str(where), key, args, devs)
  tokens = np.random.default_rng(0).integers(0, 256, batch["tokens"].shape, np.int32)
  data = {"tokens": jax.device_put(tokens, sharding["tokens"])}
  ran = [c(trainer.init(0), data) for c in (compiled, loaded)]
  assert float(ran[0][1]["loss"]) == float(ran[1][1]["loss"])
  for a, b in zip(*(jax.tree_util.tree_leaves(r[0]["params"]) for r in ran)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  path = where / f"{key}.pkl"
  os.utime(path, (1e9, 1e9))
  assert executables.load(str(where), key, args, devs) is not None
  assert path.stat().st_mtime > time.time() - 600  # a load marks its entry used
  good = path.read_bytes()

  # Anything else is a miss, never an error: another key, other arguments; and with a note,
  # before anything is unpickled, an entry whose check fails: a step of lr 0 relabelled with
  # this key, one flipped bit, a cut-short file, an entry made with another secret.
  notes = []
  load = lambda: executables.load(str(where), key, args, devs, say=notes.append)
  assert executables.load(str(where), "0" * 64, args, devs, say=notes.append) is None
  assert executables.load(str(where), key, (trainer.abstract_state, bigger), devs) is None
  assert executables.load(str(where), key, (trainer.abstract_state, {"x": batch["tokens"]}),
                          devs) is None
  assert notes == []
  zero = loop.Trainer(config.override(cfg, train={"lr": 0.0}), trainer.mesh, trainer.model)
  zero_key = executables.fingerprint(zero, batch, sharding)
  assert executables.save(str(where), zero_key, executables.compile_fresh(zero.lower(batch)))
  relabelled = (where / f"{zero_key}.pkl").read_bytes().replace(zero_key.encode(), key.encode())
  flipped = bytearray(good)
  flipped[int(len(good) * 0.8)] ^= 0x10  # inside the executable: without a MAC it still loads
  for bad in (relabelled, bytes(flipped), good[:1000]):
    path.write_bytes(bad)
    assert load() is None
  assert len(notes) == 3 and all(f"the stored step {path} is not loaded" in n for n in notes)
  path.write_bytes(good)
  monkeypatch.setattr(executables, "_secret", b"another user's secret")
  assert load() is None and "MAC does not match" in notes[-1]
  assert sorted(p.name for p in where.iterdir()) == sorted([path.name, f"{zero_key}.pkl"])


def test_an_untrusted_cache_folder_is_refused_with_one_note(tmp_path, monkeypatch, capsys,
                                                            own_secret):
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  # Made by jaxpar, a folder is this user's alone, whatever the umask.
  made = tmp_path / "made" / "cache"
  umask = os.umask(0)
  try:
    assert cli.use_compile_cache(config.load(None, [f"train.compile_cache={made}"])) == str(made)
  finally:
    os.umask(umask)
  assert made.stat().st_mode & 0o777 == 0o700 and updates["jax_enable_compilation_cache"]
  assert capsys.readouterr().err == ""
  # In a trusted folder, a program others could have written (from when it was shared) goes.
  (made / "jit_step-cache").write_bytes(b"x")
  (made / "jit_step-cache").chmod(0o666)
  (made / "jit_init-cache").write_bytes(b"x")
  cli.use_compile_cache(config.load(None, [f"train.compile_cache={made}"]))
  assert [p.name for p in made.iterdir()] == ["jit_init-cache"]
  [note] = capsys.readouterr().err.splitlines()
  assert note.startswith(f"note: removed 1 file(s) of the compilation cache {made}")
  # One that its group may write is not used at all (JAX's programs there are run as found, as
  # stored steps are): one note naming it and the way out, and the run goes on without a cache.
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o770)
  updates.clear()
  assert cli.use_compile_cache(config.load(None, [f"train.compile_cache={shared}"])) is None
  assert updates == {"jax_enable_compilation_cache": False}
  [note] = capsys.readouterr().err.splitlines()
  assert note.startswith(f"note: the folder {shared} is writable by its group")
  assert f"chmod go-w {shared}" in note and "train.compile_cache" in note
  # A trusted cache with a store folder others may write (an older jaxpar made it under umask
  # 000): the store is not used, with one note; a load or a save there reads and writes nothing.
  store = tmp_path / "cache" / executables.FOLDER
  store.mkdir(parents=True, mode=0o700)
  store.chmod(0o777)
  (store / f"{'a' * 64}.pkl").write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
  notes = []
  assert executables.store_folder(str(store.parent), notes.append) is None
  assert executables.load(str(store), "a" * 64, (), [], say=notes.append) is None
  assert not (tmp_path / "ran").exists()
  assert len(notes) == 2 and all(f"the folder {store} is writable by its group and others" in n
                                 for n in notes)
  # A secret others may read proves nothing: no store, one note.
  store.chmod(0o700)
  assert executables.store_folder(str(store.parent), notes.append) == str(store)
  # Another user's folder, mode 0700, is theirs to plant in: not used (root gives it away; any
  # other user runs as someone else for a moment).
  me = os.getuid()
  with monkeypatch.context() as m:
    if me == 0:
      owner = 4242
      os.chown(store, owner, -1)
    else:
      owner, me = me, me + 1
      m.setattr(executables.os, "getuid", lambda: me)
    notes.clear()
    assert executables.store_folder(str(store.parent), notes.append) is None
    assert executables.load(str(store), "a" * 64, (), [], say=notes.append) is None
  assert not (tmp_path / "ran").exists()
  assert len(notes) == 2 and all(f"the folder {store} belongs to user id {owner}, not to this "
                                 f"user ({me})" in n for n in notes), notes
  os.chown(store, os.getuid(), -1)
  assert own_secret.stat().st_mode & 0o777 == 0o600
  own_secret.chmod(0o644)
  monkeypatch.setattr(executables, "_secret", None)
  notes.clear()
  assert executables.store_folder(str(store.parent), notes.append) is None
  assert len(notes) == 1 and f"chmod 600 {own_secret}" in notes[0]


def test_a_store_that_cannot_be_written_says_so_once(tmp_path, monkeypatch, own_secret):
  jitted = jax.jit(lambda x: x * 2.5)
  compiled = executables.compile_fresh(jitted.lower(np.ones(3, np.float32)))
  where = tmp_path / "store"

  class Full:  # a disk that fills as the entry is written
    def __init__(self, fd, mode):
      self.f = open(fd, mode)
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.f.close()
    def write(self, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(executables.os, "fdopen", Full)
  notes = []
  assert not executables.save(str(where), "b" * 64, compiled, say=notes.append)
  assert notes == [f"the step could not be kept in the step store {where} (No space left on "
                   f"device); the next run compiles it again"]
  assert list(where.iterdir()) == []  # nothing half-written


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
  cache.chmod(0o700)
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
