"""The guides' figures, from jaxpar's own code and reference JSON: `python docs/figures.py`.

Each figure is written as docs/images/NAME.png with the numbers it draws beside it as
docs/images/NAME.json; tests/test_figures.py checks those numbers against their sources.

- pipeline_schedules: the action tables the executor runs (`jaxpar.parallel.pipeline.build`) for
  gpipe, 1f1b and circular on 4 stages, 8 microbatches, as a stage x tick chart.
- zero_memory: `plan.py --mesh 8x1x1 --set parallel.zero_stage=N` of the default model for N = 0-3
  and stage 3 with the optimizer offloaded: per-device bytes from the compiled step (4-5 compiles).
- context_memory: `plan.py --mesh 1x1x1xC --set model.seq_len=T train.batch_size=2`: the compiled
  peak per device against T, for C = 1 (no context parallelism), 2, 4 and 8 (16 compiles).
- peers: jaxpar beside HF transformers + torch, a hand-written JAX + optax step and torch's CPU
  matmuls, from benchmarks/reference/{vs_pytorch,overhead,kernel_rates}.json.

The compiles take a few minutes on a 2-core machine; `--only NAME ...` redraws some of them.
Needs matplotlib (`pip install -e '.[docs]'`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(ROOT, "docs", "images")
REFERENCE = os.path.join(ROOT, "benchmarks", "reference")
if ROOT not in sys.path:  # a checkout without `pip install -e .`
  sys.path.insert(0, ROOT)

DEVICES = 8
SCHEDULES = {"P": 4, "M": 8, "rows": [("gpipe", 1), ("1f1b", 1), ("circular", 2)]}
ZERO_MESH = "8x1x1"
ZERO_CASES = [(0, False), (1, False), (2, False), (3, False), (3, True)]  # (stage, offload)
CONTEXT = {"batch": 2, "seq_lens": [512, 1024, 2048, 4096], "contexts": [1, 2, 4, 8]}
MB, MiB = 1e6, 2**20


def reference(name: str) -> dict:
  with open(os.path.join(REFERENCE, name + ".json")) as f:
    return json.load(f)


# ---- the data, one function per figure (no matplotlib) ----

def schedule_data() -> dict:
  """The executed tables: actions[tick][stage] = [kind (0 idle, 1 forward, 2 backward), mb, chunk]."""
  from jaxpar.parallel import pipeline
  P, M = SCHEDULES["P"], SCHEDULES["M"]
  out = {"stages": P, "microbatches": M, "source": "jaxpar.parallel.pipeline.build", "schedules": {}}
  for name, V in SCHEDULES["rows"]:
    s = pipeline.build(name, P, M, V)
    out["schedules"][name] = {"virtual_stages": s.virtual_stages, "ticks": s.ticks,
                              "bubble_fraction": s.bubble_fraction, "buffer_slots": s.slots,
                              "actions": s.actions.tolist()}
  return out


def _plan(overrides: list[str], mesh: str) -> dict:
  from jaxpar import config
  from jaxpar.planning import plan
  report = plan.plan(config.load(None, ["data.source=synthetic"] + overrides), mesh)
  return {"bytes_per_device": report["bytes_per_device"], "compiled": report["compiled"]}


def zero_data() -> dict:
  """plan.py's report of the default model on 8x1x1 at each ZeRO stage (compiles the steps)."""
  rows = []
  for stage, offload in ZERO_CASES:
    sets = [f"parallel.zero_stage={stage}"] + (["parallel.offload_optimizer=true"] if offload else [])
    rows.append({"zero_stage": stage, "offload_optimizer": offload, **_plan(sets, ZERO_MESH)})
  return {"mesh": ZERO_MESH, "source": "jaxpar.planning.plan.plan (plan.py --json)", "rows": rows}


