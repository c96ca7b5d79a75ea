"""Every measured figure the README and the guides quote equals its one source, rounded as quoted;
the figures' data in docs/images equals what the code and benchmarks/reference give.

QUOTED maps a phrase of a document, with `{}` for each number, to the numbers of its source:
benchmarks/reference/NAME.json, or docs/images/NAME.json for what `python docs/figures.py` reads
from compiled programs. A figure quoted in two places is two rows with one source, so the two
cannot differ; a number changed in a document or in its source fails here.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MiB, GiB = 2**20, 2**30


@functools.cache
def ref(name: str) -> dict:
  return json.loads((ROOT / "benchmarks" / "reference" / f"{name}.json").read_text())


@functools.cache
def image(name: str) -> dict:
  return json.loads((ROOT / "docs" / "images" / f"{name}.json").read_text())


def r(x: float, digits: int = 2) -> str:
  """x rounded half up as its decimal digits read (0.215 -> 0.22), as a person rounds a figure."""
  return str(Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-digits), ROUND_HALF_UP))


def comma(x: float) -> str:
  return f"{int(Decimal(repr(float(x))).quantize(Decimal(1), ROUND_HALF_UP)):,}"


def pipe(schedule: str, m: int) -> float:
  row, = [x for x in ref("pipeline")["rows"] if x["schedule"] == schedule and x["microbatches"] == m]
  return row["temp_bytes"] / MiB


def ctx(name: str, C: int) -> dict:
  return ref(name)["memory"]["by_context"][str(C)]


def speed(name: str, T: int, C: int) -> float:
  """Tokens per CPU second at context C over C = 1's, at T."""
  row, = [x for x in ref(name)["speed"] if x["seq_len"] == T]
  return row[str(C)]["tokens_per_cpu_s"] / row["1"]["tokens_per_cpu_s"]


def long_ctx(form: str, T: int) -> float:
  return ref("long_context")["memory"][form]["temp_bytes"][str(T)]


def doubling(form: str) -> list[str]:
  ratios = ref("long_context")["memory"][form]["ratio_per_doubling"].values()
  return [r(min(ratios), 1), r(max(ratios), 1)]


def same(*values):
  """One number a phrase quotes for several sources ('4096 at C = 2 and 4')."""
  assert len(set(values)) == 1, values
  return values[0]


def zero(stage: int, offload: bool = False) -> dict:
  row, = [x for x in image("zero_memory")["rows"]
          if x["zero_stage"] == stage and x["offload_optimizer"] == offload]
  return row


def zero_row(stage: int) -> list[str]:
  b, c = zero(stage)["bytes_per_device"], zero(stage)["compiled"]
  return [r(v / 1e6) for v in (b["params"], b["grads"], b["opt_state"], c["argument_bytes"],
                               c["temp_bytes"], c["peak_bytes"])]


def offload_row() -> list[str]:
  b, c = zero(3, True)["bytes_per_device"], zero(3, True)["compiled"]
  opt = b["opt_state"]  # in host memory; XLA:CPU's memory_analysis counts it with the device's
  return [r(v / 1e6) for v in (b["params"], b["grads"], opt, c["argument_bytes"] - opt,
                               c["temp_bytes"], c["peak_bytes"] - opt)]


def startup(case: str) -> list[str]:
  c = ref("startup")["cases"][case]
  q, span = c["ratios"], c["ratio_ranges"]
  return [r(q["restart_compile_s_vs_cold"]), *map(r, span["restart_compile_s_vs_cold"]),
          r(q["restart_time_to_first_step_s_vs_cold"]),
          *map(r, span["restart_time_to_first_step_s_vs_cold"]),
          r(q["restart_startup_s_vs_cold"]), r(q["new_run_compile_s_vs_cold"]),
          r(q["new_run_time_to_first_step_s_vs_cold"]), r(q["new_run_startup_s_vs_cold"])]


