"""Packing records into windows against one record a window: padding, and useful tokens/s.

`python benchmarks/packing.py [--records N] [--seq-len T] [--steps N] [--out FILE]`.
N prompt/completion records (byte tokens) whose lengths are drawn log-uniform between 20 and
2,000 tokens (the mix of an instruction set: many short answers, a tail of long ones), each
prompt a random 20-80% of its record, are written as train.jsonl and read by data.source=jsonl's
reader twice: packed (best-fit decreasing, several records a window, segment ids apart) and one
record a window, padded. For each it reports the windows the split needs, the share of their
tokens that is padding (a decoder's compute is per window position, so that is the share of the
step's compute spent on padding) and the time to read and pack the split; then one compiled
training step of a small GPT on one CPU device runs on batches of each layout, alternated, and
the real (non-padding) tokens and answer tokens per second follow (the best of the alternated
runs for each; both layouts run one compiled program of one shape, so their step times differ
only by the machine's other load, which step_time_ratio shows).
Writes JSON (default benchmarks/results/packing.json, git-ignored; the committed figures are in
benchmarks/reference/packing.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

try:
  import jaxpar  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import config as jconfig  # noqa: E402
from jaxpar.data import jsonl  # noqa: E402
from jaxpar.parallel import mesh as jmesh  # noqa: E402
from jaxpar.train import hooks, loop  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "packing.json")
SHORTEST, LONGEST = 20, 2000


def write_records(path: str, n: int, seed: int = 0) -> np.ndarray:
  """n records of random lowercase text, lengths log-uniform in [SHORTEST, LONGEST] tokens
  (end-of-text included); returns the lengths."""
  rng = np.random.default_rng(seed)
  lengths = np.exp(rng.uniform(np.log(SHORTEST), np.log(LONGEST + 1), n)).astype(int)
  with open(path, "w") as f:
    for n_tokens in lengths:
      text = bytes(rng.integers(97, 123, n_tokens - 1, dtype=np.uint8)).decode()
      cut = int(len(text) * rng.uniform(0.2, 0.8))
      f.write(json.dumps({"prompt": text[:cut], "completion": text[cut:]}) + "\n")
  return lengths


def layout(file: str, seq_len: int, packed: bool) -> tuple[jsonl.PackedRecords, dict]:
  t0 = time.perf_counter()
  windows = jsonl.PackedRecords(file, seq_len, jsonl.Encoder(), split_long=True,
                               packed=packed)  # (--seq-len below 2,000: long records cut)
  read_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  rows = windows[np.arange(len(windows))]
  read_windows_s = time.perf_counter() - t0
  return windows, {"windows": len(windows), "window_tokens": len(windows) * windows.width,
                   "real_tokens": windows.tokens, "padding_share": windows.padding(),
                   "read_and_pack_s": read_s, "read_every_window_s": read_windows_s,
                   "records_per_window_mean": float(np.mean(rows["segment_ids"].max(-1)))}


def step_rates(cfg, layouts: dict, steps: int, rounds: int) -> dict:
  """Step time of one compiled step on batches of each layout, alternated `rounds` times."""
  trainer = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), loop.build_model(cfg))
  b = cfg.train.batch_size
  spec = next(iter(layouts.values())).element_spec(b)
  abstract = loop._batch_abstract(spec, 1)
  shardings = trainer.batch_sharding(abstract)
  compiled = trainer.lower(abstract).compile()
  state = trainer.init(cfg.train.seed)
  rng = np.random.default_rng(1)
  batches, counts = {}, {}
  for name, windows in layouts.items():
    rows = windows[rng.choice(len(windows), (steps, b), replace=False).reshape(-1)]
    host = [{k: v[i * b:(i + 1) * b] for k, v in rows.items()} for i in range(steps)]
    batches[name] = [hooks.global_batch(h, shardings) for h in host]
    seg = rows["segment_ids"]
    counted = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)  # targets inside a record
    counts[name] = {"real": int((seg > 0).sum()),
                    "answer": int((counted * rows["loss_mask"][:, 1:]).sum())}
  times = {name: [] for name in layouts}
  with jax.set_mesh(trainer.mesh):
    for name in layouts:  # warm-up
      state, m = compiled(state, batches[name][0])
    jax.block_until_ready(m)
    for _ in range(rounds):
      for name in layouts:
        t0 = time.perf_counter()
        for batch in batches[name]:
          state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times[name].append(time.perf_counter() - t0)
  out = {}
  for name in layouts:
    best = min(times[name])
    out[name] = {"step_time_s": best / steps, "runs_s": times[name],
                 "real_tokens_per_sec": counts[name]["real"] / best,
                 "answer_tokens_per_sec": counts[name]["answer"] / best,
                 "window_tokens_per_sec": steps * b * (cfg.model.seq_len + 1) / best}
  return out


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--records", type=int, default=2000)
  p.add_argument("--seq-len", type=int, default=2047, help="model.seq_len (windows of T + 1)")
  p.add_argument("--batch-size", type=int, default=2)
  p.add_argument("--steps", type=int, default=3, help="steps per timed run")
  p.add_argument("--rounds", type=int, default=6, help="timed runs of each layout, alternated")
  p.add_argument("--out", default=DEFAULT_OUT)
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  results = {"host_cpu": _jaxpar_bench.host_cpu(), "jax": jax.__version__,
             "load_average_at_start": os.getloadavg()[0], "records": args.records,
             "lengths": f"log-uniform in [{SHORTEST}, {LONGEST}] tokens", "seq_len": args.seq_len}
  with tempfile.TemporaryDirectory() as tmp:
    file = os.path.join(tmp, "train.jsonl")
    lengths = write_records(file, args.records)
    results["mean_record_tokens"] = float(lengths.mean())
    layouts = {}
    for name, packed in (("packed", True), ("one_per_window", False)):
      layouts[name], results[name] = layout(file, args.seq_len, packed)
      r = results[name]
      print(f"{name}: {r['windows']} windows, {r['padding_share']:.1%} padding, read and "
            f"packed in {r['read_and_pack_s']:.2f} s")
    cfg = jconfig.load(None, [f"data.path={tmp}", "data.source=jsonl", "model.d_model=64",
                              "model.n_layers=2", "model.n_heads=4", "model.d_ff=256",
                              f"model.seq_len={args.seq_len}",
                              f"train.batch_size={args.batch_size}",
                              "precision.compute_dtype=float32"])
    rates = step_rates(cfg, layouts, args.steps, args.rounds)
  for name, r in rates.items():
    results[name].update(r)
    print(f"{name}: step {r['step_time_s'] * 1e3:.0f} ms, {r['real_tokens_per_sec']:,.0f} real "
          f"tokens/s, {r['answer_tokens_per_sec']:,.0f} answer tokens/s")
  results["windows_ratio"] = results["one_per_window"]["windows"] / results["packed"]["windows"]
  results["real_tokens_per_sec_ratio"] = (results["packed"]["real_tokens_per_sec"]
                                          / results["one_per_window"]["real_tokens_per_sec"])
  # one compiled program of one shape: the step times differ only by the machine's other load
  results["step_time_ratio"] = (results["packed"]["step_time_s"]
                                / results["one_per_window"]["step_time_s"])
  results["load_average_at_end"] = os.getloadavg()[0]
  print(f"packing: {results['windows_ratio']:.1f}x fewer windows, "
        f"{results['real_tokens_per_sec_ratio']:.1f}x the real tokens/s")
  _jaxpar_bench.write_json(results, args.out)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
