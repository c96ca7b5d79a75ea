"""Logical axis names -> mesh axes: the one table every strategy goes through.

Models name logical axes only (`batch, seq, embed, heads, kv, mlp, vocab, layers, expert`;
`rank`, a LoRA adapter's).
`RULES` maps them to mesh axes; Megatron tensor parallelism is the `heads`/`mlp`/`vocab` ->
`model` rows (column-parallel where the axis is a kernel's output, row-parallel where it is the
input); expert parallelism the `expert` -> `data` row.
Models without annotations are covered by ordered regex rules on parameter paths that yield
logical axes; first match wins, and a parameter no rule covers is an error.
"""
from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Iterable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv", "mlp", "vocab", "layers", "expert", "rank")

# logical axis -> mesh axis (None = replicated). Order matters only for readability.
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", jmesh.DATA),
    ("heads", jmesh.MODEL),  # q/k/v column-parallel, attention-out row-parallel
    ("mlp", jmesh.MODEL),  # MLP-in column-parallel, MLP-out row-parallel
    ("vocab", jmesh.MODEL),  # vocab-parallel embedding and LM head
    ("embed", None),
    ("kv", None),
    ("seq", None),
    ("layers", jmesh.PIPE),  # the scanned layer stack: stage s holds a contiguous block of layers
    # a mixture's experts: expert parallelism folded into data parallelism (Megatron, DeepSpeed):
    # each data replica holds n_experts / data of them, tokens reach them by all-to-all over
    # `data` (parallel/expert.py); the one parameter axis that may name `data` outside ZeRO
    ("expert", jmesh.DATA),
    ("rank", None),  # a LoRA adapter's rank (models/lora.py): never split, nor by ZeRO
)

Logical = tuple[str | None, ...]
Table = tuple[tuple[str, Any], ...]


def extended(rows: dict[str, Any] | Iterable[tuple[str, Any]], base: Iterable = RULES) -> Table:
  """`base` (jaxpar's table) with `rows` added, a row for a name already there replacing it:
  `extended({"hidden": "model"})` splits a model's `hidden` axis like `mlp`, and
  `extended({"mlp": None})` turns tensor parallelism off for the MLP. Pass it to
  `jaxpar.Trainer(..., rules=...)`."""
  new = dict(rows.items() if isinstance(rows, dict) else rows)
  out = [(k, new.pop(k) if k in new else v) for k, v in base]
  return check_table(tuple(out) + tuple(new.items()))


def check_table(table: Iterable) -> Table:
  """A rules table as a tuple of (logical name, mesh axis or None or a tuple of mesh axes); one
  sentence naming the first row that is not one."""
  try:
    rows = tuple((k, v) for k, v in table)
  except (TypeError, ValueError):
    raise ConfigError(f"rules must be (logical axis, mesh axis) pairs, got {table!r}") from None
  for name, axis in rows:
    axes = axis if isinstance(axis, tuple) else (axis,)
    if not isinstance(name, str) or not all(a is None or a in jmesh.AXES for a in axes):
      raise ConfigError(f"rule {(name, axis)!r}: a rule maps a logical axis name to one of the "
                        f"mesh axes {', '.join(jmesh.AXES)}, a tuple of them, or None")
  names = [k for k, _ in rows]
  if len(set(names)) < len(names):
    twice = next(k for k in names if names.count(k) > 1)
    raise ConfigError(f"rules give the logical axis {twice!r} two rows; keep one")
  return rows


def rules_for(sequence_parallel: bool = False, base: Iterable = RULES) -> Table:
  """The table for a parallel config; sequence parallel shards `seq` activations over `model`."""
  base = tuple(base)
  if not sequence_parallel:
    return base
  return tuple((k, jmesh.MODEL) if k == "seq" else (k, v) for k, v in base)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_rules", default=RULES)