def ms(s: float) -> str:
  return r(s * 1e3, 0)


def kernel(forms, side) -> list[str]:
  rates = [row[f][side] for row in ref("kernel_rates")["matmul_gflops"] for f in forms]
  return [r(min(rates), 0), r(max(rates), 0)]


def block() -> dict:
  k = ref("kernel_rates")
  return {side: {"products": sum(k["block_products_s"][side].values()),
                 "block": k["block_s"][side]["forward_backward"]} for side in ("jax", "torch")}


def packing_row(layout: str) -> list[str]:
  p = ref("packing")[layout]
  return [comma(p["windows"]), r(100 * p["padding_share"], 1), comma(p["real_tokens_per_sec"]),
          comma(p["answer_tokens_per_sec"])]


def vs_pytorch() -> list[str]:
  v, off = ref("vs_pytorch"), ref("vs_pytorch_host_malloc_off")
  return [r(v["ratio"]), *map(r, v["ratio_spread"]), r(v["ratio_cpu"]),
          comma(v["tokens_per_s"]["jaxpar"]["median"]), comma(v["tokens_per_s"]["torch"]["median"]),
          r(off["ratio"]), *map(r, off["ratio_spread"])]


def phases() -> list[str]:
  p = ref("vs_pytorch")["phases_s"]
  j, t = p["jaxpar"], p["torch"]
  return [ms(j["forward"]), ms(t["forward"]), ms(j["forward_backward"]),
          ms(t["forward_backward"]), ms(j["forward_backward"] - j["forward"]),
          ms(t["forward_backward"] - t["forward"])]


def step_at_target() -> list[str]:
  """The step 1.2x torch's tokens/s allows, the 4 blocks' products and the rest of their work."""
  v, jax = ref("vs_pytorch"), block()["jax"]
  step = v["tokens_per_step"] / v["tokens_per_s"]["torch"]["median"] / v["target"]
  products = 4 * jax["products"]
  return [ms(step), ms(products), r(jax["products"] * 1e3, 1), ms(step - products),
          ms(4 * (jax["block"] - jax["products"])), r((jax["block"] - jax["products"]) * 1e3, 1)]


def step_times() -> list[str]:
  v = ref("vs_pytorch")
  step = lambda side: v["tokens_per_step"] / v["tokens_per_s"][side]["median"]
  return [ms(step("torch") / v["target"]), ms(step("jaxpar"))]


def block_times() -> list[str]:
  b = block()
  return [r(x * 1e3, 1) for s in ("jax", "torch")
          for x in (b[s]["block"], b[s]["block"] - b[s]["products"])]


def longest() -> list[str]:
  lo = ref("context_parallel")["longest"]
  by = lo["by_context"]
  return [r(lo["budget_bytes"] / MiB, 0), str(by["1"]["max_seq_len"]),
          str(same(by["2"]["max_seq_len"], by["4"]["max_seq_len"])), str(by["4"]["next_seq_len"]),
          r(by["4"]["next_peak_bytes"] / MiB, 1), str(by["8"]["max_seq_len"])]


def ring_temps() -> list[str]:
  out = [r(ctx("context_parallel", 1)["temp_bytes"] / MiB, 0)]
  for C in (2, 4, 8):
    m = ctx("context_parallel", C)
    out += [r(m["temp_bytes"] / MiB, 0), r(m["temp_ratio_to_first"])]
  return out


def allgather() -> list[str]:
  name = "context_parallel_allgather"
  sent = lambda m: (m["all_gather_bytes"] + m["reduce_scatter_bytes"]) / MiB
  return ([r(sent(ctx(name, C)), 0) for C in (2, 4, 8)]
          + [r(ctx(name, C)["temp_ratio_to_first"]) for C in (2, 4, 8)]
          + [r(speed(name, 4096, C)) for C in (2, 4, 8)])


