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
from jaxpar.train import cache_folder, executables, loop
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


OTHER_UID = 12345  # another user's files (the tests run as root, so chown works)


def plant_user_files(*folders):
  """A user's files in each folder, as the attack left them: one written under umask 002 (0664),
  one 0666, one of another user; in a subfolder of jaxpar's also one named as an entry is
  (of another user). Returns {path: (bytes, mode, uid)}."""
  planted = {}
  umask = os.umask(0o002)
  try:
    for folder in folders:
      for name, mode, uid in (("results.csv", None, None), ("notes.txt", 0o666, None),
                              ("theirs.bin", 0o644, OTHER_UID)):
        path = folder / name
        path.write_bytes(b"a user's data " + name.encode())
        if mode is not None:
          path.chmod(mode)
        if uid is not None:
          os.chown(path, uid, uid)
      suffix = {executables.FOLDER: executables.SUFFIX,
                cache_folder.JAX_FOLDER: cache_folder.PROGRAM_SUFFIX}.get(folder.name)
      if suffix:
        entry = folder / f"{'e' * 64}{suffix}"
        entry.write_bytes(b"another user's")
        os.chown(entry, OTHER_UID, OTHER_UID)
  finally:
    os.umask(umask)
  for path in [p for folder in folders for p in folder.iterdir() if p.is_file()]:
    if path.read_bytes().startswith((b"a user's", b"another user's")):
      st = path.stat()
      planted[path] = (path.read_bytes(), st.st_mode & 0o777, st.st_uid)
  assert {m for _, m, _ in planted.values()} >= {0o664, 0o666} and len(planted) >= 3 * len(folders)
  return planted


def assert_untouched(planted):
  for path, (data, mode, uid) in planted.items():
    st = path.stat()
    assert (path.read_bytes(), st.st_mode & 0o777, st.st_uid) == (data, mode, uid), path


def store_run(args, secret):
  """run(args) with the step store's secret in `secret` (never the user's own)."""
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180,
                        env={**child_env(), executables.ENV_SECRET: str(secret)}, cwd=ROOT)


