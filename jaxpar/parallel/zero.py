"""ZeRO stages 0-3 and optimizer offload, as a transformation of the rules' PartitionSpecs.

Stage 0 replicates everything over `data` (DDP). Stage 1 shards optimizer state, stage 2 also
gradients, stage 3 also parameters. A leaf is sharded over `data` on its largest dimension that
the rules left free and that `data` divides; the scanned `layers` axis is never chosen, because
the layer scan slices it and each device must hold its slice of every layer.

Offload keeps the optimizer state in host memory (`pinned_host`) and updates it a piece at a time
(`offloaded_update`), so the device never holds more than one piece of it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh

DATA = jmesh.DATA
HOST = "pinned_host"
# Name of every all-gathered parameter: `regather`'s checkpoint policy does not save these, so the
# backward re-gathers a layer instead of keeping the whole stack unsharded until then.
GATHERED = "zero3_gathered"
# The ZeRO dim of a leaf the rules themselves split over `data` (a mixture's experts, rules.py):
# each device owns its slice at every stage, so nothing gathers it, and its gradient arrives
# already summed over the data shards by the transpose of the all-to-alls that fed it
# (parallel/expert.py): the step divides it by the shard count and reduces nothing.
OWNED = -2


def zero_dim(shape, spec: P, logical, mesh_shape) -> int:
  """The dimension that gets `data` (largest free, divisible), or -1 if there is none (`OWNED`
  where the rules already split one over `data`).

  A dimension whose mesh axes all have size 1 counts as free: `model` of size 1 splits nothing.
  """
  n_data = mesh_shape[DATA]
  if n_data == 1:
    return -1
  if any(DATA in ((a,) if isinstance(a, str) else a or ()) for a in spec):
    return OWNED
  best = -1
  for i, dim in enumerate(shape):
    axes = spec[i] if i < len(spec) else None
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    taken = any(mesh_shape[a] > 1 for a in names)
    if taken or (logical and logical[i] in ("layers", "rank")) or dim % n_data:
      continue
    if best < 0 or dim > shape[best]:
      best = i
  return best


def add_data(spec: P, ndim: int, dim: int) -> P:
  """`spec` with `data` on dimension `dim` (unchanged when dim < 0)."""
  if dim < 0:
    return spec
  parts = list(spec) + [None] * (ndim - len(spec))
  parts[dim] = DATA
  return P(*parts)


@dataclass(frozen=True)
class Layout:
  """PartitionSpecs of params, grads and (per param leaf) optimizer state, plus the ZeRO dims.

  `dims` holds, per parameter, the dimension that `data` shards (-1: the leaf stays replicated);
  `param_dims` is `dims` where stage 3 shards parameters, else None.
  """
  params: Any
  grads: Any
  opt: Any
  dims: Any
  param_dims: Any | None
  stage: int


def layout(abstract: Any, specs: Any, logical: Any, mesh, stage: int) -> Layout:
  """Shardings of params / grads / optimizer state for a ZeRO stage, from the rules' specs."""
  is_spec = lambda x: isinstance(x, P)
  dims = jax.tree_util.tree_map(
      lambda a, s, l: zero_dim(a.shape, s, l, mesh.shape), abstract, specs, logical,
      is_leaf=lambda x: isinstance(x, tuple) and not is_spec(x))
  sharded = jax.tree_util.tree_map(
      lambda a, s, d: add_data(s, len(a.shape), d), abstract, specs, dims,
      is_leaf=is_spec)
  pick = lambda on: sharded if on else specs
  return Layout(params=pick(stage >= 3), grads=pick(stage >= 2), opt=pick(stage >= 1),
                dims=dims, param_dims=dims if stage >= 3 else None, stage=stage)