def matmul_form() -> list[str]:
  return ([r(long_ctx("matmul", 1024) / MiB, 0)]
          + [r(long_ctx("matmul", T) / GiB, 1) for T in (2048, 4096, 8192)]
          + doubling("blockwise") + doubling("matmul"))


def jax_versions() -> list[str]:
  j = ref("jax_versions")
  return [r(j["cases"][case]["ratio_b_over_a"][key])
          for key in ("tokens_per_sec", "compile_s") for case in ("fsdp", "data_tensor")
          ] + [str(j["pairs"])]


def generation() -> list[str]:
  g = ref("generate")
  return [r(g["load_average_1min"]["before"], 0), comma(g["tokens_per_s"]["cached"]["best"]),
          comma(g["tokens_per_s"]["uncached"]["best"]), r(g["ratio"], 1), r(g["ratio_median"], 1),
          r(g["ratio_cpu"], 1)]


def moe_ratios() -> list[str]:
  return [r(ref("moe")["cases"][m][k]) for m in ("1x1x1", "8x1x1")
          for k in ("moe_over_dense", "moe_capacity_over_dense")]


def moe_row(mesh: str) -> list[str]:
  c = ref("moe")["cases"][mesh]
  med = c["median_tokens_per_sec"]
  return [comma(med["dense"]), comma(med["moe"]), r(c["moe_over_dense"], 3),
          comma(med["moe_capacity"]), r(c["moe_capacity_over_dense"], 3)]


def vs_maxtext_row(name: str) -> list[str]:
  """A layout's row of docs/performance.md's MaxText table: tokens/s of each side, the ratio,
  per CPU second, compile s, compiled MiB per device, all-to-all MiB per step and the other
  collectives' MiB per step of each side."""
  lay = ref("vs_maxtext")["layouts"][name]
  j, m = lay["jaxpar"], lay["maxtext"]
  other = [sum(v for k, v in s["collectives"].items() if k != "all-to-all") / MiB for s in (j, m)]
  return [comma(j["tokens_per_sec"]), comma(m["tokens_per_sec"]), r(lay["ratio_tokens_per_sec"]),
          r(lay["ratio_tokens_per_cpu_s"]), r(j["compile_s"], 1), r(m["compile_s"], 1),
          r(j["memory"]["bytes"] / MiB, 1), r(m["memory"]["bytes"] / MiB, 1),
          r(j["collectives"]["all-to-all"] / MiB, 2), r(m["collectives"]["all-to-all"] / MiB, 2),
          r(other[0], 1), r(other[1], 1)]


def vs_maxtext_ratios(*names: str) -> list[str]:
  """jaxpar / MaxText tokens per CPU second of the named layouts, then tokens/s (wall clock)."""
  return [r(ref("vs_maxtext")["layouts"][n][k]) for k in ("ratio_tokens_per_cpu_s",
                                                         "ratio_tokens_per_sec") for n in names]


def vs_maxtext_spread() -> list[str]:
  """The most a side's runs of one layout differ, max / min: tokens/s, then per CPU second."""
  lays = ref("vs_maxtext")["layouts"].values()
  return [r(max(max(x[k] for x in rs) / min(x[k] for x in rs)
                for lay in lays for rs in lay["runs"].values()), 1)
          for k in ("tokens_per_sec", "tokens_per_cpu_s")]


# the MaxText table's rows (docs/performance.md): layout, its first cell
VS_MAXTEXT = [("one_device_dense", "dense, one device"), ("one_device_moe", "MoE, one device"),
              ("fsdp", "dense, FSDP 8"), ("data_tensor", "dense, data 4 x tensor 2"),
              ("pipeline", "dense, data 2 x pipeline 4"), ("experts_8", "MoE, experts 8"),
              ("experts_tensor", "MoE, experts 4 x tensor 2")]


def peak(stage: int) -> str:
  return r(zero(stage)["compiled"]["peak_bytes"] / 1e6)


