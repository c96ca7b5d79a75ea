"""Runs N processes of one program on this machine, joined on 127.0.0.1, each with its own devices.

  jaxpar-launch --processes 2 [--devices-per-process 4] -- jaxpar-train --mesh 2x4x1 ...
  python scripts/launch_local.py --processes 2 -- scripts/train.py --mesh 2x4x1 ...  (a checkout)

Every output line, and every redraw of a progress bar's line, is prefixed with its process's rank.
When a process fails, the others are stopped (SIGTERM, then SIGKILL after --grace seconds) and the
launcher exits with the first failure's code.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar.commands.cli import Parser  # one-line errors; starts no JAX backend

ENV_COORDINATOR = "JAXPAR_COORDINATOR"  # the names jaxpar.parallel.distributed reads
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def mesh_devices(command: list[str]) -> int | None:
  """Devices of the `--mesh DxMxP` or `DxMxPxC` in `command`, if it has one."""
  for i, word in enumerate(command):
    spec = command[i + 1] if word == "--mesh" and i + 1 < len(command) else (
        word[len("--mesh="):] if word.startswith("--mesh=") else None)
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:x(\d+))?", spec or "")
    if m:
      return math.prod(int(g) for g in m.groups() if g is not None)
  return None


def own_script(name: str) -> str:
  """`name`, or the console script of that name installed beside this Python when PATH does not
  find it (e.g. jaxpar-train, with the launcher run as venv/bin/jaxpar-launch, venv not active)."""
  beside = os.path.join(os.path.dirname(sys.executable), name)
  if os.sep in name or shutil.which(name) or not os.access(beside, os.X_OK):
    return name
  return beside


def child_env(rank: int, processes: int, devices: int, coordinator: str) -> dict[str, str]:
  """The environment of process `rank`: coordinator variables and its own simulated devices."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, not at exit
  env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(processes),
              ENV_PROCESS_ID: str(rank)})
  return env


class Prefixer:
  r"""Puts `prefix` before every line of a byte stream and after every '\r' that redraws one.

  Progress bars (tqdm) redraw a line as '\r' + text with no '\n' until they close, so a segment
  after '\r' is passed on at once; any other unfinished line waits for its '\n', so that lines of
  different processes do not interleave.
  """

  def __init__(self, prefix: bytes, drop=None):
    self.prefix = prefix
    self.drop = drop  # drop(line) -> True: a whole line left out
    self.pending = b""  # an unfinished line, not yet passed on
    self.open = False  # the current segment's prefix is already out
    self.after_cr = False  # the current segment follows a '\r'
    self.last = b"\n"  # the last byte passed on

  def feed(self, data: bytes) -> bytes:
    """The prefixed bytes of `data` that can be passed on now."""
    buf, self.pending = self.pending + data, b""
    out = []
    for seg in re.split(rb"(?<=[\r\n])", buf):  # each piece ends with its separator, bar the last
      if not seg:
        continue
      if not seg.endswith((b"\r", b"\n")) and not self.after_cr:
        self.pending = seg
        break
      if self.drop is not None and not self.open and seg.endswith(b"\n") and self.drop(seg):
        continue
      out.append(self._segment(seg))
    text = b"".join(out)
    if text:
      self.last = text[-1:]
    return text

  def _segment(self, seg: bytes) -> bytes:
    head = b"" if self.open or seg == b"\r" else self.prefix
    ended = seg.endswith((b"\r", b"\n"))
    self.open = not ended
    if ended:
      self.after_cr = seg.endswith(b"\r")
    return head + seg

  def close(self) -> bytes:
    """The rest at the end of the stream, ending with a newline."""
    text = self._segment(self.pending) if self.pending else b""
    self.pending = b""
    if (text[-1:] or self.last) != b"\n":
      text += b"\n"
    self.last = b"\n"
    return text


# What gloo (CPU collectives) prints for every connection it makes: tens of lines per run.
GLOO = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of "
                  rb"connected peer ranks is : (\d+)\s*")


# The sentence a process's watchdog ends with when others stopped answering (jaxpar.parallel.distributed).
STALLED = re.compile(rb"error: (process(?:es)? [\d, ]+?)(?:, which runs the coordinator,)? "
                     rb"stopped answering: (step \d+ made no progress for \d+ s)")


def _pump(stream, out, prefix: bytes, lock: threading.Lock, seen=None, drop=None) -> None:
  """Copies `stream` to `out` as it arrives, every line and redrawn line prefixed; `seen(text)`
  gets every piece passed on, and a whole line `drop(line)` is true of is left out."""
  prefixer = Prefixer(prefix, drop)
  while True:
    data = stream.read1(65536)  # whatever is there: a progress bar never ends its line
    text = prefixer.feed(data) if data else prefixer.close()
    if text:
      if seen is not None:
        seen(text)
      with lock:
        out.write(text)
        out.flush()
    if not data:
      break
  stream.close()