def context_data() -> dict:
  """plan.py's compiled peak and temporaries per device against T on 1x1x1xC (compiles the steps)."""
  B = CONTEXT["batch"]
  out = {"batch": B, "seq_lens": CONTEXT["seq_lens"], "source": "jaxpar.planning.plan.plan",
         "by_context": {}}
  for C in CONTEXT["contexts"]:
    rows = [_plan([f"model.seq_len={T}", f"train.batch_size={B}"], f"1x1x1x{C}")["compiled"]
            for T in CONTEXT["seq_lens"]]
    out["by_context"][str(C)] = {k: [r[k] for r in rows] for k in ("peak_bytes", "temp_bytes")}
  return out


def peers_data() -> dict:
  """jaxpar's step beside its peers' on the same CPU, read from benchmarks/reference."""
  vs, off, kr = reference("vs_pytorch"), reference("overhead"), reference("kernel_rates")
  shape = lambda m: f"{m['n_layers']} layers, d_model {m['d_model']}, T {m['seq_len']}"
  return {
      "vs_pytorch": {"source": "benchmarks/reference/vs_pytorch.json", "statistic": "median",
                     "model": shape(vs["config"]["model"]),
                     "jaxpar": vs["tokens_per_s"]["jaxpar"]["median"],
                     "torch": vs["tokens_per_s"]["torch"]["median"]},
      "overhead": {"source": "benchmarks/reference/overhead.json", "statistic": "median",
                   "model": shape(off["config"]["model"]),
                   "jaxpar": off["tokens_per_s"]["jaxpar"]["median"],
                   "plain": off["tokens_per_s"]["plain"]["median"]},
      "kernel_rates": {"source": "benchmarks/reference/kernel_rates.json",
                       "rows": [{"shape": r["shape"],
                                 **{form: {"jax": r[form]["jax"], "torch": r[form]["torch"]}
                                    for form in ("NN", "NT", "TN")}}
                                for r in kr["matmul_gflops"]]},
  }


# ---- the drawings ----

def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  plt.rcParams.update({"font.size": 9, "svg.hashsalt": "jaxpar", "figure.dpi": 100})
  return plt


def _save(fig, name: str) -> None:
  """Lay out, write docs/images/NAME.png and close the figure."""
  fig.tight_layout()
  fig.savefig(os.path.join(IMAGES, name + ".png"), dpi=110, bbox_inches="tight",
              metadata={"Software": None})
  import matplotlib.pyplot as plt
  plt.close(fig)


def _open_frame(*axes) -> None:
  """No top or right spine on these axes."""
  for ax in axes:
    for side in ("top", "right"):
      ax.spines[side].set_visible(False)


FWD_COLOR, BWD_COLOR, IDLE_COLOR = "#4c72b0", "#dd8452", "#f2f2f2"