TABLE_ROW = "| {} MB | {} MB | {} MB | {} MB | {} MB | {} MB |"
C248 = (2, 4, 8)

# (document, the phrase it quotes with {} for each figure, the figures from their one source)
QUOTED = [
    # packing instruction records (benchmarks/packing.py)
    ("README.md", "{}% of the windows' tokens are padding where one record a window pads {}%",
     lambda: [r(100 * ref("packing")[k]["padding_share"], 1) for k in ("packed", "one_per_window")]),
    ("docs/fine-tune-data.md", "| one record a window | {} | {}% | {} | {} |",
     lambda: packing_row("one_per_window")),
    ("docs/fine-tune-data.md", "| packed | {} | {}% | {} | {} |", lambda: packing_row("packed")),
    # the README's feature table
    ("README.md", "peak per device {} MB at stage 0, {} MB at stage 3", lambda: [peak(0), peak(3)]),
    ("README.md", "temporaries at M = 16 on 1x1x4: GPipe {} MiB, 1F1B {} MiB",
     lambda: [r(pipe("gpipe", 16), 1), r(pipe("1f1b", 16), 1)]),
    ("README.md", "{} MiB of temporaries at T 8192 where the matmul form needs {} GiB",
     lambda: [r(long_ctx("blockwise", 8192) / MiB, 0), r(long_ctx("matmul", 8192) / GiB, 1)]),
    ("README.md", "temporaries at T 4096: {} MiB at C = 1, {} MiB at C = 8",
     lambda: [r(ctx("context_parallel", C)["temp_bytes"] / MiB, 0) for C in (1, 8)]),
    ("README.md", "{}x the tokens/s of JAX 0.10.2 on 8x1x1 ZeRO-3 (", lambda: jax_versions()[:1]),
    ("README.md", "the load: {} alternating pairs", lambda: jax_versions()[4:5]),
    ("README.md", "a restart's compile {}x of a cold start's",
     lambda: [r(ref("startup")["cases"]["default"]["ratios"]["restart_compile_s_vs_cold"])]),
    ("README.md", "{}x the full recompute's tokens/s", lambda: generation()[3:4]),
    ("README.md", "{} of HF transformers + torch's tokens/s", lambda: vs_pytorch()[:1]),
    ("README.md", "8 experts top-2 at {}x (dropless) and {}x (capacity factor 1.25) the tokens/s "
     "of the dense model of the same active parameters on one CPU device, {}x and {}x on 8 with "
     "the experts split", lambda: moe_ratios()),
    ("README.md", "{}x, {}x and {}x MaxText 0.2.5's tokens per CPU second on one device, experts "
     "8 and experts 4 x tensor 2 (by the wall clock {}x, {}x and {}x", lambda: vs_maxtext_ratios(
         "one_device_moe", "experts_8", "experts_tensor")),
    ("README.md", "{}x (one device), {}x (FSDP 8), {}x (data 4 x tensor 2) and {}x (data 2 x "
     "pipeline 4) MaxText 0.2.5's tokens per CPU second (by the wall clock {}x, {}x, {}x and {}x",
     lambda: vs_maxtext_ratios("one_device_dense", "fsdp", "data_tensor", "pipeline")),
    ("README.md", "a side's two runs differ up to {}x by the wall clock, {}x per CPU second",
     vs_maxtext_spread),
    ("docs/moe.md", "| 1x1x1 (one CPU device) | {} | {} | {}x | {} | {}x |",
     lambda: moe_row("1x1x1")),
    ("docs/moe.md", "| 8x1x1 (8 simulated devices, one expert each) | {} | {} | {}x | {} | {}x |",
     lambda: moe_row("8x1x1")),
    # memory: plan.py's compiled steps (docs/images/zero_memory.json)
    *[("docs/memory.md", f"| {stage} " + TABLE_ROW, lambda stage=stage: zero_row(stage))
      for stage in range(4)],
    ("docs/memory.md", "| 3 + `parallel.offload_optimizer` | {} MB | {} MB | {} MB in host memory "
     "| {} MB on the device | {} MB | {} MB on the device |", offload_row),
    ("docs/memory.md", "its figure for the offload row is {} MB",
     lambda: [r(zero(3, True)["compiled"]["peak_bytes"] / 1e6)]),
    # pipeline schedules
    ("docs/parallelism.md", "| M | {} → {} → {} MiB |",
     lambda: [r(pipe("gpipe", m), 1) for m in (4, 8, 16)]),
    ("docs/parallelism.md", "| ≤ P (buffers of P+1 slots) | {} → {} → {} MiB |",
     lambda: [r(pipe("1f1b", m), 1) for m in (4, 8, 16)]),
    ("docs/parallelism.md", "| V·M | {} → {} → {} MiB |",
     lambda: [r(pipe("circular", m), 1) for m in (4, 8, 16)]),
    # long context
    *[("docs/long-context.md", f"| {T} | {{}} MiB | {{}} {unit} | {{}}x |",
       lambda i=i, T=T: [r(long_ctx("blockwise", T) / MiB, 0), matmul_form()[i],
                    r(ref("long_context")["speed"][i]["speedup_wall"], 1)])
      for i, (T, unit) in enumerate([(1024, "MiB"), (2048, "GiB"), (4096, "GiB")])],
    ("docs/long-context.md", "| 8192 | {} MiB | {} GiB | |",
     lambda: [r(long_ctx("blockwise", 8192) / MiB, 0), matmul_form()[3]]),
    ("docs/long-context.md", "({}-{}x per doubling against {}-{}x.)", lambda: matmul_form()[4:]),
    ("docs/long-context.md", "| 1 | 0 | {} MiB |", lambda: ring_temps()[:1]),
    *[("docs/long-context.md", f"| {C} | {{}} MiB | {{}} MiB (x{{}}) |",
       lambda i=i, C=C: [r(ctx("context_parallel", C)["collective_permute_bytes"] / MiB, 0)]
       + ring_temps()[1 + 2 * i:3 + 2 * i]) for i, C in enumerate(C248)],
    ("docs/long-context.md", "The ring at T 4096, batch {} ", lambda: [str(ref("context_parallel")["batch"])]),
    ("docs/long-context.md", "Against a {} MiB budget per device (compiled peak) the longest T is "
     "{} at C = 1, {} at C = 2 and 4 ({} needs {} MiB there), {} at C = 8", longest),
    ("docs/long-context.md", "reports a {} MiB peak, `--mesh 1x1x1x4` {} MiB",
     lambda: [r(ctx("context_parallel", C)["peak_bytes"] / MiB, 0) for C in (1, 4)]),
    *[("docs/long-context.md", f"| {C} | {{}} MiB | {{}}x | {{}}x |",
       lambda i=i: allgather()[i::3]) for i, C in enumerate(C248)],
    *[("docs/long-context.md", f"| {T} | {{}}x | {{}}x | {{}}x |",
       lambda T=T: [r(speed("context_parallel", T, C)) for C in C248]) for T in (1024, 4096, 8192)],
    # speed
    ("docs/performance.md", "**{}** (per window {}–{}; {} per CPU second), jaxpar {} tokens/s, "
     "torch {}; with `JAXPAR_HOST_MALLOC=off` {} ({}–{})", vs_pytorch),
    ("docs/performance.md", "Forward alone: jaxpar {} ms, torch {}; forward and backward {} vs {} "
     "ms, so jaxpar's forward is the faster and its backward ({} vs {} ms) the slower", phases),
    ("docs/performance.md", "At 1.2× torch the step would take {} ms instead of {}", step_times),
    ("docs/performance.md", "at {}–{} GFLOP/s forward (`NN`) and as data gradients (`NT`) against "
     "torch's {}–{}, and as weight gradients (`TN`) at {}–{} against {}–{}",
     lambda: kernel(["NN", "NT"], "jax") + kernel(["NN", "NT"], "torch")
     + kernel(["TN"], "jax") + kernel(["TN"], "torch")),
    ("docs/performance.md", "one block's six weight products take {} ms forward and backward "
     "against torch's {}", lambda: [r(block()[s]["products"] * 1e3, 1) for s in ("jax", "torch")]),
    ("docs/performance.md", "jaxpar's block takes {} ms forward and backward, so {} ms besides the "
     "products, torch's {}, so {} ms", block_times),
    ("docs/performance.md", "At 1.2× torch the step has {} ms; its products alone need {} (4 × {}), "
     "which leaves {} ms for the {} ms (4 × {})", step_at_target),
    # generation, restarts
    ("docs/generation.md", "load average {} from other work | {} tokens/s | {} tokens/s | {}x (median "
     "{}x; {}x per CPU-second", generation),
    ("docs/checkpoints.md", "| 2-core CPU, 2026-12-06, load {}-{} |",
     lambda: [r(ref("startup")["load_average_at_start"][0], 1),
              r(ref("startup")["load_average_at_end"][0], 1)]),
    ("docs/checkpoints.md", "| default, 2x4x1 ZeRO-3 | restart | {}x ({}-{}x) | {}x ({}-{}x) | {}x |",
     lambda: startup("default")[:7]),
    ("docs/checkpoints.md", "| default, 2x4x1 ZeRO-3 | new workdir | {}x | {}x | {}x |",
     lambda: startup("default")[7:]),
    ("docs/checkpoints.md", "| `configs/gpt_medium.yaml`, 8x1x1, batch 8 | restart | {}x ({}-{}x) | "
     "{}x ({}-{}x) | {}x |", lambda: startup("gpt_medium")[:7]),
    ("docs/checkpoints.md", "| `configs/gpt_medium.yaml`, 8x1x1, batch 8 | new workdir (initialises "
     "its state) | {}x | {}x | {}x |", lambda: startup("gpt_medium")[7:]),
    ("docs/checkpoints.md", "| what (AMD EPYC 2-core, 2026-12-07, load {}-{}) |",
     lambda: [r(ref("startup_mac_check")[f"load_average_at_{w}"][0], 1) for w in ("start", "end")]),
    ("docs/checkpoints.md", "| JAX's programs the runs left | {} ({} MB) | {} ({} MB) |",
     lambda: [v for i in (0, 1) for v in (mac_check(0, "entries")[i], mac_check(2, "MB")[i])]),
    ("docs/checkpoints.md", "| their MAC check, every one (CPU time) | {} ms | {} ms |",
     lambda: mac_check(2, "ms")),
    ("docs/checkpoints.md", "| against the restart's start-up | {} s: {}% | {} s: {}% |",
     lambda: [v for i in (0, 1) for v in (mac_check(1, "s")[i], mac_check(3, "%")[i])]),
    ("docs/checkpoints.md", "under 1 ms for all of JAX's programs a restart loads ({} and {} ms",
     lambda: mac_check(1, "ms")),
    # jaxpar against MaxText 0.2.5 (benchmarks/vs_maxtext.py)
    *[("docs/performance.md", f"| {label} | {{}} | {{}} | {{}} | **{{}}** | {{}} / {{}} | {{}} / {{}} | "
       "{} / {} | {} / {} |", lambda n=name: vs_maxtext_row(n)) for name, label in VS_MAXTEXT],
    ("docs/performance.md", "load average {} at the start, {} at the end; {} minutes in all",
     lambda: [r(ref("vs_maxtext")["load_average_at_start"][0], 1),
              r(ref("vs_maxtext")["load_average_at_end"][0], 1),
              r(ref("vs_maxtext")["wall_s"] / 60, 1)]),
    ("docs/performance.md", "differ by up to {}x in tokens/s here; the JSON holds every run and "
     "every step); per CPU second by at most {}x", vs_maxtext_spread),
    ("docs/moe.md", "jaxpar's mixture runs at {}x MaxText's tokens/s on one device, {}x with the "
     "experts split 8 ways and {}x with experts 4 x tensor 2 ({}x, {}x and {}x per CPU second)",
     lambda: [r(ref("vs_maxtext")["layouts"][n][k])
              for k in ("ratio_tokens_per_sec", "ratio_tokens_per_cpu_s")
              for n in ("one_device_moe", "experts_8", "experts_tensor")]),
]


