"""What every script shares: common flags, CPU device simulation, and one-sentence errors."""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import re
import signal
import sys
import tempfile
import traceback

from jaxpar import config as jconfig
from jaxpar import kinds
from jaxpar.config import ConfigError, RunError
from jaxpar.parallel import hostmem
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel.distributed import DistributedError
from jaxpar.train import preemption
from jaxpar.train.preemption import Interrupted, _interrupt  # noqa: F401 (guard's handler)


class Parser(argparse.ArgumentParser):
  """argparse with its errors as every other bad input: one line on stderr, exit code 2; a flag
  is spelled out in full (no prefix of a longer one: train's `--step 5` is not `--steps 5`, as
  export's and generate's `--step` names a checkpoint)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)

  def error(self, message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--mesh", default="1x1x1", metavar="DxMxP[xC]",
                 help="data x model x pipeline [x context], e.g. 2x4x1 or 2x2x1x2")
  p.add_argument("--config", help="YAML file of overrides (see configs/)")
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                 help="config overrides; later ones win (keys: docs/config.md)")
  add_print_config(p)
  p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_print_config(p: argparse.ArgumentParser) -> None:
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved config (defaults, --config, --set) as YAML and exit")


def print_config(cfg: jconfig.Config, mesh: str | None = None, workdir: str | None = None) -> int:
  """The config a run would use, as YAML a --config file takes back, after comment lines with
  what the command line adds to it (the mesh and its devices, the workdir); exit code 0."""
  import yaml  # a dependency of config.py already; here only for the dump
  if mesh is not None:
    shape = jmesh.parse(mesh)
    axes = ", ".join(f"{a}={n}" for a, n in zip(jmesh.AXES, shape))
    print(f"# mesh: {jmesh.spec_str(shape)} ({math.prod(shape)} devices: {axes})")
  if workdir is not None:
    print(f"# workdir: {os.path.abspath(workdir)}")
  print(yaml.safe_dump(jconfig.to_dict(cfg), sort_keys=False), end="")
  return 0


def hf_model_keys(folder: str) -> dict:
  """The model keys of a Hugging Face folder (`model.init_from`), for `config.load(base=...)`."""
  from jaxpar.interop import hf  # only init_from reads a folder; hf brings orbax and generation
  return hf.model_overrides(folder)


def data_keys(cfg: jconfig.Config) -> dict:
  """Keys that follow from the data, for `config.load(follow=...)`: with data.source=images,
  model.num_classes is the class count of data.path (what the file or --set gives still wins)."""
  if cfg.data.source != "images":
    return {}
  from jaxpar.data import local_images  # imports TFDS: only for images
  return {"model.num_classes": len(local_images.class_names(cfg.data.path))}


def setup(args, processes: int = 1) -> tuple[jconfig.Config, tuple[int, ...]]:
  """Parses mesh and config, then (before JAX starts) simulates this process's share of devices
  and sets the host malloc for that count (jaxpar.parallel.hostmem)."""
  shape = jmesh.parse(args.mesh)
  cfg = kinds.check(jconfig.load(args.config, args.set, base=hf_model_keys,
                                 follow=data_keys))
  n = math.prod(shape)
  jmesh.check(shape, cfg, n)  # the degrees against the model: a refusal comes alone, first
  if n % processes:
    raise ConfigError(f"mesh {args.mesh} has {n} devices, which do not split evenly over "
                      f"{processes} processes")
  local = n // processes
  if local > 1 and jmesh.ensure_cpu_devices(local):
    each = f" in each of {processes} processes" if processes > 1 else ""
    print(f"jaxpar: simulating {local} CPU devices{each} for mesh {args.mesh} "
          f"(XLA_FLAGS=--xla_force_host_platform_device_count={local})", file=sys.stderr)
  hostmem.configure(local)  # one CPU device: keep XLA's freed temporaries (parallel/hostmem.py)
  use_compile_cache(cfg)
  return cfg, shape


CACHE_OFF = "off"
ENV_COMPILE_CACHE = "JAXPAR_COMPILE_CACHE"  # the default of train.compile_cache


_ACCELERATOR_PLUGIN = re.compile(r"jax[-_](cuda|rocm)\d*[-_](plugin|pjrt)|libtpu.*", re.IGNORECASE)


def _cpu_only(environ) -> bool:
  """Whether JAX will run on the CPU, judged without starting a backend (that must wait for
  jax.distributed): JAX_PLATFORMS names cpu first, or no accelerator plugin is installed."""
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() == "cpu"
  return not any(_ACCELERATOR_PLUGIN.fullmatch(d.metadata["Name"] or "")
                 for d in importlib.metadata.distributions())


def cpu_reload_unsound(cfg: jconfig.Config) -> str | None:
  """Why XLA:CPU must not reload this run's step from a cache, or None.

  XLA:CPU's reload of a cached executable is not sound for every program: with JAX 0.10.2 a
  circular-schedule ZeRO-3 step loaded from the cache aborts (`Unexpected number of
  participants: all gather`) or segfaults in a fresh process, where compiling it afresh runs; the
  circular schedule at ZeRO-1, GPipe and 1F1B at ZeRO-3 and the plain layouts reload fine (ZeRO-2
  under the circular schedule was not tried: it keeps its cache).
  """
  if cfg.parallel.schedule == "circular" and cfg.parallel.zero_stage == 3:
    return "XLA:CPU crashes reloading a cached circular-schedule ZeRO-3 step"
  return None


def compile_cache_dir(cfg: jconfig.Config, environ=None) -> str | None:
  """The folder of the persistent compilation cache train.compile_cache asks for; None when off.

  The key names a folder or 'off'; else JAX_ENABLE_COMPILATION_CACHE=false turns it off, and
  JAX_COMPILATION_CACHE_DIR, then JAXPAR_COMPILE_CACHE, then ~/.cache/jaxpar/xla name it. On the
  CPU a layout whose reload is not sound (`cpu_reload_unsound`) gets none, whatever is named."""
  environ = os.environ if environ is None else environ
  value = cfg.train.compile_cache
  if value == CACHE_OFF:
    return None
  if _cpu_only(environ) and cpu_reload_unsound(cfg):
    return None
  if value:
    return os.path.abspath(os.path.expanduser(value))
  if environ.get("JAX_ENABLE_COMPILATION_CACHE", "").strip().lower() in ("0", "false", "no", "off"):
    return None  # JAX's own switch, turned off by the caller
  if environ.get("JAX_COMPILATION_CACHE_DIR"):  # a caller's (the test session's) own cache
    return environ["JAX_COMPILATION_CACHE_DIR"]
  if environ.get(ENV_COMPILE_CACHE):  # a site-wide default, e.g. a shared filesystem's folder
    value = environ[ENV_COMPILE_CACHE]
    return None if value == CACHE_OFF else os.path.abspath(os.path.expanduser(value))
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxpar", "xla")


def use_compile_cache(cfg: jconfig.Config) -> str | None:
  """Turns JAX's persistent compilation cache on in the folder of train.compile_cache (or off);
  returns the folder. Must run before the first compile, and is what train.py and plan.py share,
  so `plan.py --mesh X` then `train.py --mesh X` compiles the step once.

  A hit is always the same executable: JAX's cache key hashes the program (its shardings and
  device count included), the jaxlib version, the backend's platform and version, the XLA flags
  (the simulated device count among them), the compile options with the device assignment and
  the devices' topology. A cache written by another version or for another topology is never
  read, only missed; so nothing needs clearing when either changes.

  The folder is the user's; jaxpar writes only into its own subfolders there, `jax` (JAX's
  programs, each sealed as the stored steps are: cache_folder.SealedPrograms) and `jaxpar-steps`
  (the step store), and removes nothing else (cache_folder.py). A path another user could change,
  a subfolder that is not this user's alone, or no usable secret turns both off, with one note;
  the run goes on and compiles.
  """
  path = compile_cache_dir(cfg)
  # Imported here: launch_local.py imports this module and must not wait for JAX to load.
  import jax
  why = cpu_reload_unsound(cfg) if _cpu_only(os.environ) else None
  if why and cfg.train.compile_cache != CACHE_OFF:
    print(f"note: no compilation cache for this run ({why}); the step compiles afresh",
          file=sys.stderr)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  from jaxpar.train import cache_folder  # lazy: importing it loads JAX (see above)
  off = "no compilation cache, no step store"
  bad = cache_folder.unsafe_path(path)  # before anything is made there
  if bad:
    cache_folder.note(cache_folder.refusal(*bad, off))
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  try:
    cache_folder.make_folder(path)
  except OSError as e:
    raise ConfigError(f"train.compile_cache={path} cannot be made ({e.strerror}); name a "
                      f"writable folder or 'off'") from None
  programs = cache_folder.open_folder(path, cache_folder.JAX_FOLDER, cache_folder.note, off)
  try:
    if programs is not None:
      cache_folder.secret()  # every program read is checked against it: none, no cache
  except (OSError, ValueError) as e:
    cache_folder.note(f"{off}: {e}")
    programs = None
  if programs is not None and not cache_folder.install(path,
                                                       cache_folder.SealedPrograms(programs)):
    cache_folder.note(f"{off}: this JAX builds its file cache otherwise than jaxpar knows "
                      f"(jax._src.compilation_cache.get_file_cache), so JAX's programs could "
                      f"not be checked")
    programs = None
  if programs is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  # XLA's own caches beside JAX's (the GPU autotuning results) would be files read unchecked
  jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  # JAX keeps only programs that took at least 1 s to compile; the init and the small helper
  # programs of a run take less each but add up on a restart, so every one is kept unless the
  # environment says otherwise.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  bound = cache_max_bytes(cfg)
  if bound > 0:
    programs.prune(bound, cache_folder.PROGRAM_MAGIC, cache_folder.PROGRAM_SUFFIX)
  return path


def cache_max_bytes(cfg: jconfig.Config) -> int:
  """The bound train.compile_cache_max_gb puts on JAX's programs in the cache folder, in bytes,
  which `use_compile_cache` keeps as each run starts; 0 for none. JAX's own eviction
  (JAX_COMPILATION_CACHE_MAX_SIZE) is not used: jaxpar keeps JAX's programs itself."""
  return jconfig.compile_cache_max_bytes(cfg)


