"""Facts read from a compiled XLA program: bytes moved by collectives, FLOPs and memory.

`collective_bytes` parses the text of the optimized HLO (`compiled.as_text()`), so it sees what
XLA actually runs after SPMD partitioning, combining and async conversion, and it needs no device.
`collectives` lists the same collectives one by one, with every array of each one's result.

Counting rules of `collective_bytes`:
- A collective's bytes are the size of its result buffer(s) on one device; tuple results are summed.
- Async pairs count once, at the `-done` op, whose result is exactly the collective's output on
  every backend. The `-start` results differ by kind and carry extra buffers, so they are skipped:
  `all-reduce-start` = output, `all-gather-start` = (operand, output),
  `collective-permute-start` = (operand, output[, u32[], u32[] | token[]]),
  `reduce-scatter-start` / `all-to-all-start` = ((operands), output). Generic unsugared
  `async-start(...), calls=%c` is counted through the collective inside `%c`.
- XLA:GPU may decompose a pipelined collective-permute into send/recv; a `recv-done` that is not a
  host transfer counts as collective-permute with its received array (tokens are 0 bytes).
  `ragged-all-to-all` counts as all-to-all.
- Ops in a while body run trip-count times (the condition trip-count + 1 times); nested loops
  multiply. The trip count comes from XLA's `known_trip_count` annotation, else from the loop
  shape `i = init; while i <cmp> constant; i += step`; when neither is readable the loop counts once
  (a lower bound).
- A conditional counts, for each kind, the maximum over its branches (an upper bound per kind,
  since only one branch runs).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# Bits per element; packed sub-byte types round up per array.
_ELEMENT_BITS = {
  "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
  "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
  "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "tf32": 32,
  "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8,
  "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
  "token": 0, "opaque": 0,
}

_SYNC_KIND = {k: k for k in KINDS}
_SYNC_KIND["ragged-all-to-all"] = "all-to-all"
_DONE_KIND = {k + "-done": v for k, v in _SYNC_KIND.items()}

_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(-?\d+)')
_INIT_STEP = re.compile(
  r'known_init_step\\?"\s*:\s*\{\s*\\?"init\\?"\s*:\s*\\?"(-?\d+)\\?"\s*,'
  r'\s*\\?"step\\?"\s*:\s*\\?"(-?\d+)')
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPERAND = re.compile(r"%?([\w.\-]+)\s*$")


@dataclass
class _Instr:
  name: str
  shape: str  # result shape text, layouts included
  opcode: str
  operands: list[str]  # operand instruction names
  attrs: str  # text after the operand list, quoted strings blanked
  raw: str  # the whole line, for backend_config


@dataclass
class _Computation:
  name: str
  instrs: dict[str, _Instr] = field(default_factory=dict)
  root: str | None = None


def _matching(text: str, start: int) -> int:
  """Index just past the bracket closing the one at text[start]; len(text) if unbalanced."""
  depth = 0
  pairs = {"(": ")", "{": "}", "[": "]"}
  closers = set(pairs.values())
  for i in range(start, len(text)):
    ch = text[i]
    if ch in pairs:
      depth += 1
    elif ch in closers:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _split_top(text: str) -> list[str]:
  """Splits at commas that are not inside brackets."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


def _strip_comments(text: str) -> str:
  return re.sub(r"/\*.*?\*/", "", text)


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dims) of each array in an HLO shape text, a tuple's elements in order; a
  bounded dynamic dim (`<=16`) is its bound, an unbounded one (`?`) 0."""
  out = []
  for dtype, dims in _ARRAY.findall(_strip_comments(shape)):
    sizes = []
    for d in dims.split(","):
      d = d.strip().lstrip("<=")
      if d:
        sizes.append(int(d) if d.isdigit() else 0)
    out.append((dtype, tuple(sizes)))
  return out


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape text such as `f32[8,128]{1,0}` or `(bf16[4], s32[])`, tuples summed."""
  total = 0
  for dtype, dims in _arrays(shape):
    bits = _ELEMENT_BITS.get(dtype)
    if bits is None:
      # Types newer than the table spell their width first: f8e4m3..., s4, u16.
      width = re.match(r"[a-z]+?(\d+)", dtype)
      if width is None:
        raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
      bits = int(width.group(1))
    total += (math.prod(dims) * bits + 7) // 8
  return total