def mac_check(digits: int, what: str) -> list[str]:
  """The startup benchmark's check of JAX's programs (default, gpt_medium): its CPU ms, the
  programs' count or MB, the check's share of the restart's startup_s (%), or that startup_s."""
  out = []
  for case in ("default", "gpt_medium"):
    c = ref("startup_mac_check")["cases"][case]
    jax_, startup_s = c["mac_check"]["jax"], c["runs"]["restart"]["startup_s"]
    out.append({"ms": lambda: r(jax_["check_cpu_s"] * 1e3, digits),
                "entries": lambda: str(jax_["entries"]),
                "MB": lambda: r(jax_["bytes"] / 1e6, digits),
                "%": lambda: r(jax_["check_cpu_s"] / startup_s * 100, digits),
                "s": lambda: r(startup_s, digits)}[what]())
  return out


def flat(text: str) -> str:
  return " ".join(text.split())  # a phrase may wrap across lines


@pytest.mark.parametrize("doc,phrase,values", QUOTED, ids=[f"{d}:{p[:40]}" for d, p, _ in QUOTED])
def test_each_quoted_figure_equals_its_source(doc, phrase, values):
  expected = phrase.format(*values())
  text = flat((ROOT / doc).read_text())
  assert expected in text, f"{doc} should quote {expected!r} (its source's figures, rounded)"