def check_outputs(*outputs: tuple[str, str | None, str]) -> None:
  """(flag, path, "folder" or "file") for each output a script will write: a path taken by the
  other kind, or one that runs through a file, is bad input, refused before any work (missing
  folders are made)."""
  for flag, path, kind in outputs:
    if not path:
      continue
    if os.path.exists(path) and os.path.isdir(path) != (kind == "folder"):
      other = "file" if kind == "folder" else "folder"
      raise ConfigError(f"{flag} {path} is a {other}; it must be a {kind} (made if missing)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
      raise ConfigError(f"{flag} {path} cannot be made: {parent} is a file")
    _check_writable(flag, path, kind, parent)


def _check_writable(flag: str, path: str, kind: str, parent: str) -> None:
  """Tries what the script will do (make an entry in the folder, append to the file) where it is
  harmless: a scratch entry, removed at once, in the folder itself or its nearest existing one."""
  where = path if kind == "folder" and os.path.isdir(path) else parent
  try:
    if kind == "file" and os.path.isfile(path):
      open(path, "a").close()  # appends nothing
    else:
      os.rmdir(tempfile.mkdtemp(prefix=".jaxpar-check-", dir=where))
  except OSError as e:
    raise ConfigError(f"{flag} {path} cannot be written: {e.strerror} in {where}") from None


def guard(body, debug: bool, exit_on_signal: bool = False) -> int:
  """Runs body(); bad input becomes one line on stderr and exit code 2; SIGINT or SIGTERM
  (outside the training loop, which handles them itself) one line and 128 + the signal.

  `exit_on_signal` (the scripts): after a signal the process ends there, without the
  interpreter's teardown, which could crash (exit 139) freeing a compile the signal cut short;
  before the training loop nothing is left to finish on disk. So does a RunError (exit 1).
  """
  old = {}
  for sig in (signal.SIGINT, signal.SIGTERM):
    try:
      old[sig] = signal.signal(sig, _interrupt)
    except ValueError:  # not the main thread: leave signals alone
      pass
  try:
    return body()
  except Interrupted as e:
    if debug:
      traceback.print_exc()
    print(f"error: stopped by {e.signal.name}; what was complete on disk is kept (a checkpoint "
          f"is only ever complete or absent)", file=sys.stderr)
    if exit_on_signal:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(128 + int(e.signal))
    return 128 + int(e.signal)
  except ConfigError as e:
    if debug:
      traceback.print_exc()
    print(f"error: {e}", file=sys.stderr)
    return 2
  except (FloatingPointError, DistributedError, RunError) as e:
    if debug:
      traceback.print_exc()
    print(f"error: {e}", file=sys.stderr)
    if exit_on_signal and isinstance(e, RunError):  # orbax's threads would still print as the
      sys.stdout.flush()                            # interpreter tears down
      sys.stderr.flush()
      os._exit(1)
    return 1
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)
    preemption.forget_interrupts()