def opt_state_specs(opt_abstract: Any, params_abstract: Any, param_opt_specs: Any) -> Any:
  """Specs for an optax state: leaves shaped like a parameter follow it, the rest replicate.

  optax states hold per-parameter trees (mu, nu) beside scalars (count); matching by tree
  structure keeps this independent of which optax transformations are chained. A per-parameter
  tree may leave parameters out as empty subtrees (optax.masked's and multi_transform's
  MaskedNode): those hold nothing, and the others still follow their parameters. A leaf whose
  shape is not its parameter's (a factored moment) replicates.
  """
  params_def = jax.tree_util.tree_structure(params_abstract)
  shapes = [tuple(a.shape) for a in jax.tree_util.tree_leaves(params_abstract)]
  param_specs = jax.tree_util.tree_leaves(param_opt_specs, is_leaf=lambda x: isinstance(x, P))
  empty = lambda sub: not jax.tree_util.tree_leaves(sub)

  def parts(x):  # x's subtree at each parameter's place, or None when x is no per-parameter tree
    if params_def.num_leaves == 0 or jax.tree_util.treedef_is_leaf(params_def):
      return None
    try:
      subs = params_def.flatten_up_to(x)
    except (ValueError, TypeError):
      return None
    ok = all(empty(sub) or hasattr(sub, "shape") for sub in subs) and not all(map(empty, subs))
    return subs if ok else None

  def one(x):
    subs = parts(x)
    if subs is None:
      return jax.tree_util.tree_map(lambda _: P(), x)
    return params_def.unflatten([
        sub if empty(sub) else spec if tuple(sub.shape) == shape else P()
        for sub, spec, shape in zip(subs, param_specs, shapes)])

  return jax.tree_util.tree_map(one, opt_abstract, is_leaf=lambda x: parts(x) is not None)


def named(mesh, specs: Any, memory_kind: str | None = None) -> Any:
  """PartitionSpecs -> NamedShardings on `mesh` (optionally in host memory)."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
                                specs, is_leaf=lambda x: isinstance(x, P))


# Stage 3 on the CPU gathers a layer's weights in few all-gathers instead of one per weight:
# XLA:CPU combines no collectives, and each one is a rendezvous of every simulated device's thread
# on the host's few cores (on the 2-core machine, FSDP 8 of the vs_maxtext model: 21 all-gathers
# and 12 reduce-scatters a step -> 3 and 2, 1.09x -> 1.25x MaxText's tokens/s). A combined gather
# holds its leaves twice for a moment (the gathered rows, then each leaf cut out of them), so each
# carries at most COMBINE_BYTES of gathered weights: where a layer is larger, its leaves' bytes
# and not the rendezvous dominate the collectives' time anyway. XLA's GPU and TPU compilers combine
# collectives themselves: there each leaf keeps its own all-gather. Nor are leaves combined where
# another mesh axis splits them (`model`): flattening a split leaf would gather it over that axis.
# COMBINE: None picks by backend; True / False force that choice (tests).
COMBINE: bool | None = None
COMBINE_BYTES = 2 << 20


class Frozen(int):
  """The ZeRO dim of a frozen parameter (an int like any dim): `gather` keeps frozen leaves out
  of the trainable ones' combined all-gathers, so nothing runs backward for them (no
  reduce-scatter; a frozen embedding's lookup keeps no scatter-add gradient)."""


def mark_frozen(dims: Any | None, frozen: Any | None) -> Any | None:
  """`dims` with each frozen leaf's dim (a tree of bools, or None) made a `Frozen`."""
  if dims is None or frozen is None:
    return dims
  return jax.tree_util.tree_map(lambda d, f: Frozen(d) if f and d >= 0 else d, dims, frozen)