def figures():
  spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_every_figure_is_committed_with_its_data_and_shown_in_a_guide():
  guides = " ".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
  for name in figures().FIGURES:
    for ext in ("png", "json"):
      assert (ROOT / "docs" / "images" / f"{name}.{ext}").is_file(), f"{name}.{ext}: run docs/figures.py"
    assert f"](images/{name}.png)" in guides, f"no guide shows docs/images/{name}.png"


def test_the_schedule_chart_is_the_executed_tables():
  drawn, now = image("pipeline_schedules"), figures().schedule_data()
  assert drawn.keys() == now.keys() and drawn["schedules"].keys() == now["schedules"].keys()
  for name, row in now["schedules"].items():
    assert np.array_equal(drawn["schedules"][name]["actions"], row["actions"]), name
    assert drawn["schedules"][name] == row, name


def test_the_peers_chart_is_the_reference_json():
  assert image("peers") == figures().peers_data()


def test_the_context_chart_agrees_with_the_benchmarks_where_they_overlap():
  """The figure's compiled peaks and temporaries at T 4096 are context_parallel.json's, and its
  C = 1 temporaries long_context.json's blockwise ones (same model, batch and compiler)."""
  d = image("context_memory")
  assert d["batch"] == ref("context_parallel")["batch"] == ref("long_context")["batch"]
  T = d["seq_lens"]
  for C, row in d["by_context"].items():
    if 4096 in T and C in ref("context_parallel")["memory"]["by_context"]:
      bench = ctx("context_parallel", int(C))
      assert row["peak_bytes"][T.index(4096)] == bench["peak_bytes"], C
      assert row["temp_bytes"][T.index(4096)] == bench["temp_bytes"], C
  for t, temp in zip(T, d["by_context"]["1"]["temp_bytes"]):
    if str(t) in ref("long_context")["memory"]["blockwise"]["temp_bytes"]:
      assert temp == long_ctx("blockwise", t), t