def describe(code: int) -> str:
  """'exit code 2' or 'signal SIGKILL' for a Popen return code."""
  if code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"exit code {code}"


class Launcher:
  """Starts the processes, relays their output, and stops all of them when one fails."""

  def __init__(self, command: list[str], processes: int, devices: int, grace: float,
               port: int | None = None):
    self.command, self.processes, self.devices, self.grace = command, processes, devices, grace
    self.coordinator = f"127.0.0.1:{port or free_port()}"
    self.procs: list[subprocess.Popen] = []
    self.threads: list[threading.Thread] = []
    self.lock = threading.Lock()
    # rank -> (monotonic time, Popen return code), written by each process's watcher thread the
    # moment it ends: when one failure brings down the rest within one polling interval, the
    # earliest end (not the lowest rank) is the one to report.
    self.ended: dict[int, tuple[float, int]] = {}
    self.ended_lock = threading.Lock()  # not `lock`, which output holds while it writes
    self.interrupted = None
    self.stalls: dict[int, tuple[str, str]] = {}  # rank -> (who stopped answering, how long)
    self.gloo = 0  # gloo's connection lines left out (each as expected)

  def say(self, text: str) -> None:
    with self.lock:
      sys.stderr.buffer.write(f"[launcher] {text}\n".encode())
      sys.stderr.buffer.flush()

  def start(self) -> None:
    for rank in range(self.processes):
      # Its own session, so a Ctrl-C in the terminal reaches the launcher only, which forwards it.
      p = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, start_new_session=True,
                           env=child_env(rank, self.processes, self.devices, self.coordinator))
      self.procs.append(p)
      for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
        seen = (lambda text, rank=rank: self._seen(rank, text)) if stream is p.stderr else None
        t = threading.Thread(target=_pump, args=(stream, out, f"[{rank}] ".encode(), self.lock,
                                                 seen, self._gloo), daemon=True)
        t.start()
        self.threads.append(t)
      threading.Thread(target=self._watch, args=(rank, p), daemon=True).start()
    self.say("started " + ", ".join(f"process {r} as pid {p.pid}"
                                    for r, p in enumerate(self.procs)))

  def _gloo(self, line: bytes) -> bool:
    """Whether `line` is one of gloo's connection lines that says all is as expected (counted,
    and said in one line at the end); one that found fewer peers than expected is passed on."""
    m = GLOO.fullmatch(line)
    if m is None or m[1] != m[2]:
      return False
    with self.ended_lock:
      self.gloo += 1
    return True

  def _seen(self, rank: int, text: bytes) -> None:
    m = STALLED.search(text)
    if m:
      self.stalls[rank] = (m[1].decode(), m[2].decode())

  def _watch(self, rank: int, p: subprocess.Popen) -> None:
    code = p.wait()
    t = time.monotonic()
    with self.ended_lock:
      self.ended[rank] = (t, code)

  def still_running(self) -> list[int]:
    with self.ended_lock:
      return [r for r in range(len(self.procs)) if r not in self.ended]

  def _signal(self, sig: int, ranks: list[int]) -> None:
    for r in ranks:
      try:
        self.procs[r].send_signal(sig)
      except ProcessLookupError:
        pass

  def _stopped(self, rank: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): it cannot act on SIGTERM."""
    try:
      with open(f"/proc/{self.procs[rank].pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):  # gone already, or not Linux
      return False

  def stop(self, ranks: list[int]) -> None:
    """SIGTERM to `ranks`, SIGKILL to those still running after the grace period (at once to a
    stopped one)."""
    if not ranks:
      return
    frozen = [r for r in ranks if self._stopped(r)]
    if frozen:
      self.say(f"process{'es' if len(frozen) > 1 else ''} {', '.join(map(str, frozen))} "
               f"{'are' if len(frozen) > 1 else 'is'} stopped (it cannot act on SIGTERM): "
               f"sending SIGKILL")
      self._signal(signal.SIGKILL, frozen)
    self._signal(signal.SIGTERM, [r for r in ranks if r not in frozen])
    deadline = time.monotonic() + self.grace
    while time.monotonic() < deadline and set(ranks) & set(self.still_running()):
      time.sleep(0.05)
    alive = [r for r in ranks if r in self.still_running()]
    if alive:
      self.say(f"process{'es' if len(alive) > 1 else ''} {', '.join(map(str, alive))} still "
               f"running {self.grace:g} s after SIGTERM: sending SIGKILL")
      self._signal(signal.SIGKILL, alive)
      for r in alive:
        self.procs[r].wait()

  def wait(self) -> int:
    """Waits for every process; the first non-zero code wins (signals as 128 + number)."""
    first: tuple[int, int] | None = None  # (rank, Popen return code)
    while True:
      running = self.still_running()
      if first is None:
        with self.ended_lock:
          failed = sorted((t, r, code) for r, (t, code) in self.ended.items() if code != 0)
        if failed:
          first = failed[0][1:]
          # Processes that fail together (e.g. the same bad config) need not be stopped; a
          # stopped one (SIGSTOP) cannot end by itself and is not waited for: continued, it
          # would meet a coordinator that is gone.
          settle = time.monotonic() + 1.0
          while (time.monotonic() < settle and self.still_running()
                 and not all(self._stopped(r) for r in self.still_running())):
            time.sleep(0.05)
          running = self.still_running()
          if running:
            self.say(f"process {first[0]} ended with {describe(first[1])} while "
                     f"{'processes' if len(running) > 1 else 'process'} "
                     f"{', '.join(map(str, running))} still ran: stopping "
                     f"{'them' if len(running) > 1 else 'it'} (SIGTERM, then SIGKILL after "
                     f"{self.grace:g} s)")
            self.stop(running)
            continue
      if self.interrupted and running:
        self.say(f"received {self.interrupted}: stopping all processes")
        self.stop(running)
        continue
      if not running:
        break
      time.sleep(0.05)
    for t in self.threads:
      t.join(timeout=5)
    if self.gloo:
      self.say(f"gloo made {self.gloo} connection{'s' if self.gloo > 1 else ''} between the "
               f"processes, each to all the peers it expected (its lines are left out)")
    if first is None:  # all ended well; stopped by a signal, the shell's code for it
      return 128 + signal.Signals[self.interrupted] if self.interrupted else 0
    rank, code = first
    status = code if code > 0 else 128 - code
    if self.stalls:  # the first to exit is the one that noticed, not the one that stalled
      who, how = self.stalls.get(rank) or next(iter(self.stalls.values()))
      named_by = ", ".join(map(str, sorted(self.stalls)))
      ended = "; ".join(f"process {r} ended with {describe(p.returncode)}"
                        for r, p in enumerate(self.procs))
      self.say(f"{who} stopped answering ({how}, said process{'es' if len(self.stalls) > 1 else ''} "
               f"{named_by}); {ended}; exit code {status}")
      return status
    others = "; ".join(f"process {r} ended with {describe(p.returncode)}"
                       for r, p in enumerate(self.procs) if r != rank)
    self.say(f"process {rank} failed first ({describe(code)})" + (f"; {others}" if others else "")
             + f"; exit code {status}")
    return status


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  cut = argv.index("--") if "--" in argv else len(argv)
  p = Parser(
      description=__doc__.splitlines()[0],
      usage="%(prog)s --processes N [--devices-per-process K] [--grace S] -- SCRIPT [ARGS ...]")
  p.add_argument("--processes", type=int, required=True, help="number of processes")
  p.add_argument("--devices-per-process", type=int,
                 help="simulated CPU devices each (default: the command's --mesh size / processes)")
  p.add_argument("--grace", type=float, default=10.0,
                 help="seconds between SIGTERM and SIGKILL when stopping processes")
  p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
  args = p.parse_args(argv[:cut])
  command = argv[cut + 1:]
  if not command:
    p.error("give the command to run after --, e.g. -- jaxpar-train --mesh 2x4x1")
  if args.processes < 1:
    p.error(f"--processes={args.processes} must be at least 1")
  if not args.grace >= 0:  # NaN too
    p.error(f"--grace={args.grace} must be a number of seconds, 0 or more")
  if args.port is not None and not 1 <= args.port <= 65535:
    p.error(f"--port={args.port} is not a TCP port (1 to 65535)")
  devices = args.devices_per_process
  if devices is None:
    total = mesh_devices(command)
    if total is not None and total % args.processes:
      p.error(f"the command's mesh has {total} devices, which do not split evenly over "
              f"{args.processes} processes")
    devices = total // args.processes if total else 1
  if devices < 1:
    p.error(f"--devices-per-process={devices} must be at least 1")
  if command[0].endswith(".py"):
    command = [sys.executable, *command]
  else:
    command = [own_script(command[0]), *command[1:]]

  launcher = Launcher(command, args.processes, devices, args.grace, args.port)

  def interrupt(signum, frame):
    launcher.interrupted = signal.Signals(signum).name
  signal.signal(signal.SIGINT, interrupt)
  signal.signal(signal.SIGTERM, interrupt)
  launcher.say(f"{args.processes} processes x {devices} CPU devices, coordinator "
               f"{launcher.coordinator}: {' '.join(command)}")
  try:
    launcher.start()
  except OSError as e:  # e.g. the command does not exist
    launcher.say(f"cannot start {command[0]}: {e.strerror or e}")
    launcher.stop(launcher.still_running())
    return 127
  return launcher.wait()


if __name__ == "__main__":
  sys.exit(main())