def _parse_instr(body: str) -> tuple[str, str, list[str], str] | None:
  """(shape, opcode, operand names, attrs) of the text right of `name = `."""
  body = body.strip()
  if body.startswith("("):
    end = _matching(body, 0)
  else:
    m = re.match(r"[a-z][a-z0-9]*\[[^\]]*\](\{[^}]*\})?", body)
    if not m:
      return None
    end = m.end()
  shape, rest = body[:end], body[end:].lstrip()
  m = re.match(r"([a-z][\w\-]*)\(", rest)
  if not m:
    return None
  opcode = m.group(1)
  close = _matching(rest, m.end() - 1)
  operands = []
  for part in _split_top(rest[m.end():close - 1]):
    om = _OPERAND.search(part.strip())
    # Constants and iotas print literals, not operand names.
    if om and not re.fullmatch(r"-?[\d.e+\-]+|true|false|inf|-inf|nan", om.group(1)):
      operands.append(om.group(1))
  attrs = _STRING.sub('""', rest[close:])
  return shape, opcode, operands, attrs


def _parse_module(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
  """Computations by name and the ENTRY computation's name."""
  comps: dict[str, _Computation] = {}
  entry = None
  cur: _Computation | None = None
  pending = ""
  for line in hlo_text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m and not line.lstrip().startswith("HloModule"):
        cur = _Computation(m.group(2))
        comps[cur.name] = cur
        if m.group(1):
          entry = cur.name
      continue
    if line.strip() == "}" or line.startswith("}"):
      cur = None
      pending = ""
      continue
    # Hand-written HLO may wrap one instruction over several lines.
    text = (pending + " " + line.strip()) if pending else line
    if not _INSTR.match(text):
      continue
    unquoted = _STRING.sub('""', text)
    if unquoted.count("(") > unquoted.count(")"):
      pending = text
      continue
    pending = ""
    m = _INSTR.match(text)
    parsed = _parse_instr(m.group(3))
    if parsed is None:
      continue
    shape, opcode, operands, attrs = parsed
    ins = _Instr(m.group(2), shape, opcode, operands, attrs, text)
    cur.instrs[ins.name] = ins
    if m.group(1):
      cur.root = ins.name
  return comps, entry


def _callees(attrs: str, key: str) -> list[str]:
  m = re.search(r"\b" + key + r"=\s*(\{[^}]*\}|%?[\w.\-]+)", attrs)
  if not m:
    return []
  val = m.group(1).strip("{}")
  return [v.strip().lstrip("%") for v in val.split(",") if v.strip()]


def _int_constant(comp: _Computation, ref: str | int, depth: int = 0) -> int | None:
  """Value of a scalar integer constant (a name in `comp`, or an int), through copies/converts."""
  if isinstance(ref, int):
    return ref
  ins = comp.instrs.get(ref)
  if ins is None or depth > 8:
    return None
  if ins.opcode == "constant":
    m = re.search(r"constant\((-?\d+)\)", ins.raw)
    return int(m.group(1)) if m else None
  if ins.opcode in ("copy", "convert", "bitcast", "reshape") and ins.operands:
    return _int_constant(comp, ins.operands[0], depth + 1)
  return None


def _tuple_index(comp: _Computation, ref: str | int) -> int | None:
  """k when `ref` names get-tuple-element(parameter, index=k) of this computation."""
  ins = comp.instrs.get(ref) if isinstance(ref, str) else None
  if ins is None or ins.opcode != "get-tuple-element" or not ins.operands:
    return None
  src = comp.instrs.get(ins.operands[0])
  if src is None or src.opcode != "parameter":
    return None
  m = re.search(r"index=(\d+)", ins.attrs)
  return int(m.group(1)) if m else None


def _resolve_op(comps: dict[str, _Computation], comp: _Computation, name: str,
                opcodes: tuple[str, ...]) -> tuple[str, list[str | int]] | None:
  """(opcode, operands) of `name` if its opcode is in `opcodes`, looking into a fusion's root.

  Operands are names in `comp` (fusion parameters mapped back to the fusion's operands) or ints
  for integer constants folded into the fusion; XLA:CPU wraps a loop's compare and add this way.
  """
  ins = comp.instrs.get(name)
  if ins is None:
    return None
  if ins.opcode in opcodes:
    return ins.opcode, list(ins.operands)
  if ins.opcode != "fusion":
    return None
  called = _callees(ins.attrs, "calls")
  inner = comps.get(called[0]) if called else None
  if inner is None or inner.root is None:
    return None
  root = inner.instrs[inner.root]
  if root.opcode not in opcodes:
    return None
  mapped: list[str | int] = []
  for op in root.operands:
    p = inner.instrs.get(op)
    is_param = p is not None and p.opcode == "parameter"
    m = re.search(r"parameter\((\d+)\)", p.raw) if is_param else None
    if m is not None and int(m.group(1)) < len(ins.operands):
      mapped.append(ins.operands[int(m.group(1))])
      continue
    value = _int_constant(inner, op)
    if value is None:
      return None
    mapped.append(value)
  return root.opcode, mapped


def _infer_trip_count(comps: dict[str, _Computation], caller: _Computation,
                      loop: _Instr) -> int | None:
  """Trip count of a while loop `i = init; while i <cmp> C: ...; i += step`, or None."""
  cond_names = _callees(loop.attrs, "condition")
  body_names = _callees(loop.attrs, "body")
  cond = comps.get(cond_names[0]) if cond_names else None
  body = comps.get(body_names[0]) if body_names else None
  if cond is None or body is None or cond.root is None or body.root is None:
    return None
  found = _resolve_op(comps, cond, cond.root, ("compare",))
  if found is None or len(found[1]) < 2:
    return None
  a, b = found[1][:2]
  dm = re.search(r"direction=(\w+)", cond.instrs[cond.root].attrs)
  if dm is None:
    # Fused compare: the direction is on the fusion's root.
    fused = comps.get((_callees(cond.instrs[cond.root].attrs, "calls") or [""])[0])
    if fused is not None and fused.root is not None:
      dm = re.search(r"direction=(\w+)", fused.instrs[fused.root].attrs)
  if dm is None:
    return None
  direction = dm.group(1)
  k, limit = _tuple_index(cond, a), _int_constant(cond, b)
  if k is None or limit is None:
    # `C <cmp> i` is `i <mirrored cmp> C`.
    k, limit = _tuple_index(cond, b), _int_constant(cond, a)
    direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
  if k is None or limit is None:
    return None

  init = step = None
  im = _INIT_STEP.search(loop.raw)
  if im:
    init, step = int(im.group(1)), int(im.group(2))
  else:
    state = caller.instrs.get(loop.operands[0]) if loop.operands else None
    if state is not None and state.opcode == "tuple" and k < len(state.operands):
      init = _int_constant(caller, state.operands[k])
    out = body.instrs[body.root]
    if out.opcode == "tuple" and k < len(out.operands):
      upd = _resolve_op(comps, body, out.operands[k], ("add", "subtract"))
      if upd is not None and len(upd[1]) >= 2:
        x, y = upd[1][:2]
        if _tuple_index(body, x) == k and _int_constant(body, y) is not None:
          step = _int_constant(body, y) * (-1 if upd[0] == "subtract" else 1)
        elif upd[0] == "add" and _tuple_index(body, y) == k:
          step = _int_constant(body, x)
  if init is None or not step:
    return None
  if direction == "LT" and step > 0:
    return max(0, -(-(limit - init) // step))
  if direction == "LE" and step > 0:
    return max(0, (limit - init) // step + 1)
  if direction == "GT" and step < 0:
    return max(0, -(-(init - limit) // -step))
  if direction == "GE" and step < 0:
    return max(0, (init - limit) // -step + 1)
  if direction == "NE" and (limit - init) % step == 0 and (limit - init) // step >= 0:
    return (limit - init) // step
  return None


def _trip_count(comps: dict[str, _Computation], caller: _Computation, loop: _Instr) -> int | None:
  m = _TRIP.search(loop.raw)
  if m:
    return int(m.group(1))
  return _infer_trip_count(comps, caller, loop)


def _kind(ins: _Instr) -> str | None:
  """The kind (one of KINDS) of a counted collective: a synchronous one, the -done of an async
  pair, or a recv-done that is not a host transfer; None for any other instruction (-start too)."""
  if ins.opcode in _SYNC_KIND:
    return _SYNC_KIND[ins.opcode]
  if ins.opcode in _DONE_KIND:
    return _DONE_KIND[ins.opcode]
  if ins.opcode == "recv-done" and "is_host_transfer=true" not in ins.attrs:
    return "collective-permute"
  return None


def _own_bytes(ins: _Instr) -> tuple[str, int] | None:
  """(kind, bytes) that this instruction itself contributes, if it is a counted collective."""
  kind = _kind(ins)
  return None if kind is None else (kind, shape_bytes(ins.shape))


_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
# XLA's mesh form: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: groups along the axes
# named in braces
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _group_size(attrs: str, devices: int) -> int:
  """Devices in each replica group of a collective (`devices`, all of them, when not stated)."""
  m = _GROUPS_IOTA.search(attrs)
  if m:
    return int(m.group(2))
  m = _GROUPS_LIST.search(attrs)
  if m and m.group(1):
    return len(m.group(1).split(","))
  m = _GROUPS_MESH.search(attrs)
  if m:
    sizes = dict((k, int(v)) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    named = re.findall(r"'(\w+)'", m.group(2))
    if all(a in sizes for a in named) and ":" not in m.group(2):  # whole axes only
      return math.prod(sizes[a] for a in named)
  return devices


def _own_sent(comp: _Computation, ins: _Instr, devices: int) -> tuple[str, float] | None:
  """(kind, bytes one device sends) for a counted collective, by the ring algorithms over its
  group of n: an all-reduce of S bytes sends 2 (n-1)/n S, an all-gather of result S and an
  all-to-all (n-1)/n S, a reduce-scatter of result S (n-1) S, a permute S."""
  own = _own_bytes(ins)
  if own is None:
    return None
  kind, size = own
  start = ins
  if ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in comp.instrs:
    start = comp.instrs[ins.operands[0]]  # the async pair's groups are on its -start
  n = _group_size(start.attrs, devices)
  factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
            "reduce-scatter": float(n - 1)}.get(kind, 1.0)
  return kind, size * factor


def _computation_bytes(comps: dict[str, _Computation], name: str,
                       memo: dict[str, dict[str, int]], active: set[str],
                       loops: bool = True, own_fn=None) -> dict[str, int]:
  """Collective bytes of one execution of `name`; with `loops` False, while loops count 0.
  `own_fn(comp, ins)` -> (kind, bytes) counts an instruction (default: its result bytes)."""
  if name in memo:
    return memo[name]
  out = dict.fromkeys(KINDS, 0)
  comp = comps.get(name)
  if comp is None or name in active:
    return out
  active.add(name)

  def add(src: dict[str, int], times: int) -> None:
    for kk in KINDS:
      out[kk] += src[kk] * times

  for ins in comp.instrs.values():
    own = _own_bytes(ins) if own_fn is None else own_fn(comp, ins)
    if own is not None:
      out[own[0]] += own[1]
    op = ins.opcode
    if op == "while":
      if not loops:
        continue
      n = _trip_count(comps, comp, ins)
      # The condition runs once more than the body; an unreadable count is taken as one pass.
      body_times, cond_times = (1, 1) if n is None else (n, n + 1)
      for c in _callees(ins.attrs, "body"):
        add(_computation_bytes(comps, c, memo, active, loops, own_fn), body_times)
      for c in _callees(ins.attrs, "condition"):
        add(_computation_bytes(comps, c, memo, active, loops, own_fn), cond_times)
    elif op == "conditional":
      branches = (_callees(ins.attrs, "branch_computations")
                  or _callees(ins.attrs, "true_computation")
                  + _callees(ins.attrs, "false_computation"))
      per = [_computation_bytes(comps, c, memo, active, loops, own_fn) for c in branches]
      for kk in KINDS:
        out[kk] += max((p[kk] for p in per), default=0)
    elif op.endswith(("-start", "-update", "-done")):
      # Sugared async pairs count at their -done; a generic async-start is counted through the
      # collective it wraps, and its -update/-done are not walked, so each counts once.
      if op == "async-start":
        for c in _callees(ins.attrs, "calls"):
          add(_computation_bytes(comps, c, memo, active, loops, own_fn), 1)
    else:
      for key in ("calls", "to_apply", "called_computations"):
        for c in _callees(ins.attrs, key):
          add(_computation_bytes(comps, c, memo, active, loops, own_fn), 1)
  active.discard(name)
  memo[name] = out
  return out


def _module(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
  """(computations, the entry's name); a lone computation without an ENTRY marker (hand-written
  snippets) is its own entry, and no computation at all gives None."""
  comps, entry = _parse_module(hlo_text)
  if entry is None and comps:
    entry = list(comps)[-1]
  return comps, entry


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Per-device bytes per execution moved by each collective kind: {kind: int} over `KINDS`."""
  comps, entry = _module(hlo_text)
  if entry is None:
    return dict.fromkeys(KINDS, 0)
  return dict(_computation_bytes(comps, entry, {}, set()))


@dataclass(frozen=True)
class Collective:
  """One collective of a program (see `collectives`)."""
  kind: str  # one of KINDS
  arrays: tuple[tuple[str, tuple[int, ...]], ...]  # its result's arrays: (element type, dims);
  # one for an array result, each element of a tuple result (XLA's combined collectives)
  computation: str  # the computation it is in
  name: str  # the instruction that gives its result: the -done of an async pair


def collectives(hlo_text: str) -> Iterator[Collective]:
  """Each collective of an HLO module's text once, wherever it is (loops not multiplied): the ones
  `collective_bytes` counts, by the same rules (an async pair at its -done, a generic async-start
  through the collective in its computation, recv-done as collective-permute)."""
  comps, _ = _module(hlo_text)
  for comp in comps.values():
    for ins in comp.instrs.values():
      kind = _kind(ins)
      if kind is not None:
        yield Collective(kind, tuple(_arrays(ins.shape)), comp.name, ins.name)


_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def entry_parameters(hlo_text: str) -> list[tuple[str, int]]:
  """(name, bytes on one device) of each parameter of the entry computation, in parameter order:
  after SPMD partitioning a parameter's shape is its shard. The name is JAX's path of the
  argument (`state['params']['layers']['wq']`, its metadata op_name), "" where it gives none."""
  comps, entry = _module(hlo_text)
  out = []
  for ins in (comps[entry].instrs.values() if entry else ()):
    number = re.search(r"parameter\((\d+)\)", ins.raw)
    if ins.opcode == "parameter" and number:
      m = _OP_NAME.search(ins.raw)
      out.append((int(number.group(1)), m.group(1).replace("\\'", "'") if m else "",
                  shape_bytes(ins.shape)))
  return [(name, size) for _, name, size in sorted(out)]


def sent_bytes(hlo_text: str, devices: int) -> dict[str, float]:
  """Bytes one device sends per execution for each collective kind, by ring algorithms over each
  collective's own replica group (`_own_sent`); `devices`: the group of a collective that names
  none. A reduce-scatter then an all-gather send what one all-reduce does."""
  comps, entry = _module(hlo_text)
  if entry is None:
    return dict.fromkeys(KINDS, 0.0)
  return dict(_computation_bytes(comps, entry, {}, set(),
                                 own_fn=lambda comp, ins: _own_sent(comp, ins, devices)))


def collective_bytes_in_loops(hlo_text: str) -> dict[str, int]:
  """The part of `collective_bytes` that runs inside while loops: {kind: int} over `KINDS`.

  A collective that stays in its loop moves one slice per iteration (ZeRO-3's per-layer gathers);
  one hoisted out of the loop moves the same bytes at once, so only this split tells them apart.
  """
  comps, entry = _module(hlo_text)
  if entry is None:
    return dict.fromkeys(KINDS, 0)
  total = _computation_bytes(comps, entry, {}, set())
  outside = _computation_bytes(comps, entry, {}, set(), loops=False)
  return {k: total[k] - outside[k] for k in KINDS}


def instruction_count(hlo_text: str) -> int:
  """Instructions in an HLO module's text, every computation's body included (loops counted once).

  A program whose count does not change with the model's depth or the pipeline's microbatches
  keeps its layers and ticks in loops: nothing was unrolled.
  """
  return sum(len(c.instrs) for c in _parse_module(hlo_text)[0].values())


def flops(compiled: Any) -> float | None:
  """FLOPs of one execution on one device per XLA's cost analysis; None when unavailable.

  XLA's HloCostAnalysis counts each instruction once: on XLA:CPU (jax 0.10.2) a while body is NOT
  multiplied by its trip count (a 5-step fori_loop reports the flops of one step), so this
  undercounts programs with loops (scan over layers, grad accumulation). Collectives count one
  flop per reduced element. XLA omits zero-valued properties, so a report without 'flops' is 0.0.
  """
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends raise instead of returning nothing
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost:
    return None
  return float(cost.get("flops", 0.0))


def memory(compiled: Any) -> dict[str, int]:
  """Per-device buffer sizes of the compiled program in bytes; zeros when unavailable.

  `peak_bytes` is jaxpar's one definition of a step's peak memory per device, used by plan.py
  and by the run summary alike: arguments + outputs + temporaries - outputs aliased to (donated)
  arguments, i.e. every buffer the program may hold at once. XLA's own `peak_memory_in_bytes` is
  not reported: on XLA:CPU it counts only part of the temporaries.
  """
  keys = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
  }
  try:
    stats = compiled.memory_analysis()
  except Exception:  # some backends raise instead of returning nothing
    stats = None
  out = {}
  for key, attr in keys.items():
    v = getattr(stats, attr, None) if stats is not None else None
    out[key] = int(v) if v is not None else 0
  out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                       - out["alias_bytes"])
  return out