def draw_schedules(d: dict) -> None:
  from matplotlib.patches import Patch
  plt = _pyplot()
  rows = d["schedules"]
  width = max(r["ticks"] / r["virtual_stages"] for r in rows.values())
  fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.25 * d["stages"] * len(rows) / 2 + 1),
                           sharex=True)
  for ax, (name, r) in zip(axes, rows.items()):
    w = 1 / r["virtual_stages"]  # a circular tick runs 1/V of a stage's layers
    for t, row in enumerate(r["actions"]):
      for s, (kind, mb, chunk) in enumerate(row):
        color = (IDLE_COLOR, FWD_COLOR, BWD_COLOR)[kind]
        shade = 1.0 if chunk == 0 else 0.6
        ax.add_patch(plt.Rectangle((t * w, s), w, 1, facecolor=color, alpha=shade if kind else 1,
                                   edgecolor="white", linewidth=1))
        if kind:
          label = str(mb) if r["virtual_stages"] == 1 else f"{mb}.{chunk}"
          ax.text((t + 0.5) * w, s + 0.5, label, ha="center", va="center", color="white",
                  fontsize=7 if w == 1 else 5.5)
    V = r["virtual_stages"]
    ax.set_title(f"{name}{f' (V = {V})' if V > 1 else ''}: {r['ticks']} ticks, bubble "
                 f"{r['bubble_fraction']:.0%}, {r['buffer_slots']} buffer slots per stage",
                 loc="left")
    ax.set_xlim(0, width)
    ax.set_ylim(d["stages"], 0)
    ax.set_yticks([s + 0.5 for s in range(d["stages"])], [f"stage {s}" for s in range(d["stages"])])
    ax.tick_params(length=0)
    for side in ax.spines.values():
      side.set_visible(False)
  axes[-1].set_xlabel("time, in one stage's forward or backward (a circular tick is 1/V of it)")
  fig.legend(handles=[Patch(color=FWD_COLOR, label="forward of microbatch i (i.chunk)"),
                      Patch(color=BWD_COLOR, label="backward"),
                      Patch(color=IDLE_COLOR, label="idle")],
             loc="upper right", ncol=3, frameon=False)
  fig.suptitle(f"Pipeline schedules as executed: P = {d['stages']} stages, "
               f"M = {d['microbatches']} microbatches", x=0.01, ha="left", y=1.0)
  _save(fig, "pipeline_schedules")


def draw_zero(d: dict) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7.5, 4))
  labels, parts = [], {"parameters": [], "optimizer state": [], "temporaries": [],
                       "other arguments and outputs": [], "optimizer state in host memory": []}
  for r in d["rows"]:
    b, c = r["bytes_per_device"], r["compiled"]
    opt = b["opt_state"]
    labels.append(f"ZeRO-{r['zero_stage']}" + ("\n+ offload" if r["offload_optimizer"] else ""))
    parts["parameters"].append(b["params"] / MB)
    parts["optimizer state"].append(0 if r["offload_optimizer"] else opt / MB)
    parts["optimizer state in host memory"].append(opt / MB if r["offload_optimizer"] else 0)
    parts["temporaries"].append(c["temp_bytes"] / MB)
    parts["other arguments and outputs"].append(
        (c["peak_bytes"] - c["temp_bytes"] - b["params"] - opt) / MB)
  colors = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "white"]
  bottom = [0.0] * len(labels)
  for (name, values), color in zip(parts.items(), colors):
    host = name.endswith("host memory")
    ax.bar(labels, values, bottom=bottom, label=name, color=color, width=0.6,
           edgecolor="#dd8452" if host else "white", hatch="//" if host else None)
    bottom = [b + v for b, v in zip(bottom, values)]
  for i, r in enumerate(d["rows"]):
    c, b = r["compiled"], r["bytes_per_device"]
    device = c["peak_bytes"] - (b["opt_state"] if r["offload_optimizer"] else 0)
    ax.text(i, bottom[i] + 0.3, f"{device / MB:.2f} MB", ha="center", va="bottom")
  ax.set_ylabel("MB per device")
  ax.set_title(f"Peak memory per device by ZeRO stage, default model on {d['mesh']} (plan.py)\n"
               "peak = arguments + outputs + temporaries − donated, from the compiled step",
               loc="left")
  ax.set_ylim(0, max(bottom) * 1.15)
  ax.legend(frameon=False, fontsize=8)
  _open_frame(ax)
  _save(fig, "zero_memory")


def draw_context(d: dict) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  T = d["seq_lens"]
  for C, r in d["by_context"].items():
    label = "C = 1 (no context parallelism)" if C == "1" else f"C = {C}"
    ax.plot(T, [p / MiB for p in r["peak_bytes"]], marker="o", label=label)
    ax.annotate(f"{r['peak_bytes'][-1] / MiB:.0f} MiB", (T[-1], r["peak_bytes"][-1] / MiB),
                textcoords="offset points", xytext=(6, -3), fontsize=8)
  ax.set_xscale("log", base=2)
  ax.set_xticks(T, [str(t) for t in T])
  ax.set_xlabel("sequence length T")
  ax.set_ylabel("peak MiB per device (compiled)")
  ax.set_title(f"Memory per device against T, mesh 1x1x1xC, default model, batch {d['batch']} "
               "(plan.py)", loc="left")
  ax.legend(frameon=False)
  ax.set_xlim(T[0] / 1.3, T[-1] * 1.6)
  ax.set_ylim(0, None)
  _open_frame(ax)
  _save(fig, "context_memory")