def combining() -> bool:
  """Whether `gather` combines leaves here: on the CPU (or as COMBINE forces), and only where
  every mesh axis the enclosing shard_map leaves automatic has size 1."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  if any(size > 1 for axis, size in mesh.shape.items() if axis not in manual):
    return False
  return jax.default_backend() == "cpu" if COMBINE is None else COMBINE


def gather(tree: Any, dims: Any | None) -> Any:
  """Inside a shard_map manual over `data`: all-gather each leaf along its ZeRO dim.

  Autodiff turns each all-gather into a reduce-scatter, so stage-3 gradients come out summed over
  `data` and already sharded. Where `combining()`, leaves of one dtype, frozen or not alike,
  share all-gathers of up to COMBINE_BYTES gathered (`_all_gather_many`), whose transposes are as
  many reduce-scatters.
  Results are named `GATHERED` (a no-op outside `regather`).
  """
  if dims is None:
    return tree
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  dleaves = treedef.flatten_up_to(dims)
  out = list(leaves)
  if all(d < 0 for d in dleaves):
    return tree
  n = jax.lax.axis_size(DATA)
  budget = COMBINE_BYTES if combining() else 0
  groups: dict = {}  # (dtype, frozen) -> [[leaf indices, gathered bytes], ...]: one all-gather each
  for i, (x, d) in enumerate(zip(leaves, dleaves)):
    if d < 0:
      continue
    size = n * x.size * jnp.dtype(x.dtype).itemsize
    bins = groups.setdefault((jnp.dtype(x.dtype), isinstance(d, Frozen)), [])
    if bins and bins[-1][1] + size <= budget:
      bins[-1][0].append(i)
      bins[-1][1] += size
    else:
      bins.append([[i], size])
  for bins in groups.values():
    for idx, _ in bins:
      gathered = _all_gather_many(tuple(leaves[i] for i in idx), tuple(dleaves[i] for i in idx))
      for i, g in zip(idx, gathered):
        out[i] = checkpoint_name(g, GATHERED)
  return treedef.unflatten(out)


def _rows(x, d):
  """x with dimension d first, as [n, -1] rows: row i is what device i holds of x."""
  n = jax.lax.axis_size(DATA)
  return jnp.moveaxis(x, d, 0).reshape(n, -1)


def _unrows(rows, shape, d):
  """The inverse of `_rows` for a leaf of `shape` (the whole leaf)."""
  moved = (shape[d],) + tuple(s for k, s in enumerate(shape) if k != d)
  return jnp.moveaxis(rows.reshape(moved), 0, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_gather_many(xs, dims):
  """all_gather over `data` of every leaf of `xs` along its dim in `dims`, as one collective of
  their concatenated shards; its transpose is one reduce-scatter, in float32 (in_float32)."""
  if len(xs) == 1:
    return (jax.lax.all_gather(xs[0], DATA, axis=dims[0], tiled=True),)
  n = jax.lax.axis_size(DATA)
  flat = jnp.concatenate([jnp.moveaxis(x, d, 0).reshape(-1) for x, d in zip(xs, dims)])
  rows = jax.lax.all_gather(flat, DATA, axis=0, tiled=False)  # [n, total]
  out, at = [], 0
  for x, d in zip(xs, dims):
    shape = list(x.shape)
    shape[d] *= n
    out.append(_unrows(rows[:, at:at + x.size], shape, d))
    at += x.size
  return tuple(out)


def _all_gather_many_fwd(xs, dims):
  return _all_gather_many(xs, dims), None


def _all_gather_many_bwd(dims, _, gs):
  if len(gs) == 1:
    return ((in_float32(lambda y: jax.lax.psum_scatter(
        y, DATA, scatter_dimension=dims[0], tiled=True))(gs[0]),),)
  dtype = gs[0].dtype
  rows = jnp.concatenate([_rows(g, d) for g, d in zip(gs, dims)], axis=1)
  mine = in_float32(lambda y: jax.lax.psum_scatter(y, DATA, scatter_dimension=0))(rows)
  out, at = [], 0
  for g, d in zip(gs, dims):
    local = list(g.shape)
    local[d] //= jax.lax.axis_size(DATA)
    moved = (local[d],) + tuple(s for k, s in enumerate(local) if k != d)
    size = math.prod(local)
    out.append(jnp.moveaxis(mine[at:at + size].reshape(moved), 0, d).astype(dtype))
    at += size
  return (tuple(out),)


_all_gather_many.defvjp(_all_gather_many_fwd, _all_gather_many_bwd)


def regather(fn):
  """`fn` (one scanned layer) under a checkpoint that keeps matmul outputs but not its gathered
  weights.

  Without it, autodiff through a layer scan keeps every layer's gathered weights as residuals, so
  the whole stack is unsharded on each device at the end of the forward; with it the backward
  all-gathers each layer again (one more all-gather of the parameters per step, as in the ZeRO
  paper). Matmul outputs and named values (the block's own checkpoints) are saved, so no matmul
  runs twice; what lies between them (casts and reshapes of the weights, norms, activation
  functions, softmax) is recomputed, as the block itself recomputes it without ZeRO-3. Saving
  everything but the weights instead kept those elementwise intermediates too: on the default
  model stage 3 then held more temporaries than stage 0.
  """
  return jax.checkpoint(fn, prevent_cse=False, policy=_save_dots_not_gathered)


def _save_dots_not_gathered(prim, *_, **params) -> bool:
  """Checkpoint policy: matmul outputs and named values other than `GATHERED` are saveable."""
  if prim.name == "name":
    return params.get("name") != GATHERED
  return prim.name == "dot_general"


def shift(dims: Any, by: int = -1) -> Any:
  """ZeRO dims of a stacked tree as seen by one slice of its leading axis."""
  if dims is None:
    return None
  return jax.tree_util.tree_map(lambda d: d if d < 0 else type(d)(d + by), dims)


def scatter_mean(grads: Any, dims: Any, scatter: bool) -> Any:
  """Inside a shard_map manual over `data`: mean of local grads over `data`.

  With `scatter`, leaves with a ZeRO dim are reduce-scattered onto it (ZeRO-2), the rest
  all-reduced; without, everything is all-reduced (DDP, ZeRO-1). `OWNED` leaves are only divided.
  """
  n = jax.lax.axis_size(DATA)

  def one(g, d):
    if d == OWNED:
      return g / n
    if scatter and d >= 0:
      return in_float32(lambda x: jax.lax.psum_scatter(x, DATA, scatter_dimension=d, tiled=True)
                        / n)(g)
    return in_float32(lambda x: jax.lax.psum(x, DATA) / n)(g)
  return jax.tree_util.tree_map(one, grads, dims)


def in_float32(reduce):
  """`reduce` (a sum over devices) run on a half-precision gradient in float32, the result cast
  back: a bfloat16 sum over many devices loses the small terms (XLA:CPU also aborts compiling a
  bfloat16 all-reduce of this step)."""
  def run(g):
    if jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits < 32:
      return reduce(g.astype(jnp.float32)).astype(g.dtype)
    return reduce(g)
  return run


# -- optimizer offload -----------------------------------------------------------------------------

def memory_kinds(device) -> set[str]:
  """The memory kinds `device` can place arrays in (CPU and GPU: device, pinned_host, ...)."""
  try:
    return {m.kind for m in device.addressable_memories()}
  except Exception:  # a backend without memory spaces
    return set()


def check_host_memory(mesh) -> None:
  """Raises ConfigError unless the mesh's devices can hold arrays in host memory (pinned_host)."""
  device = mesh.devices.flat[0]
  kinds = memory_kinds(device)
  if HOST not in kinds:
    have = ", ".join(sorted(kinds)) or "none"
    raise ConfigError(f"parallel.offload_optimizer=true needs {HOST} memory, which "
                      f"{device.platform} devices do not offer (memory kinds: {have}); "
                      "set parallel.offload_optimizer=false")


def offloaded_update(tx, grads: Any, opt: Any, params: Any, host: Any, device: Any,
                     keep=None, stream=None) -> tuple[Any, Any]:
  """(new params, new state) of one step of `tx` with its state `opt` in host memory.

  The state moves to the device one parameter's moments at a time: copied in, updated, and
  copied back to host memory before the next parameter's are copied in (optimization barriers
  order them), so the device holds one piece of the state instead of all of it. `tx` must treat
  leaves independently (Adam, weight decay, schedules: yes; global-norm clipping: apply it to
  `grads` first). Optimizer leaves not shaped like params (step counts) are scalars and move
  once. `host` / `device`: the state's shardings in each memory. `keep(new, old)`: applied to
  each leaf's state (skipped steps). grads, params and the new params are on the device.

  `stream[i]` true: parameter i is a layer stack (axis 0) that no mesh axis splits, and its
  moments come in one layer at a time, in a loop over axis 0 that slices the host stack (a
  host -> device copy of one layer) and writes the result back into it (a dynamic-update-slice
  into a host buffer the program was given, which XLA's host offloader streams). So the device
  holds one layer of the largest stacked leaf's moments, not the whole stack. Other leaves move
  whole.
  """
  p_leaves, p_def = jax.tree_util.tree_flatten(params)
  g_leaves = p_def.flatten_up_to(grads)
  stream = [False] * len(p_leaves) if stream is None else p_def.flatten_up_to(stream)
  is_ptree = lambda x: jax.tree_util.tree_structure(x) == p_def
  nodes, n_def = jax.tree_util.tree_flatten(opt, is_leaf=is_ptree)
  host_nodes, dev_nodes = n_def.flatten_up_to(host), n_def.flatten_up_to(device)
  moments = [k for k, n in enumerate(nodes) if is_ptree(n)]
  flat = lambda tree, k: p_def.flatten_up_to(tree[k])
  cur = {k: flat(nodes, k) for k in moments}  # each moment's leaves, in host memory
  small = {k: jax.device_put(nodes[k], dev_nodes[k]) for k in range(len(nodes)) if k not in moments}
  # The other leaves of each call are empty arrays: tx sees the whole tree (masks match) but
  # computes only leaf i.
  empty = [jnp.zeros((0,), x.dtype) for x in p_leaves]

  def view(i, x):
    return p_def.unflatten(empty[:i] + [x] + empty[i + 1:])

  def update(i, mine, g, p):
    """({moment: new value}, new param) of leaf i (or of one layer of it), all on the device."""
    state = n_def.unflatten([view(i, mine[k]) if k in mine else small[k] for k in range(len(nodes))])
    upd, new = tx.update(view(i, g), state, view(i, p))
    if keep is not None:
      new = keep(new, state)
    new_nodes = n_def.flatten_up_to(new)
    return {k: flat(new_nodes, k)[i] for k in moments}, optax.apply_updates(p, p_def.flatten_up_to(upd)[i])

  def layer(s: NamedSharding) -> NamedSharding:  # a stacked leaf's sharding without axis 0
    return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]), memory_kind=s.memory_kind)

  def one_leaf(i, mine):  # mine: {moment: host array} -> ({moment: new host array}, new param)
    if not stream[i]:
      old = {k: jax.device_put(x, flat(dev_nodes, k)[i]) for k, x in mine.items()}
      new, p = update(i, old, g_leaves[i], p_leaves[i])
      return {k: jax.device_put(x, flat(host_nodes, k)[i]) for k, x in new.items()}, p

    def body(l, carry):
      m, p_stack = carry
      at = lambda x: jax.lax.dynamic_index_in_dim(x, l, keepdims=False)
      put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, l, 0)
      old = {k: jax.device_put(at(x), layer(flat(dev_nodes, k)[i])) for k, x in m.items()}
      new, p = update(i, old, at(g_leaves[i]), at(p_stack))
      m = {k: put(m[k], jax.device_put(x, layer(flat(host_nodes, k)[i]))) for k, x in new.items()}
      return m, put(p_stack, p)
    return jax.lax.fori_loop(0, p_leaves[i].shape[0], body, (mine, p_leaves[i]))

  # Every call advances the counts alike; one call on empty leaves gives them.
  state = n_def.unflatten([p_def.unflatten(empty) if k in moments else small[k]
                           for k in range(len(nodes))])
  _, new = tx.update(p_def.unflatten(empty), state, p_def.unflatten(empty))
  new_small = n_def.flatten_up_to(new if keep is None else keep(new, state))

  new_params = list(p_leaves)
  for i in range(len(p_leaves)):
    mine = [cur[k][i] for k in moments]
    if i:  # leaf i comes in only once leaf i-1 is back on the host and applied
      *mine, back, new_params[i - 1] = jax.lax.optimization_barrier(
          mine + [[cur[k][i - 1] for k in moments], new_params[i - 1]])
      for k, x in zip(moments, back):
        cur[k][i - 1] = x
    new, new_params[i] = one_leaf(i, dict(zip(moments, mine)))
    for k in moments:
      cur[k][i] = new[k]
  new_nodes = [p_def.unflatten(cur[k]) if k in moments
               else jax.device_put(new_small[k], host_nodes[k]) for k in range(len(nodes))]
  return p_def.unflatten(new_params), n_def.unflatten(new_nodes)