def test_plan_stores_the_step_train_loads_it_and_a_planted_entry_is_never_unpickled(tmp_path):
  cache, secret = tmp_path / "cache", tmp_path / "config" / "secret"
  common = ["--set", *TINY, f"train.compile_cache={cache}"]
  r = store_run([PLAN, "--mesh", "1x1x1", "--json", *common], secret)
  assert r.returncode == 0, r.stderr
  # plan.py kept the step it compiled, under the key train.py looks up (on one device too,
  # where plan.py once set XLA's device count and train.py not); the folders are this user's
  # alone, the entry and the secret readable by this user only.
  store, programs = cache / "jaxpar-steps", cache / "jax"
  [entry] = store.glob("*.pkl")
  for path, mode in ((cache, 0o700), (store, 0o700), (programs, 0o700), (entry, 0o600),
                     (secret, 0o600)):
    assert path.stat().st_mode & 0o777 == mode, path
  assert entry.read_bytes().startswith(executables.MAGIC)

  # train.py loads it without tracing, though train.log_every and checkpoint.every differ from
  # plan.py's: neither enters the step.
  m, wd = tmp_path / "m.jsonl", tmp_path / "wd"
  two = [TRAIN, "--mesh", "1x1x1", "--workdir", str(wd), "--metrics-file", str(m),
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
  r = store_run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd1"), "--no-progress",
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
  # programs the earlier runs left in JAX's cache (0.1 MiB: the steps are not there) are cut to
  # the bound as it starts. The user's files beside them are left as they are (one note each
  # folder): jaxpar removes only what it wrote.
  kept, bound = list(store.glob("*.pkl")), int(0.00005 * 2**30)
  before = {p: (p.stat().st_size, p.stat().st_ino) for p in programs.glob("*.xla")}
  assert sum(size for size, _ in before.values()) > bound
  planted = plant_user_files(cache, store, programs)
  r = store_run([TRAIN, "--mesh", "1x1x1", "--workdir", str(tmp_path / "wd2"), "--no-progress",
                 *common, "train.lr=0.5", "train.compile_cache_max_gb=0.00005"], secret)
  assert r.returncode == 0, r.stderr
  steps = set(store.glob("*.pkl")) - set(planted)
  assert len(steps) == 1 and not steps & set(kept)
  left = [size for p, (size, inode) in before.items()  # kept, not written again by this run
          if p.exists() and p.stat().st_ino == inode]
  assert left and sum(left) <= bound
  assert_untouched(planted)
  for folder in (programs, store):
    assert f"4 file(s) in {folder} were not written by jaxpar" in r.stderr, r.stderr


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
  """The step store's secret in a fresh file of this test's; the folders opened, closed after."""
  monkeypatch.setenv(executables.ENV_SECRET, str(tmp_path / "secret"))
  monkeypatch.setattr(cache_folder, "_secret", None)
  yield tmp_path / "secret"
  cache_folder.forget()


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
  with monkeypatch.context() as m:  # plan.py and train.py set XLA's device count apart: the
    flags = os.environ["XLA_FLAGS"]   # devices the step runs on are keyed themselves
    assert "--xla_force_host_platform_device_count=8" in flags
    for count in ("", "--xla_force_host_platform_device_count=2"):
      m.setenv("XLA_FLAGS", flags.replace("--xla_force_host_platform_device_count=8", count))
      assert executables.fingerprint(trainer, batch, sharding) == key
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
             "train.peer_timeout": 30.0,
             "train.compile_cache": "/elsewhere", "train.compile_cache_max_gb": 1.0,
             "model.init_from": "/a/model", "data.source": "local_text", "data.name": "x",
             "data.split": "test", "data.data_dir": "/d", "data.path": "/p",
             "data.max_bytes": 5, "data.eval_split": "test", "data.augment": True,
             "data.tokenizer": "/t.json", "data.workers": 0, "data.image_size": "8x8",
             "data.long_records": "split", "data.packing": "stream", "data.lock_timeout": 10.0,
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
  store = executables.store_folder(str(tmp_path / "cache"))
  where = pathlib.Path(store.path)
  assert executables.save(store, key, compiled)
  assert where.stat().st_mode & 0o777 == 0o700 and own_secret.stat().st_mode & 0o777 == 0o600
  args, devs = (trainer.abstract_state, batch), list(trainer.mesh.devices.flat)
  loaded = executables.load(store, key, args, devs)
  tokens = np.random.default_rng(0).integers(0, 256, batch["tokens"].shape, np.int32)
  data = {"tokens": jax.device_put(tokens, sharding["tokens"])}
  ran = [c(trainer.init(0), data) for c in (compiled, loaded)]
  assert float(ran[0][1]["loss"]) == float(ran[1][1]["loss"])
  for a, b in zip(*(jax.tree_util.tree_leaves(r[0]["params"]) for r in ran)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  path = where / f"{key}.pkl"
  os.utime(path, (1e9, 1e9))
  assert executables.load(store, key, args, devs) is not None
  assert path.stat().st_mtime > time.time() - 600  # a load marks its entry used
  good = path.read_bytes()

  # Anything else is a miss, never an error: another key, other arguments; and with a note,
  # before anything is unpickled, an entry whose check fails: a step of lr 0 relabelled with
  # this key, one flipped bit, a cut-short file, an entry made with another secret.
  notes = []
  load = lambda: executables.load(store, key, args, devs, say=notes.append)
  assert executables.load(store, "0" * 64, args, devs, say=notes.append) is None
  assert executables.load(store, key, (trainer.abstract_state, bigger), devs) is None
  assert executables.load(store, key, (trainer.abstract_state, {"x": batch["tokens"]}),
                          devs) is None
  assert notes == []
  zero = loop.Trainer(config.override(cfg, train={"lr": 0.0}), trainer.mesh, trainer.model)
  zero_key = executables.fingerprint(zero, batch, sharding)
  assert executables.save(store, zero_key, executables.compile_fresh(zero.lower(batch)))
  relabelled = (where / f"{zero_key}.pkl").read_bytes().replace(zero_key.encode(), key.encode())
  flipped = bytearray(good)
  flipped[int(len(good) * 0.8)] ^= 0x10  # inside the executable: without a MAC it still loads
  for bad in (relabelled, bytes(flipped), good[:1000]):
    path.write_bytes(bad)
    assert load() is None
  assert len(notes) == 3 and all(f"the stored step {path} is not loaded" in n for n in notes)
  path.write_bytes(good)
  monkeypatch.setattr(cache_folder, "_secret", b"another user's secret")
  assert load() is None and "MAC does not match" in notes[-1]
  assert sorted(p.name for p in where.iterdir()) == sorted([path.name, f"{zero_key}.pkl"])


def cache_cfg(folder, *more):
  return config.load(None, [f"train.compile_cache={folder}", *more])


def test_jaxpar_removes_only_what_it_wrote_and_keeps_its_subfolders_private(
    tmp_path, monkeypatch, capsys, own_secret):
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  # Made by jaxpar, a folder and each missing one above it are this user's alone, whatever the
  # umask; so are jaxpar's subfolders in it.
  made = tmp_path / "made" / "cache"
  umask = os.umask(0)
  try:
    assert cli.use_compile_cache(cache_cfg(made)) == str(made)
  finally:
    os.umask(umask)
  for path in (made.parent, made, made / cache_folder.JAX_FOLDER):
    assert path.stat().st_mode & 0o777 == 0o700, path
  assert updates["jax_enable_compilation_cache"]
  assert updates["jax_compilation_cache_dir"] == str(made)
  assert updates["jax_persistent_cache_enable_xla_caches"] == "none"  # XLA's: read unchecked
  assert capsys.readouterr().err == ""
  # A user's own folder (0755) with the user's files in it, written under umask 002, one 0666,
  # one of another user; and the same in jaxpar's subfolders, with one named as an entry is.
  # jaxpar's subfolders are made 0700; the folder keeps its mode; JAX's programs and the stored
  # steps are written 0600 whatever the umask, so the next start keeps them.
  mine = tmp_path / "mine"
  mine.mkdir()
  mine.chmod(0o755)
  umask = os.umask(0o002)
  try:
    cli.use_compile_cache(cache_cfg(mine))
    store = executables.store_folder(str(mine))
    programs = cache_folder.open_folder(str(mine), cache_folder.JAX_FOLDER)
    cache_folder.SealedPrograms(programs).put("jit_old-0", b"an old program")
    cache_folder.SealedPrograms(programs).put("jit_new-1", b"a new program")
    compiled = executables.compile_fresh(jax.jit(lambda x: x * 2.5).lower(np.ones(3, np.float32)))
    assert executables.save(store, "c" * 64, compiled)
  finally:
    os.umask(umask)
  folders = (mine, mine / cache_folder.JAX_FOLDER, mine / executables.FOLDER)
  assert [f.stat().st_mode & 0o777 for f in folders] == [0o755, 0o700, 0o700]
  ours = [p for f in folders[1:] for p in f.iterdir()]
  assert len(ours) == 3 and all(p.stat().st_mode & 0o777 == 0o600 for p in ours)
  old = programs.path + "/" + cache_folder.SealedPrograms.name("jit_old-0") + ".xla"
  os.utime(old, (1e9, 1e9))
  planted = plant_user_files(*folders)
  old_layout = mine / "jit_step-abc-cache"  # where an earlier jaxpar let JAX keep its programs
  old_layout.write_bytes(b"a program kept before")
  old_layout.chmod(0o664)
  planted[old_layout] = (old_layout.read_bytes(), 0o664, os.getuid())
  capsys.readouterr()
  # Bounds below what is there: the least recently used program goes as a run starts, the other
  # stored step as a step is kept; nothing of the user's goes, whatever its mode or owner (one
  # note in each subfolder: left as it is, never read).
  assert cli.use_compile_cache(cache_cfg(mine, "train.compile_cache_max_gb=1.5e-7")) == str(mine)
  notes = []
  assert executables.save(store, "d" * 64, compiled, max_bytes=1, say=notes.append)
  assert_untouched(planted)
  assert not os.path.exists(old) and len(list(folders[1].glob("*.xla"))) == 2  # new + planted
  assert sorted(p.name for p in folders[2].glob("*.pkl")) == [f"{'d' * 64}.pkl", f"{'e' * 64}.pkl"]
  [started] = capsys.readouterr().err.splitlines()
  for note, folder in ((started, folders[1]), (notes[0], folders[2])):
    assert f"4 file(s) in {folder} were not written by jaxpar" in note, note


def test_a_cache_path_others_could_change_or_a_bad_secret_turns_the_cache_off_with_one_note(
    tmp_path, monkeypatch, capsys, own_secret):
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  # A folder its group may write, or one under a folder anyone may write (no sticky bit), is not
  # used at all (JAX's programs and the steps there would be run as found): one note naming the
  # folder and the way out, and the run goes on without a cache.
  shared, open_parent = tmp_path / "shared", tmp_path / "open"
  for folder, mode in ((shared, 0o770), (open_parent, 0o777)):
    folder.mkdir()
    folder.chmod(mode)
  for cache, named, who in ((shared, shared, "its group"),
                            (open_parent / "cache", open_parent, "its group and others")):
    updates.clear()
    assert cli.use_compile_cache(cache_cfg(cache)) is None
    assert updates == {"jax_enable_compilation_cache": False}
    [note] = capsys.readouterr().err.splitlines()
    assert note.startswith(f"note: the folder {named} is writable by {who}"), note
    assert f"chmod go-w {named}" in note and "no compilation cache, no step store" in note
  assert not (open_parent / "cache" / cache_folder.JAX_FOLDER).exists()
  # A JAX that builds its file cache otherwise: no cache (its programs could not be checked).
  from jax._src import compilation_cache as jcc
  with monkeypatch.context() as m:
    m.delattr(jcc, "get_file_cache")
    updates.clear()
    assert cli.use_compile_cache(cache_cfg(tmp_path / "elsewhere")) is None
    assert updates == {"jax_enable_compilation_cache": False}
    [note] = capsys.readouterr().err.splitlines()
    assert note.startswith("note: no compilation cache, no step store: this JAX builds its file")
  # Under a folder anyone may write but with the sticky bit (/tmp), others cannot move it: used.
  sticky = tmp_path / "sticky"
  sticky.mkdir()
  sticky.chmod(0o1777)
  assert cli.use_compile_cache(cache_cfg(sticky / "cache")) == str(sticky / "cache")
  # A store folder that became writable by others after it was opened: a load or a save there
  # reads and writes nothing, with a note.
  store = executables.store_folder(str(tmp_path / "cache"))
  os.chmod(store.path, 0o777)
  planted = pathlib.Path(store.path) / f"{'a' * 64}.pkl"
  planted.write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
  notes = []
  assert executables.load(store, "a" * 64, (), [], say=notes.append) is None
  assert not (tmp_path / "ran").exists()
  assert len(notes) == 1
  assert f"the folder {store.path} is writable by its group and others" in notes[0]
  # Another user's subfolder, mode 0700, is theirs to plant in: not used, whether met as the
  # store is opened or after (root gives it away; any other user runs as someone else a moment).
  os.chmod(store.path, 0o700)
  theirs = tmp_path / "theirs" / executables.FOLDER
  theirs.mkdir(parents=True, mode=0o700)
  me = os.getuid()
  with monkeypatch.context() as m:
    if me == 0:
      owner = 4242
      for folder in (store.path, theirs):
        os.chown(folder, owner, -1)
    else:
      owner, me = me, me + 1
      m.setattr(cache_folder, "_uid", lambda: me)
    notes.clear()
    assert executables.store_folder(str(theirs.parent), notes.append) is None
    assert executables.load(store, "a" * 64, (), [], say=notes.append) is None
  assert len(notes) == 2 and all(f"belongs to user id {owner}, not to this user ({me})" in n
                                 for n in notes), notes
  assert notes[1].startswith(f"the folder {store.path} belongs")
  os.chown(store.path, os.getuid(), -1)
  # A secret others may read proves nothing: no cache at all, JAX's programs no more than the
  # steps (JAX's carry no check of their own), one note.
  capsys.readouterr()
  own_secret.chmod(0o644)
  monkeypatch.setattr(cache_folder, "_secret", None)
  updates.clear()
  assert cli.use_compile_cache(cache_cfg(tmp_path / "other")) is None
  assert updates == {"jax_enable_compilation_cache": False}
  [note] = capsys.readouterr().err.splitlines()
  assert "no compilation cache, no step store" in note and f"chmod 600 {own_secret}" in note


def test_a_secret_that_is_not_a_regular_file_is_one_note_never_a_wait(tmp_path, monkeypatch):
  fifo, folder = tmp_path / "fifo", tmp_path / "folder"
  os.mkfifo(fifo, 0o600)
  folder.mkdir(mode=0o700)
  for path, kind in ((fifo, "FIFO"), ("/dev/null", "character device"), (folder, "folder")):
    monkeypatch.setenv(executables.ENV_SECRET, str(path))
    monkeypatch.setattr(cache_folder, "_secret", None)
    notes = []
    asked = threading.Thread(target=executables.store_folder,
                             args=(str(tmp_path / "cache"), notes.append), daemon=True)
    asked.start()
    asked.join(timeout=20)  # a FIFO without a writer would block its reader forever
    assert not asked.is_alive(), f"a secret at {path} hangs"
    default = cache_folder.secret_path({**os.environ, executables.ENV_SECRET: ""})
    assert notes == [f"no step store: the step store's secret {path} is a {kind}, not a regular "
                     f"file: set {executables.ENV_SECRET} to a file of your own (mode 600), or "
                     f"unset it and one is made in {default}"]
  cache_folder.forget()


def test_entries_are_read_and_written_through_the_folder_checked_not_a_path_repointed_since(
    tmp_path, own_secret):
  real, theirs, link = tmp_path / "real", tmp_path / "theirs", tmp_path / "link"
  real.mkdir(mode=0o700)
  (theirs / executables.FOLDER).mkdir(parents=True, mode=0o700)
  link.symlink_to(real)
  store = executables.store_folder(str(link))  # checked, and held open
  assert store.path == str(link / executables.FOLDER)
  # Repointed mid-run (by anyone who could: here the user), the link leads elsewhere; the run's
  # writes and reads stay in the folder it checked.
  link.unlink()
  link.symlink_to(theirs)
  key = "f" * 64
  planted = theirs / executables.FOLDER / f"{key}.pkl"
  planted.write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
  compiled = executables.compile_fresh(jax.jit(lambda x: x * 2.5).lower(np.ones(3, np.float32)))
  assert executables.save(store, key, compiled)
  assert (real / executables.FOLDER / f"{key}.pkl").exists()
  assert planted.read_bytes() == pickle.dumps(Planted(tmp_path / "ran"))
  args = (jax.ShapeDtypeStruct((3,), np.float32),)
  loaded = executables.load(store, key, args, jax.devices()[:1])
  assert loaded is not None and not (tmp_path / "ran").exists()
  np.testing.assert_array_equal(np.asarray(loaded(np.ones(3, np.float32))), np.full(3, 2.5))


@pytest.fixture
def real_cache(monkeypatch, own_secret):
  """JAX's persistent cache as a run sets it (cli.use_compile_cache), the session's back after."""
  from jax.experimental.compilation_cache import compilation_cache
  names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_enable_xla_caches")
  before = {n: getattr(jax.config, n) for n in names}
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  jax.clear_caches()


def test_jax_programs_are_checked_as_the_stored_steps_are(tmp_path, real_cache, capsys):
  from jaxpar.train import metrics
  cache = tmp_path / "cache"
  x = jax.device_put(np.ones(5, np.float32))  # no program compiled for it
  files = lambda: {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
  umask = os.umask(0o002)
  try:
    assert cli.use_compile_cache(cache_cfg(cache)) == str(cache)
    step = jax.jit(lambda v: v * 2.0 + 1.0)
    frozen = jax.jit(lambda v: v * 0.0 + 1.0)  # another step's program: lr 0, say
    written = []
    for f in (step, frozen):
      before = files()
      f(x).block_until_ready()
      [new] = set(files()) - set(before)
      written.append(new)
    # Written 0600 whatever the umask, the programs stay as the next run starts.
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in written)
    capsys.readouterr()
    assert cli.use_compile_cache(cache_cfg(cache)) == str(cache)
    assert all(p.exists() for p in written) and capsys.readouterr().err == ""
    # Unchanged, a program is a hit; another program moved under its name is a miss with one
    # note, and the step computes its own numbers.
    jax.clear_caches()
    with metrics.compile_watch() as hit:
      np.testing.assert_array_equal(np.asarray(step(x)), np.full(5, 3.0))
    assert hit["compile_cache"] == "hit"
    written[0].write_bytes(written[1].read_bytes())
    jax.clear_caches()
    with metrics.compile_watch() as swapped:
      np.testing.assert_array_equal(np.asarray(step(x)), np.full(5, 3.0))
    assert swapped["compile_cache"] == "miss"
  finally:
    os.umask(umask)
  [note] = capsys.readouterr().err.splitlines()
  assert note.startswith(f"note: the compiled program {written[0]} (")
  assert "labelled with another key" in note


def test_a_store_that_cannot_be_written_says_so_once(tmp_path, monkeypatch, own_secret):
  jitted = jax.jit(lambda x: x * 2.5)
  compiled = executables.compile_fresh(jitted.lower(np.ones(3, np.float32)))
  store = executables.store_folder(str(tmp_path))
  where = pathlib.Path(store.path)

  class Full:  # a disk that fills as the entry is written
    def __init__(self, fd, mode):
      self.f = open(fd, mode)
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.f.close()
    def write(self, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(cache_folder.os, "fdopen", Full)
  notes = []
  assert not executables.save(store, "b" * 64, compiled, say=notes.append)
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
    tmp_path, monkeypatch, own_secret):
  store = executables.store_folder(str(tmp_path / "cache"))
  where = pathlib.Path(store.path)
  now = time.time()
  header = len(executables.MAGIC) + 64 + 32
  for i, (key, size) in enumerate((("a", 400), ("b", 300), ("c", 200), ("d", 100))):
    store.write(f"{key * 64}.pkl", cache_folder.seal(executables.MAGIC, key * 64,
                                                      b"x" * (size - header)))
    os.utime(where / f"{key * 64}.pkl", (now - 1000 + i, now - 1000 + i))  # a: least recent
  (where / f".{'d' * 64}.pkl.left.tmp").write_bytes(b"x")  # a save killed two days ago
  os.utime(where / f".{'d' * 64}.pkl.left.tmp", (now - 2 * 86400, now - 2 * 86400))
  (where / f".{'c' * 64}.pkl.now.tmp").write_bytes(b"x")  # and one under way
  prune = lambda bound, keep=None: [k[0] for k in store.prune(
      bound, executables.MAGIC, executables.SUFFIX, keep=keep and keep * 64)]
  assert prune(500) == ["a", "b"]  # 1000 -> 300: the oldest go first
  names = lambda: sorted(p.name[:3] for p in where.iterdir())
  assert names() == [".cc", "ccc", "ddd"]
  os.utime(where / f"{'d' * 64}.pkl", (now - 5000, now - 5000))  # d least recently used, but kept
  assert prune(50, keep="d") == ["c"]
  assert prune(50, keep="d") == []  # d alone is over the bound: stays
  assert names() == [".cc", "ddd"]
  # Two processes pruning at once: an entry the other took first counts as gone, so no more go.
  for key in ("e", "f", "g"):
    store.write(f"{key * 64}.pkl", cache_folder.seal(executables.MAGIC, key * 64,
                                                      b"x" * (100 - header)))
  real_unlink = os.unlink
  def raced(path, *, dir_fd=None):
    real_unlink(path, dir_fd=dir_fd)
    if path.startswith("e"):
      raise FileNotFoundError(path)
  monkeypatch.setattr(os, "unlink", raced)
  assert prune(250) == ["d"]  # then e went (the other's): enough
  monkeypatch.setattr(os, "unlink", real_unlink)
  assert names() == [".cc", "fff", "ggg"]

  # JAX's programs: train.compile_cache_max_gb (10 GiB by default) bounds them too, kept as a run
  # starts (JAX's own eviction is never turned on: jaxpar keeps them), unless 0.
  cfg = config.load(None, [])
  assert cfg.train.compile_cache_max_gb == 10.0
  assert cli.cache_max_bytes(cfg) == 10 * 2**30
  assert cli.cache_max_bytes(config.load(None, ["train.compile_cache_max_gb=0.5"])) == 2**29
  assert cli.cache_max_bytes(config.load(None, ["train.compile_cache_max_gb=0"])) == 0
  with pytest.raises(config.ConfigError, match="must not be negative"):
    config.load(None, ["train.compile_cache_max_gb=-1"])
  cache = tmp_path / "cache"
  programs = cache_folder.SealedPrograms(cache_folder.open_folder(str(cache),
                                                                  cache_folder.JAX_FOLDER))
  for i, key in enumerate(("jit_old", "jit_new")):
    programs.put(key, b"x" * 600)
    path = cache / cache_folder.JAX_FOLDER / (programs.name(key) + cache_folder.PROGRAM_SUFFIX)
    os.utime(path, (now - 100 + i, now - 100 + i))
  updates = {}
  monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", "99")
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  cli.use_compile_cache(config.load(None, [f"train.compile_cache={cache}",
                                           "train.compile_cache_max_gb=1e-6"]))  # 1073 bytes
  assert updates["jax_compilation_cache_dir"] == str(cache)
  assert "jax_compilation_cache_max_size" not in updates  # JAX's eviction stays off
  assert programs.get("jit_old") is None and programs.get("jit_new") == b"x" * 600