def draw_peers(d: dict) -> None:
  from matplotlib.transforms import blended_transform_factory
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1, 2.4]})
  for ax, key, peer, what in ((axes[0], "vs_pytorch", "torch", "HF transformers\n+ torch"),
                              (axes[1], "overhead", "plain", "JAX + optax\nby hand")):
    r = d[key]
    values = [r["jaxpar"], r[peer]]
    bars = ax.bar(["jaxpar", what], values, color=["#4c72b0", "#c44e52"], width=0.6)
    for bar, v in zip(bars, values):
      ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom")
    ax.set_title(f"{r['jaxpar'] / r[peer]:.2f}x ({r['statistic']}; {r['model']})", loc="left",
                 fontsize=8)
    ax.set_ylim(0, max(values) * 1.15)
  axes[0].set_ylabel("training tokens/s, one CPU device")
  right, width = axes[2], 0.38
  labels, jax_rates, torch_rates = [], [], []
  for r in d["kernel_rates"]["rows"]:
    for form in ("NN", "NT", "TN"):
      labels.append(form)
      jax_rates.append(r[form]["jax"])
      torch_rates.append(r[form]["torch"])
  x = [i + i // 3 * 0.5 for i in range(len(labels))]  # a gap between the shapes
  right.bar([i - width / 2 for i in x], jax_rates, width, label="XLA:CPU (jaxpar)", color="#4c72b0")
  right.bar([i + width / 2 for i in x], torch_rates, width, label="torch's CPU BLAS",
            color="#c44e52")
  right.set_xticks(x, labels)
  under = blended_transform_factory(right.transData, right.transAxes)
  for g, r in enumerate(d["kernel_rates"]["rows"]):
    right.text(x[3 * g + 1], -0.13, r["shape"], transform=under, ha="center", va="top",
               fontsize=8)
  right.set_ylabel("GFLOP/s")
  right.set_ylim(0, max(jax_rates + torch_rates) * 1.25)
  right.set_title("The block's matmuls: NN forward, NT data gradient, TN weight gradient",
                  loc="left", fontsize=8)
  right.legend(frameon=False, ncol=2, loc="upper left")
  _open_frame(*axes)
  fig.suptitle("jaxpar beside its peers on the 2-core CPU machine (benchmarks/reference)",
               x=0.01, ha="left")
  _save(fig, "peers")


FIGURES = {"pipeline_schedules": (schedule_data, draw_schedules),
           "zero_memory": (zero_data, draw_zero),
           "context_memory": (context_data, draw_context),
           "peers": (peers_data, draw_peers)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", nargs="+", choices=sorted(FIGURES), default=sorted(FIGURES))
  ap.add_argument("--redraw", action="store_true",
                  help="draw from the JSON already in docs/images, computing nothing")
  args = ap.parse_args(argv)
  from jaxpar.parallel import mesh
  mesh.ensure_cpu_devices(DEVICES)  # before JAX starts: the planned meshes' simulated devices
  os.makedirs(IMAGES, exist_ok=True)
  for name in args.only:
    data_fn, draw = FIGURES[name]
    path = os.path.join(IMAGES, name + ".json")
    start = time.perf_counter()
    if args.redraw:
      with open(path) as f:
        data = json.load(f)
    else:
      data = data_fn()
      with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    draw(data)
    print(f"{name}: docs/images/{name}.png and .json ({time.perf_counter() - start:.0f} s)",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