@contextlib.contextmanager
def use(rules):
  """Makes `rules` the table that activation constraints (`constrain`, `is_split`) read while a
  step is traced: the trainer's choice (e.g. sequence parallel) reaches the model this way."""
  token = _ACTIVE.set(tuple(rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def to_mesh(logical: Logical, rules=None) -> P:
  """('batch', 'seq', 'embed') -> P('data', None, None). Unknown names are an error.

  A mesh axis splits one dimension only: where `seq` and another axis of the same tensor both map
  to it (sequence parallel, inside attention or at the logits), the other one keeps it.
  """
  table = dict(_ACTIVE.get() if rules is None else rules)
  out = []
  for name in logical:
    if name is None:
      out.append(None)
    elif name in table:
      out.append(table[name])
    else:
      raise ValueError(f"logical axis {name!r} has no rule (known: {', '.join(table)})")
  for i, name in enumerate(logical):
    if name == "seq" and out[i] is not None and sum(a == out[i] for a in out) > 1:
      out[i] = None
  return P(*out)


def path_str(path) -> str:
  """A jax key path as 'a/b/c' (what the regex rules match against)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(p for p in parts if p != "value")


def match_path(path: str, shape: Sequence[int], path_rules: Iterable[tuple[str, Logical]]) -> Logical:
  """First regex (re.search) that matches `path` gives its logical axes; none is an error."""
  for pattern, logical in path_rules:
    if re.search(pattern, path):
      if len(logical) != len(shape):
        raise ValueError(f"rule {pattern!r} gives {len(logical)} axes {logical} to parameter "
                         f"{path} of shape {tuple(shape)}")
      return tuple(logical)
  raise ValueError(f"no partition rule covers parameter {path} of shape {tuple(shape)}; "
                   f"annotate it with logical axes or add a (regex, axes) rule for it")


def check_divisible(path: str, shape: Sequence[int], spec: P, mesh) -> None:
  """Each sharded dimension must divide evenly by the product of its mesh axes."""
  for dim, axes in zip(shape, spec):
    if axes is None:
      continue
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for a in names:
      size *= mesh.shape[a]
    if dim % size:
      raise ConfigError(f"parameter {path} of shape {tuple(shape)}: dimension {dim} is not "
                        f"divisible by {'x'.join(names)}={size}")


def param_specs(abstract: Any, logical: Any, mesh, rules=RULES) -> Any:
  """Trees of ShapeDtypeStruct and logical axes -> tree of mesh PartitionSpecs, checked."""
  def one(path, leaf, axes):
    unknown = [a for a in axes if a is not None and a not in dict(rules)]
    if unknown:
      raise ConfigError(f"parameter {path_str(path)} has the logical axis {unknown[0]!r}, which no "
                        f"rule maps to the mesh (known: {', '.join(k for k, _ in rules)}); add "
                        f"one, e.g. jaxpar.Trainer(..., rules=jaxpar.rules.extended("
                        f"{{{unknown[0]!r}: 'model'}}))")
    spec = to_mesh(axes, rules)
    used = [a for a in spec if a is not None]
    if len(set(used)) < len(used):
      raise ConfigError(f"parameter {path_str(path)} has logical axes {tuple(axes)}, which put "
                        f"one mesh axis on two of its dimensions ({spec}); give one of them a "
                        f"logical axis that is not split the same way (e.g. 'embed')")
    data_split = [n for a, name in zip(spec, axes) if a is not None and name != "expert"
                  for n in (a if isinstance(a, tuple) else (a,))]
    if jmesh.DATA in data_split:
      raise ConfigError(f"parameter {path_str(path)} has logical axes {tuple(axes)}, which split "
                        f"it over the mesh axis 'data' ({spec}); parameters are split over data "
                        f"only by ZeRO (parallel.zero_stage) and a mixture's 'expert' axis, so "
                        f"give that dimension a logical axis the rules do not map to data (e.g. "
                        f"'embed' or None)")
    check_divisible(path_str(path), leaf.shape, spec, mesh)
    return spec
  return jax.tree_util.tree_map_with_path(one, abstract, logical,
                                          is_leaf=lambda x: isinstance(x, tuple))


def axis_of(logical: str, rules=None):
  """The mesh axis (or axes, or None) the active table maps `logical` to."""
  return dict(_ACTIVE.get() if rules is None else rules).get(logical)


def is_split(logical: str, rules=None) -> bool:
  """True when the mesh in context splits the logical axis `logical` over more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  axis = dict(_ACTIVE.get() if rules is None else rules).get(logical)
  return not mesh.empty and axis in mesh.axis_names and mesh.shape[axis] > 1


def constrain(x: jax.Array, logical: Logical, rules=None, manual: frozenset = frozenset()) -> jax.Array:
  """Activation sharding constraint by logical names, for jaxpar's models and a user's alike.

  Inside a `shard_map` that is manual over some axes (the trainer's step is manual over `data`),
  those axes are already split by hand, so the constraint speaks only of the automatic ones: the
  mesh's manual axes and those in `manual` are left out.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  manual = frozenset(manual) | frozenset(mesh.manual_axes)

  def auto(a):
    names = tuple(n for n in ((a,) if isinstance(a, str) else a or ()) if n not in manual)
    return None if not names else names[0] if len(names) == 1 else names
  return jax.lax.with_sharding_constraint(x, P(*(auto(a) for a in to_mesh(logical, rules))))