def offloaded_map(fn, tree: Any, host: Any, device: Any, where) -> Any:
  """`fn` applied, inside a jit, to the leaves of `tree` (in host memory) that `where(path, x)`
  picks, each on a device copy with its `device` sharding, the result put back with its `host`
  sharding; the other leaves are returned as they are. `fn` keeps a leaf's shape.

  XLA computes only on device memory (a gather of a host array does not even trace), and one
  leaf at a time (optimization barriers order them, as in `offloaded_update`) keeps the device
  from holding the whole state, which offload exists to avoid.
  """
  leaves, tdef = jax.tree_util.tree_flatten_with_path(tree)
  host, device = tdef.flatten_up_to(host), tdef.flatten_up_to(device)
  out = [x for _, x in leaves]
  prev = None  # the index of the last leaf mapped
  for i, (path, x) in enumerate(leaves):
    if not where(path, x):
      continue
    if prev is not None:  # leaf i comes in only once leaf prev is back in host memory
      x, out[prev] = jax.lax.optimization_barrier((x, out[prev]))
    out[i] = jax.device_put(fn(jax.device_put(x, device[i])), host[i])
    prev = i
  return tdef.unflatten(out)


def stream_layers(abstract: Any, logical: Any, opt_specs: Any, mesh) -> Any:
  """Per parameter: whether its offloaded moments come to the device one layer at a time (a
  `layers` stack on axis 0 that no mesh axis of size > 1 splits, so not under a pipeline)."""
  leaves, tdef = jax.tree_util.tree_flatten(abstract)

  def one(names, spec):
    first = tuple(spec)[0] if len(tuple(spec)) else None
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return (bool(names) and len(names) > 1 and names[0] == "layers"
            and all(mesh.shape[a] == 1 for a in axes))
  return tdef.unflatten([one(n, s) for n, s in zip(tdef.flatten_up_to(logical),
                                                   tdef.flatten_up_to(opt_specs))])
