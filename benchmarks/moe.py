"""Tokens/s of a mixture of experts against the dense model of the same active parameters, and the
router's load balance after a short run on the main job's data.

python benchmarks/moe.py [--steps S] [--pairs N] [--capacity F] [--balance-steps B] [--out FILE]
Writes benchmarks/results/moe.json by default (git-ignored; the committed figures are in
benchmarks/reference/moe.json).

The models, both the default `gpt` (4 layers, d_model 128, sequence 128, batch 16):
  dense  its MLP of d_ff 512;
  moe    8 GELU experts of width 256, top-2 (model.n_experts=8 experts_per_token=2 moe_d_ff=256):
         each token goes through 2 x 256 hidden units, as the dense model's 512, plus the router;
  moe_capacity  the same with model.capacity_factor=F (--capacity, 1.25 by default; 0 leaves it
         out): an expert takes at most ceil(F x tokens x k / E) of a device's rows, and with the
         experts split the exchange's buffers hold that many rather than all of them.
Each runs scripts/train.py on the main job's data (data.source=local_text, the default) for
--steps steps, on one CPU device (1x1x1) and on 8 simulated CPU devices (8x1x1: data parallel for
the dense model; for the mixture the experts split 8 ways, one per device, with the all-to-all).
The runs alternate (dense, moe, moe_capacity, then the reverse, ...) so load from other work
falls on all alike.
Tokens/s is the summary's `tokens_per_sec` (after the first log interval: no compile). The JSON
holds every run, the medians and the ratios moe / dense per mesh: a ratio, as the host is shared.

The load balance: the mixture trained --balance-steps steps on 1x1x1 in this process
(jaxpar.train.loop.run, the path of jaxpar-train), its metrics file's moe_aux_loss, moe_z_loss and
moe_max_load at each logged step (the run logs no per-expert figures), and then each layer's
per-expert token fractions (each expert's share of the k x tokens routed rows) of the trained
router on a batch of the same data, read in the forward pass.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers beside this file
import _jaxpar_bench  # noqa: E402

TRAIN = os.path.join(ROOT, "scripts", "train.py")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "moe.json")
MODELS = {"dense": [], "moe": ["model.n_experts=8", "model.experts_per_token=2",
                               "model.moe_d_ff=256"]}
MESHES = ("1x1x1", "8x1x1")


def child_env() -> dict:
  """No inherited device count, cache or cluster: train.py simulates the mesh's devices."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXPAR_", "SLURM_", "OMPI_", "PMI_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


def one_run(mesh: str, overrides: list[str], steps: int, data_dir: str) -> dict:
  """train.py for `steps` steps on the main job's data; the summary's figures."""
  with tempfile.TemporaryDirectory(prefix="jaxpar-moe-") as tmp:
    metrics = os.path.join(tmp, "m.jsonl")
    cmd = [sys.executable, TRAIN, "--mesh", mesh, "--steps", str(steps), "--workdir",
           os.path.join(tmp, "wd"), "--metrics-file", metrics, "--no-progress", "--set",
           f"data.data_dir={data_dir}", "checkpoint.every=0",
           f"train.log_every={max(steps // 3, 1)}", *overrides]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    if r.returncode != 0:
      raise SystemExit(f"train.py {mesh} {overrides} failed (exit {r.returncode}):\n"
                       f"{r.stderr[-3000:]}")
    with open(metrics) as f:
      rows = [json.loads(line) for line in f]
  final = rows[-1]
  return {"tokens_per_sec": round(final["tokens_per_sec"], 1),
          "final_loss": round(rows[-2]["loss"], 4), "wall_s": round(time.perf_counter() - t0, 2)}


def active_mlp_params(overrides: list[str]) -> dict:
  """An MLP's parameters per layer: all of them, and those one token goes through."""
  from jaxpar import config
  from jaxpar.models import moe
  mc = config.load(None, overrides).model
  if mc.n_experts:
    return {"all": moe.n_params(mc, glu=False, active=False),
            "active": moe.n_params(mc, glu=False, active=True)}
  n = 2 * mc.d_model * mc.d_ff + mc.d_ff + mc.d_model  # GPT's two matrices and biases
  return {"all": n, "active": n}


