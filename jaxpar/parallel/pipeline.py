"""Pipeline schedules as data, and the executor that runs them inside one compiled step.

A schedule is a table `actions[tick, stage] = (kind, microbatch, chunk)` with kind IDLE, FWD or BWD.
It is built and checked in Python (dependencies, one action per stage per tick, bounded buffers),
so it can be printed, tested and its bubble counted; the executor runs the same table under one
`lax.scan` over ticks inside a `shard_map` that is manual over `pipeline`. Activations move to the
next stage and cotangents to the previous one with `ppermute`.

- gpipe: all forwards, then all backwards in reverse (the classic flush schedule).
- 1f1b: stage s runs at most P - s forwards ahead of its backwards, then alternates one forward
  and one backward; a backward recomputes its stage's forward from the stashed input (`jax.vjp`),
  so a stage holds at most P microbatches' inputs whatever M is.
- circular: V chunks per device; microbatches go round the ring V times (GPipe order per chunk
  pass), bubble (P-1)/(V·M+P-1) counted in forward slots.

Bubble fraction = idle stage-slots / all stage-slots of the executed table, where forward and
backward slots are counted alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ConfigError
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import zero

IDLE, FWD, BWD = 0, 1, 2
PIPE = jmesh.PIPE


@dataclasses.dataclass(frozen=True)
class Schedule:
  """actions: int32 [ticks, stages, 3] = (kind, microbatch, chunk); buffer sizes for the executor."""
  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  actions: np.ndarray
  slots: int  # ring-buffer slots for stashed inputs / received activations / received cotangents

  @property
  def ticks(self) -> int:
    return int(self.actions.shape[0])

  @property
  def bubble_fraction(self) -> float:
    return float(np.mean(self.actions[..., 0] == IDLE))

  def chart(self) -> str:
    """A stage x tick chart: F3 = forward of microbatch 3, B3 = backward, . = idle."""
    rows = []
    for s in range(self.stages):
      cells = []
      for t in range(self.ticks):
        k, i, c = self.actions[t, s]
        tag = "." if k == IDLE else ("F" if k == FWD else "B") + str(i)
        if k != IDLE and self.virtual_stages > 1:
          tag += f"/{c}"
        cells.append(f"{tag:>5}" if self.virtual_stages > 1 else f"{tag:>4}")
      rows.append(f"stage {s}: " + "".join(cells))
    return "\n".join(rows)


def _table(ops: dict[int, list[tuple[int, int, int]]], stages: int) -> np.ndarray:
  """Per-stage op lists in time order (tick, kind, mb, chunk) -> dense [ticks, stages, 3]."""
  ticks = 1 + max(t for s in ops for (t, *_rest) in ops[s])
  a = np.zeros((ticks, stages, 3), np.int32)
  for s, lst in ops.items():
    for t, k, i, c in lst:
      assert a[t, s, 0] == IDLE, "two actions at one tick"
      a[t, s] = (k, i, c)
  return a


def _simulate(P: int, M: int, V: int, limit: Callable[[int], int], order: str) -> np.ndarray:
  """Greedy list scheduling with data dependencies; one action per stage per tick.

  F(i, c) at stage s needs F(i, c) of the previous stage in an earlier tick (for chunk c > 0 at
  stage 0: F(i, c-1) at stage P-1); B(i, c) needs B(i, c) of the next stage (or, at the very last
  chunk of the last stage, this microbatch's forward there). `limit(s)` caps the microbatches a
  stage has started forward but not finished backward. `order`: 'gpipe' runs all forwards first.
  """
  chunks = V
  fwd_done: dict[tuple[int, int, int], int] = {}  # (stage, mb, chunk) -> tick
  bwd_done: dict[tuple[int, int, int], int] = {}
  # forward units in order per stage: chunk-major so microbatches go round the ring together
  f_queue = {s: [(i, c) for c in range(chunks) for i in range(M)] for s in range(P)}
  b_queue = {s: [(i, c) for c in reversed(range(chunks)) for i in range(M)] for s in range(P)}
  ops = {s: [] for s in range(P)}
  in_flight = {s: 0 for s in range(P)}
  t = 0
  while any(b_queue.values()):
    if t > 4 * (M * chunks + P) * 2 + 10:
      raise RuntimeError("pipeline schedule did not converge")
    for s in range(P):
      def f_ready(i, c):
        if s == 0 and c == 0:
          return True
        prev = (s - 1, i, c) if s > 0 else (P - 1, i, c - 1)
        return fwd_done.get(prev, t) < t

      def b_ready(i, c):
        if (s, i, c) not in fwd_done or fwd_done[(s, i, c)] >= t:
          return False
        if s == P - 1 and c == chunks - 1:
          return True
        nxt = (s + 1, i, c) if s < P - 1 else (0, i, c + 1)
        return bwd_done.get(nxt, t) < t
      do = None
      fq, bq = f_queue[s], b_queue[s]
      want_f = fq and f_ready(*fq[0]) and (order != "1f1b" or in_flight[s] < limit(s))
      want_b = bq and b_ready(*bq[0])
      if order == "gpipe":
        do = "F" if fq and want_f else ("B" if not fq and want_b else None)
      else:  # 1f1b: backward first whenever one is ready
        do = "B" if want_b else ("F" if want_f else None)
      if do == "F":
        i, c = fq.pop(0)
        fwd_done[(s, i, c)] = t
        ops[s].append((t, FWD, i, c))
        in_flight[s] += 1
      elif do == "B":
        i, c = bq.pop(0)
        bwd_done[(s, i, c)] = t
        ops[s].append((t, BWD, i, c))
        in_flight[s] -= 1
    t += 1
  return _table(ops, P)


def _slots_needed(a: np.ndarray, P: int, V: int) -> int:
  """Largest number of microbatch-chunks a stage holds at once (stash, received, cotangents)."""
  T = a.shape[0]
  need = 1
  for s in range(P):
    live = set()
    for t in range(T):
      k, i, c = a[t, s]
      if k == FWD:
        live.add((i, c))
      elif k == BWD:
        live.discard((i, c))
      need = max(need, len(live) + 1)
  return need


def build(name: str, P: int, M: int, V: int = 1) -> Schedule:
  """The table for `name` on P stages, M microbatches, V chunks per stage (circular)."""
  if name == "gpipe":
    a, V = _simulate(P, M, 1, lambda s: M, "gpipe"), 1
  elif name == "1f1b":
    a, V = _simulate(P, M, 1, lambda s: P - s, "1f1b"), 1
  elif name == "circular":
    if V < 1:
      raise ConfigError(f"parallel.virtual_stages={V} must be at least 1")
    if V > 1 and M % P:
      raise ConfigError(f"circular schedule: parallel.microbatches={M} must be a multiple of "
                        f"the pipeline degree {P}")
    a = _simulate(P, M, V, lambda s: M * V, "gpipe")
  else:
    raise ConfigError(f"parallel.schedule={name!r} is not one of gpipe, circular, 1f1b")
  return Schedule(name, P, M, V, a, _fit_slots(a, P, M, V, _slots_needed(a, P, V)))


def forward_bubble(P: int, M: int, V: int = 1) -> float:
  """The textbook bubble (P-1)/(V·M+P-1), for comparison with the executed table's."""
  return (P - 1) / (V * M + P - 1)


def _slot_map_ok(a: np.ndarray, P: int, M: int, V: int, K: int) -> bool:
  """True if ring buffers of K slots, slot = (chunk·M + mb) mod K, never overwrite a live entry.

  Simulates the three buffers of every stage: stashed inputs (FWD -> BWD), received activations
  (sender's FWD -> own FWD) and received cotangents (sender's BWD -> own BWD).
  """
  T = a.shape[0]
  slot = lambda i, c: (c * M + i) % K
  stash = [dict() for _ in range(P)]
  recv_f = [dict() for _ in range(P)]
  recv_b = [dict() for _ in range(P)]

  def put(buf, key):
    k = slot(*key)
    if k in buf and buf[k] != key:
      return False
    buf[k] = key
    return True
  for t in range(T):
    for s in range(P):  # consume, then produce, as the executor does within a tick
      k, i, c = a[t, s]
      if k == FWD:
        if not (s == 0 and c == 0):
          recv_f[s].pop(slot(i, c), None)
        if not put(stash[s], (i, c)):
          return False
      elif k == BWD:
        stash[s].pop(slot(i, c), None)
        if not (s == P - 1 and c == V - 1):
          recv_b[s].pop(slot(i, c), None)
    for s in range(P):  # messages sent at tick t land at the end of tick t
      k, i, c = a[t, s]
      if k == FWD and not (s == P - 1 and c == V - 1):
        dst, dc = (s + 1) % P, c + (1 if s == P - 1 else 0)
        if not put(recv_f[dst], (i, dc)):
          return False
      if k == BWD and not (s == 0 and c == 0):
        dst, dc = (s - 1) % P, c - (1 if s == 0 else 0)
        if not put(recv_b[dst], (i, dc)):
          return False
  return True


def _fit_slots(a: np.ndarray, P: int, M: int, V: int, start: int) -> int:
  for K in range(start, M * V + 1):
    if _slot_map_ok(a, P, M, V, K):
      return K
  return M * V


def execute(sched: Schedule, layers, top, micro, embed_fn, stage_fn, loss_fn, loss_scale=1.0,
            forward_only=False, aux_weights: dict | None = None):
  """Runs `sched` inside a shard_map manual over `pipeline`; returns ((loss, metrics), layer grads,
  top grads).

  layers: this stage's layers, leaves [V·Lc, ...] (chunk c = rows c·Lc ...); top: the parameters
  used outside the layers (replicated over stages); micro: batch leaves [M, b, ...].
  embed_fn(top, mb) -> x (b, T, D); stage_fn(chunk_layers, x, mb) -> x (mb: the microbatch x
  belongs to, e.g. for its packed documents' segment ids); loss_fn(top, x, mb) -> (mean
  loss, dict of float32 scalar metrics). The loss and each metric are means over microbatches
  (returned as one pair); gradients are of that loss times `loss_scale`: the
  scale seeds each microbatch's cotangent, so a float16 backward carries scaled values all the way
  (the caller divides it out). Top grads are summed over stages here, so every stage returns the
  full gradient of the replicated parameters.

  With `forward_only` (evaluation) the table's backward slots idle, the last chunk's stage adds
  each microbatch's loss as its forward completes, and no gradients are made (both None).

  With `aux_weights` ({name: weight}, e.g. a mixture's router losses) stage_fn returns
  (x, {name: float32 scalar}), each a mean over the chunk's layers. The metrics then hold each
  name's mean over all layers (every chunk of every stage) and microbatches, and the gradients
  are of loss + sum(weight x that mean): a chunk's backward seeds its scalars' cotangents with
  their weights, so no stage waits for another's. The loss returned stays loss_fn's alone.
  """
  P, M, V, K = sched.stages, sched.microbatches, sched.virtual_stages, sched.slots
  s = jax.lax.axis_index(PIPE)
  actions = jnp.asarray(sched.actions)
  take = lambda tree, i: jax.tree_util.tree_map(lambda x: x[i], tree)
  # chunk c: each leaf's c-th of V row blocks (a stack's leaves may differ in length: stack.Parts)
  chunk = lambda c: jax.tree_util.tree_map(
      lambda x: jax.lax.dynamic_slice_in_dim(x, c * (x.shape[0] // V), x.shape[0] // V, 0), layers)
  x_shape = jax.eval_shape(embed_fn, top, take(micro, 0))
  zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
  zeros_like = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)
  slot = lambda i, c: (c * M + i) % K
  scored = jax.eval_shape(loss_fn, top, x_shape, take(micro, 0))  # (loss, metrics)
  no_score = lambda: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), scored)
  add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)
  names = tuple(aux_weights or ())
  # a chunk's scalars -> its share of the means over all P·V chunks and M microbatches
  share = lambda aux: {k: aux[k] / (M * P * V) for k in names}
  run = stage_fn if names else lambda ch, x, mb: (stage_fn(ch, x, mb), {})
  seed = {k: jnp.float32(aux_weights[k] * loss_scale / (M * P * V)) for k in names}

  def fwd(carry, i, c):
    stash, recv_f, recv_b, g_layers, g_top, (loss, acc) = carry
    x = jax.lax.cond((s == 0) & (c == 0), lambda: embed_fn(top, take(micro, i)),
                     lambda: recv_f[slot(i, c)])
    y, aux = run(chunk(c), x, take(micro, i))
    if forward_only:  # nothing to stash for a backward; the last chunk's output is scored now
      l = jax.lax.cond((s == P - 1) & (c == V - 1),
                       lambda: jax.tree_util.tree_map(lambda v: v / M,
                                                      loss_fn(top, y, take(micro, i))), no_score)
      return (stash, recv_f, recv_b, g_layers, g_top, (add(loss, l), add(acc, share(aux)))), y, \
          zeros_x
    return (stash.at[slot(i, c)].set(x), recv_f, recv_b, g_layers, g_top, (loss, acc)), y, zeros_x

  def bwd(carry, i, c):
    stash, recv_f, recv_b, g_layers, g_top, (loss, acc) = carry
    mb = take(micro, i)
    (y, aux), vjp = jax.vjp(lambda ch, x: run(ch, x, mb), chunk(c), stash[slot(i, c)])

    def from_loss():
      def scaled(t, y):
        l, metrics = loss_fn(t, y, mb)
        return l * (loss_scale / M), (l / M, jax.tree_util.tree_map(lambda v: v / M, metrics))
      (_, l), (d_top, dy) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(top, y)
      return l, d_top, dy
    last = (s == P - 1) & (c == V - 1)
    l, d_top, dy = jax.lax.cond(last, from_loss,
                                lambda: (no_score(), zeros_like(top), recv_b[slot(i, c)]))
    d_chunk, dx = vjp((dy.astype(y.dtype), seed))
    g_layers = jax.tree_util.tree_map(
        lambda g, d: jax.lax.dynamic_update_slice_in_dim(
            g, jax.lax.dynamic_slice_in_dim(g, c * d.shape[0], d.shape[0], 0) + d,
            c * d.shape[0], 0), g_layers, d_chunk)
    first = (s == 0) & (c == 0)
    d_embed = jax.lax.cond(first, lambda: jax.vjp(lambda t: embed_fn(t, mb), top)[1](dx)[0],
                           lambda: zeros_like(top))
    g_top = jax.tree_util.tree_map(lambda a, b, e: a + b + e, g_top, d_top, d_embed)
    return (stash, recv_f, recv_b, g_layers, g_top, (add(loss, l), add(acc, share(aux)))), \
        zeros_x, dx

  def idle(carry, i, c):
    return carry, zeros_x, zeros_x

  def tick(carry, t):
    kind, i, c = actions[t, s, 0], actions[t, s, 1], actions[t, s, 2]
    carry, y, dx = jax.lax.switch(kind, [idle, fwd, idle if forward_only else bwd], carry, i, c)
    y_in = jax.lax.ppermute(y, PIPE, [(j, (j + 1) % P) for j in range(P)])
    dx_in = jax.lax.ppermute(dx, PIPE, [(j, (j - 1) % P) for j in range(P)])
    stash, recv_f, recv_b, g_layers, g_top, loss = carry
    pk, pi, pc = actions[t, (s - 1) % P, 0], actions[t, (s - 1) % P, 1], actions[t, (s - 1) % P, 2]
    sent_f = (pk == FWD) & ~((s == 0) & (pc == V - 1))  # the last chunk's output went to the loss
    dc = pc + jnp.where(s == 0, 1, 0)
    recv_f = jax.lax.cond(sent_f, lambda: recv_f.at[slot(pi, dc)].set(y_in), lambda: recv_f)
    nk, ni, nc = actions[t, (s + 1) % P, 0], actions[t, (s + 1) % P, 1], actions[t, (s + 1) % P, 2]
    sent_b = (nk == BWD) & ~((s == P - 1) & (nc == 0))  # chunk 0 of stage 0 feeds the embedding
    dc = nc - jnp.where(s == P - 1, 1, 0)
    recv_b = jax.lax.cond(sent_b, lambda: recv_b.at[slot(ni, dc)].set(dx_in), lambda: recv_b)
    return (stash, recv_f, recv_b, g_layers, g_top, loss), None

  buf = jnp.zeros((K,) + x_shape.shape, x_shape.dtype)
  scores = (no_score(), {k: jnp.zeros((), jnp.float32) for k in names})
  if forward_only:  # no gradient accumulators, no stash
    init = (jnp.zeros((0,) + x_shape.shape, x_shape.dtype), buf, buf, None, None, scores)
  else:
    init = (buf, buf, buf, zeros_like(layers), zeros_like(top), scores)
  (_, _, _, g_layers, g_top, scores), _ = jax.lax.scan(tick, init, jnp.arange(sched.ticks))
  (loss, metrics), acc = jax.lax.psum(scores, PIPE)
  out = (loss, {**metrics, **acc})
  if forward_only:
    return out, None, None
  g_top = jax.tree_util.tree_map(zero.in_float32(lambda g: jax.lax.psum(g, PIPE)), g_top)
  return out, g_layers, g_top


# -- layer order of the circular schedule ---------------------------------------------------------
# The circular schedule runs chunk c (layers c·Lc ...) on stage c mod P, while the `pipeline`
# sharding gives each stage one contiguous block of the stack. So for circular the state keeps
# the stack in stage order (stage s's block holds chunks s, s+P, s+2P, ...) and checkpoints,
# which hold the model's own order, are converted on the way out and in.

def layer_order(sched: Schedule | None, n_layers: int) -> np.ndarray | None:
  """order[q] = the model's layer stored at row q of the state's stack (None = identity)."""
  if sched is None or sched.virtual_stages == 1:
    return None
  P, V = sched.stages, sched.virtual_stages
  Lc = n_layers // (P * V)
  chunks = [v * P + s for s in range(P) for v in range(V)]
  return np.concatenate([np.arange(c * Lc, (c + 1) * Lc) for c in chunks])


def is_stacked(path, x, n: int) -> bool:
  """Whether leaf `x` at `path` is a layer stack of `n` rows (under a 'layers' key)."""
  under = any(getattr(k, "key", None) == "layers" for k in path)
  return under and bool(np.ndim(x)) and np.shape(x)[0] == n


def reorder(tree: Any, order: np.ndarray | None) -> Any:
  """Rows of every leaf under a 'layers' key taken in `order` (params and optimizer moments)."""
  if order is None:
    return tree
  one = lambda path, x: x[order] if is_stacked(path, x, len(order)) else x
  return jax.tree_util.tree_map_with_path(one, tree)


def stage_rows(sched: Schedule, inverse: bool) -> Callable:
  """x (L, ...) -> x[layer_order] (inverse: x[argsort(layer_order)]), inside a jit.

  Chunk v·P + s of the model's order is slot v of stage s in the state's, so the reorder is a
  transpose of the (V, P) grid of chunks: GSPMD makes it an all-to-all over `pipeline` where
  the grid's blocks line up with the stages (V a multiple of P or P of V), where a gather by
  `layer_order` all-gathers the whole stack onto every stage first.
  """
  P, V = sched.stages, sched.virtual_stages
  grid = (P, V) if inverse else (V, P)
  return lambda x: x.reshape(grid + (-1,) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def in_stage_order(tree: Any, sched: Schedule | None, n_layers: int, inverse: bool = False) -> Any:
  """Every layer stack of `tree` (parameters, moments) in the state's order (inverse: the
  model's), inside a jit."""
  if layer_order(sched, n_layers) is None:
    return tree
  rows = stage_rows(sched, inverse)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: rows(x) if is_stacked(path, x, n_layers) else x, tree)