def load_balance(steps: int, data_dir: str) -> dict:
  """The mixture trained `steps` steps on 1x1x1; its logged router figures, then each layer's
  per-expert token fractions on a batch of the same data."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxpar import config
  from jaxpar.data.loader import make_loader
  from jaxpar.models import moe
  from jaxpar.train import loop

  cfg = config.load(None, MODELS["moe"] + [f"data.data_dir={data_dir}", "checkpoint.every=0",
                                           "train.log_every=10"])
  with tempfile.TemporaryDirectory(prefix="jaxpar-moe-balance-") as tmp:
    metrics = os.path.join(tmp, "m.jsonl")
    result = loop.run(cfg, (1, 1, 1), os.path.join(tmp, "wd"), metrics, steps=steps,
                      progress=False, log=lambda *a: None)
    with open(metrics) as f:
      rows = [json.loads(line) for line in f]
    batches = make_loader(result.trainer.cfg, os.path.join(tmp, "wd"))
    batch = batches.next()
    batches.close()
  keys = ("loss", "lm_loss", "moe_aux_loss", "moe_z_loss", "moe_max_load")
  logged = [{"step": r["step"], **{k: round(r[k], 4) for k in keys if k in r}}
            for r in rows if not r.get("final")]

  mc = cfg.model
  E, k = mc.n_experts, mc.experts_per_token
  seen = []  # (E,) routed rows per expert, one per layer, in layer order
  plain = moe.mlp

  def spy(p, h, cfg_m, manual=frozenset()):  # the router's choices, as moe.mlp makes them
    logits = h.reshape(-1, h.shape[-1]).astype(jnp.float32) @ p["router"].astype(jnp.float32)
    _, experts = moe.route(logits, k, cfg_m.router_softmax)
    counts = jnp.zeros((E,), jnp.int32).at[experts.reshape(-1)].add(1)
    jax.debug.callback(lambda c: seen.append(np.asarray(c)), counts, ordered=True)
    return plain(p, h, cfg_m, manual)

  trainer = result.trainer
  batch = {name: jnp.asarray(v) for name, v in batch.items()}
  abstract = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in batch.items()}
  moe.mlp = spy
  try:
    with jax.set_mesh(trainer.mesh):
      out = jax.device_get(trainer.eval_jitted(abstract)(result.state["params"], batch))
    jax.effects_barrier()
  finally:
    moe.mlp = plain
  fractions = [c / c.sum() for c in seen]  # each sums to 1; an even share is 1 / E
  return {"steps": steps, "mesh": "1x1x1", "logged": logged,
          "eval_batch": {"tokens": int(batch["tokens"].shape[0] * mc.seq_len),
                         **{k: round(float(out[k]), 4) for k in keys if k in out}},
          "per_expert_fraction": [[round(float(x), 4) for x in f] for f in fractions],
          "max_load_per_layer": [round(float(f.max() * E), 3) for f in fractions],
          "min_load_per_layer": [round(float(f.min() * E), 3) for f in fractions]}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=30, help="steps per timed run (default 30)")
  p.add_argument("--pairs", type=int, default=2, help="alternating pairs per mesh (default 2)")
  p.add_argument("--capacity", type=float, default=1.25,
                 help="capacity factor of the moe_capacity model (default 1.25; 0: no such run)")
  p.add_argument("--balance-steps", type=int, default=100,
                 help="steps of the load-balance run (default 100)")
  p.add_argument("--only", choices=MESHES, help="one mesh")
  p.add_argument("--out", default=DEFAULT_OUT)
  return p


def main(argv: list[str] | None = None) -> dict:
  args = parser().parse_args(argv)
  import jax
  models = dict(MODELS)
  if args.capacity:
    models["moe_capacity"] = MODELS["moe"] + [f"model.capacity_factor={args.capacity}"]
  result = {"what": "tokens/s of an 8-expert top-2 mixture, dropless and with a capacity factor, "
                    "vs the dense model of the same active parameters, and the router's load "
                    "balance after a short run",
            "host_cpu": _jaxpar_bench.host_cpu(), "jax": jax.__version__, "steps": args.steps,
            "pairs": args.pairs, "load_average_at_start": os.getloadavg(),
            "models": {name: {"overrides": o, "mlp_params_per_layer": active_mlp_params(o)}
                       for name, o in models.items()},
            "cases": {}}
  with tempfile.TemporaryDirectory(prefix="jaxpar-moe-data-") as data_dir:
    for mesh in ([args.only] if args.only else MESHES):
      runs: dict[str, list[dict]] = {name: [] for name in models}
      for pair in range(args.pairs):
        for name in list(models)[::1 if pair % 2 == 0 else -1]:
          row = one_run(mesh, models[name], args.steps, data_dir)
          runs[name].append(row)
          print(f"{mesh} {name}: {row}", flush=True)
      med = {name: statistics.median(r["tokens_per_sec"] for r in rs) for name, rs in runs.items()}
      result["cases"][mesh] = {"runs": runs, "median_tokens_per_sec": med,
                               "moe_over_dense": round(med["moe"] / med["dense"], 3),
                               "load_average_after": os.getloadavg()}
      if "moe_capacity" in med:
        result["cases"][mesh]["moe_capacity_over_dense"] = round(
            med["moe_capacity"] / med["dense"], 3)
    result["load_average_after_speed"] = os.getloadavg()
    if args.balance_steps:
      result["load_balance"] = load_balance(args.balance_steps, data_dir)
  result["load_average_at_end"] = os.getloadavg()
  _jaxpar_bench.write_json(result, args.out)
  print(json.dumps({m: {k: v for k, v in c.items() if k.endswith("_over_dense")}
                    for m, c in result["cases"].items()}))
  return result


if __name__ == "__main__":
  main()
