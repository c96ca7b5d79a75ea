"""Train state, its shardings, sharded init and the compiled training step.

The gradient is computed inside a `shard_map` that is manual over `data` (and over `pipeline` when
there is one, and over `context` when the sequence is split): each data shard differentiates its
part of the batch and the gradients are then
reduced explicitly — all-reduce for ZeRO 0/1, reduce-scatter for ZeRO-2, and for ZeRO-3 the
reduce-scatter that autodiff makes of the per-layer all-gathers. With a pipeline, the schedule's
executor (pipeline.py) produces each stage's gradients. `model` stays automatic, so GSPMD
partitions the tensor-parallel matmuls inside. With a `context` axis the model's `seq_split`
lays the batch out along the sequence for ring attention (models/ring.py); each device's loss is
the mean over its tokens, averaged over `context` inside the differentiated function, so the
parameters' gradients come back summed over the ring by autodiff. The optimizer update runs
outside, on whatever shards the state has.
"""
from __future__ import annotations

import collections
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import config as jconfig
from jaxpar.config import Config, ConfigError
from jaxpar.models import base as jmodel
from jaxpar.models import precision
from jaxpar.models.base import ModelDef
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import pipeline, zero
from jaxpar.parallel import rules as jrules
from jaxpar.parallel.context import StepContext
from jaxpar.train import checkpoint as jckpt
from jaxpar.train import optim
from jaxpar.train.pieces import WEIGHT, as_float_weight, over_context, unweighted, weighed
from jaxpar.train.layout import StateLayout

PIPE, CONTEXT = jmesh.PIPE, jmesh.CONTEXT


def _manual_only(spec: P, manual: frozenset) -> P:
  """The part of a spec that a shard_map manual over `manual` may name."""
  return P(*(a if a in manual else None for a in spec))


# Trainer.step's default bound on the steps dispatched and unfinished at once: the host prepares
# and dispatches step n + 1 while step n runs, and never runs further ahead than that.
IN_FLIGHT = 2


class Trainer:
  """Shardings, init and step for one model on one mesh under one config."""

  def __init__(self, cfg: Config, mesh, model: ModelDef, expose_grads: bool = False,
               tx: optax.GradientTransformation | None = None, frozen: Any = None,
               decay_mask: Any = None, rules: Any = None, in_flight: int | None = IN_FLIGHT):
    """`tx`: an optax transformation of your own in place of the config's AdamW (the config's
    train.lr, warmup, clipping and weight decay then play no part). `frozen`: the parameters that
    never change, a predicate on the path ('emb/embedding') or a tree of bools; they hold no
    optimizer state and count in neither the clipping norm nor the logged grad_norm.
    `decay_mask`: which parameters the config's AdamW decays (same forms), instead of the
    matrices read off the logical axes. `rules`: the logical axis -> mesh axis table in place of
    jaxpar's (`jaxpar.rules.extended({'hidden': 'model'})` adds a name or changes a row).
    `in_flight`: how many of `step`'s steps may be dispatched and unfinished at once (None: no
    bound; see `step`)."""
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)
                                  or in_flight < 1):
      raise ConfigError(f"in_flight={in_flight!r} must be a whole number of steps, at least 1 "
                        f"(or None for no bound)")
    self.in_flight = in_flight
    self._pending: collections.deque = collections.deque()  # a leaf of each unfinished step
    # parameters are stored in precision.param_dtype whatever dtype the model creates them in
    model = jmodel.stored_as(model, precision.param_dtype(cfg.precision))
    self.cfg, self.mesh, self.model = cfg, mesh, model
    self.expose_grads = expose_grads  # step metrics carry the reduced gradients (for tests)
    pc = cfg.parallel
    self.compute_dtype = precision.compute_dtype(cfg.precision)
    # activations: sequence parallel also splits `seq` over `model` outside attention and MLP
    table = jrules.RULES if rules is None else jrules.check_table(rules)
    self.rules = jrules.rules_for(cfg.parallel.sequence_parallel, table)
    self.frozen = optim.joined(optim.select(frozen, model.abstract, "frozen"), model.frozen)
    if tx is None:
      self.tx = optim.make(cfg.train, model.logical, self.frozen,
                           optim.select(decay_mask, model.abstract, "decay_mask"))
      self.lr_schedule = optim.schedule(cfg.train)
    else:
      if decay_mask is not None:
        raise ConfigError("decay_mask chooses what the config's AdamW decays and tx replaces it; "
                          "give your own transformation its mask, e.g. optax.adamw(lr, mask=...)")
      self.tx = optim.with_frozen(tx, self.frozen)
      self.lr_schedule = None  # the logged rate is tx's own injected hyperparameter, if any
    if pc.offload_optimizer and (tx is not None or decay_mask is not None):
      raise ConfigError(f"parallel.offload_optimizer updates the config's AdamW (its own decay mask) "
                        f"one parameter at a time and cannot take a "
                        f"{'tx' if tx is not None else 'decay_mask'} of your own; set it to false")
    # Where the state lives (train/layout.py); its names are the trainer's too.
    self.state_layout = L = StateLayout(cfg, mesh, model, self.tx, table)
    self.specs, self.layout, self.schedule = L.specs, L.zero, L.schedule
    self.state_specs, self.state_shardings = L.state_specs, L.state_shardings
    self.abstract_state, self.opt_device = L.abstract_state, L.opt_device
    self.dynamic_scale, self.layer_order = L.dynamic_scale, L.layer_order
    if pc.offload_optimizer:
      self._offload_tx, self._n_clip = optim.piecewise(cfg.train, model, L.abstract_state["opt"],
                                                       self.frozen)
    self.context = jmesh.size(mesh, CONTEXT)  # the sequence's split (ring attention)
    self.context_attention = jmesh.context_attention(pc.context_attention,
                                                     self.schedule is not None)
    if self.context > 1:
      self._check_context()
    self._steps: dict = {}  # compiled steps by the batch's shapes and dtypes
    self._reorder_fns: dict = {}

  def _check_context(self) -> None:
    """A context axis needs a model that splits its sequence, and the all-gather form under a
    pipeline."""
    C = self.context
    if self.model.seq_split is None:
      raise ConfigError(f"the mesh splits the sequence over context={C}, but the model has no "
                        "context-parallel attention (ModelDef.seq_split; jaxpar's decoders have "
                        "it); use context=1")
    if self.schedule is not None and self.context_attention == "ring":
      raise ConfigError(jmesh.ring_in_pipeline(self.schedule.stages))

  # -- state -------------------------------------------------------------------------------------

  def init(self, seed: int) -> dict:
    """The whole train state, created sharded: each device computes only its shards."""
    def init_fn(key):
      params = self._in_stage_order(self.model.init(key))
      return self._new_state(params)
    with jax.set_mesh(self.mesh):
      return jax.jit(init_fn, out_shardings=self.state_shardings)(jax.random.key(seed))

  def init_with(self, params: Any) -> dict:
    """A new train state (step 0, fresh optimizer) around given parameters in the model's own
    layer order, e.g. imported ones: numpy arrays or jax arrays of any sharding, the model's tree
    and shapes. They are placed onto `state_shardings['params']` here; jax arrays (once placed)
    are donated to the new state, numpy arrays are left as they are."""
    self._check_params(params)
    # A numpy array put on a CPU device may share its memory, which a donation would overwrite.
    donate = (0,) if all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(params)) else ()
    params = jax.device_put(params, self.state_shardings["params"])

    def init_fn(params):
      params = self._in_stage_order(jmodel.cast(params, precision.param_dtype(self.cfg.precision)))
      return self._new_state(params)
    with jax.set_mesh(self.mesh):
      return jax.jit(init_fn, out_shardings=self.state_shardings, donate_argnums=donate)(params)

  def _check_params(self, params: Any) -> None:
    """One sentence naming the first parameter that the model lacks, misses or shapes otherwise."""
    got = {jrules.path_str(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jrules.path_str(p): tuple(a.shape)
            for p, a in jax.tree_util.tree_leaves_with_path(self.model.abstract)}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
      raise ConfigError("the parameters are not the model's tree: "
                        + "; ".join(f"{what} {', '.join(names[:3])}" + (" ..." if len(names) > 3 else "")
                                    for what, names in (("missing", missing), ("not in the model", extra))
                                    if names))
    for name, shape in want.items():
      if tuple(got[name]) != shape:
        raise ConfigError(f"parameter {name} has shape {tuple(got[name])}, the model's is {shape}")
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(self.model.abstract):
      raise ConfigError(f"the parameters have the model's paths in another container type: "
                        f"{jax.tree_util.tree_structure(params)}; pass the model's tree (nested dicts)")

  def _new_state(self, params: Any) -> dict:
    """Step 0 and a fresh optimizer (and loss scale) around `params` (inside a jit)."""
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": self.tx.init(params)}
    if self.dynamic_scale:
      state["loss_scale"] = precision.init_scale(self.cfg.precision)
    return state

  def restore(self, ckpt, step: int) -> tuple[dict, dict]:
    """(state, extra) of checkpoint `step` onto this trainer's layout (checkpoint.restore_state),
    the layer stack in the model's order (`from_logical` makes it the step's). `load` is the
    public form."""
    return jckpt.restore_state(ckpt, step, self.state_layout)

  def save(self, workdir: str, state: dict) -> int:
    """Writes `state` as the checkpoint of its step, `<workdir>/checkpoints/<step>`, the layout
    `jaxpar-train` writes (so `jaxpar-export --workdir` reads it), and returns the step.

    Every process calls it; each writes only its own shards. It returns once the checkpoint is
    complete on disk, and `state` stays valid (keep stepping it). Beside the state go the config
    and the model's origin (jaxpar's `model.kind`, or a model of your own), which export reads.
    A step that is saved already is an error, not overwritten."""
    step = int(jax.device_get(state["step"]))
    directory = os.path.join(workdir, "checkpoints")
    extra = {"config": jconfig.to_dict(self.cfg), "model": jckpt.model_origin(self.model)}
    with jckpt.Checkpointer(directory, keep=None, every=0, async_save=False) as ckpt:
      if step in ckpt.all_steps():
        raise ConfigError(f"{directory} holds a checkpoint of step {step} already; save into "
                          f"another workdir, or remove {os.path.join(directory, str(step))}")
      ckpt.maybe_save(step, self.to_logical(state), extra, force=True)
    return step

  def load(self, workdir: str, step: int | None = None) -> dict:
    """The state of checkpoint `step` (default: the latest) in `<workdir>/checkpoints`, read
    straight into this trainer's shardings, ready for `step`.

    The checkpoint may come from any mesh and ZeRO stage (`save`, or `jaxpar-train`): each
    device reads only its own slices. A parameter the model lacks or shapes otherwise is one
    sentence naming it."""
    directory = os.path.join(workdir, "checkpoints")
    with jckpt.Checkpointer(directory, keep=1, every=0) as ckpt:
      steps = ckpt.all_steps()
      if not steps or (step is not None and step not in steps):
        have = f"it has steps {', '.join(map(str, steps))}" if steps else "it has none"
        raise ConfigError(f"no checkpoint of step {'(any)' if step is None else step} in "
                          f"{directory}; {have}")
      step = steps[-1] if step is None else step
      with jckpt.readable(directory, step, ("load step={older}, the step before",
                                            "no step before it is complete")):
        state, _ = self.restore(ckpt, step)
    return self.from_logical(state)

  # -- layer order (parallel/pipeline.py: the circular schedule's rows of the layer stack) --------

  _reorder = staticmethod(pipeline.reorder)

  def _in_stage_order(self, tree: Any, inverse: bool = False) -> Any:
    return self.state_layout.in_stage_order(tree, inverse)

  def to_logical(self, state: dict) -> dict:
    """The state with the layer stack in the model's own order (what checkpoints hold)."""
    return self._reordered(state, inverse=True)

  def from_logical(self, state: dict) -> dict:
    """Inverse of `to_logical`."""
    return self._reordered(state, inverse=False)

  def _reordered(self, tree: Any, inverse: bool) -> Any:
    """Applies the layer order (or its inverse) with one compiled, cached program per direction."""
    if self.layer_order is None:
      return tree
    if inverse not in self._reorder_fns:
      self._reorder_fns[inverse] = jax.jit(lambda t: self.state_layout.state_in_stage_order(t, inverse),
                                           out_shardings=self.state_shardings)
    with jax.set_mesh(self.mesh):
      return self._reorder_fns[inverse](tree)

  def batch_sharding(self, batch_abstract: Any) -> Any:
    """Every batch leaf is split over `data` on its leading axis."""
    return jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, P(zero.DATA)), batch_abstract)

  # -- step --------------------------------------------------------------------------------------

  def _manual(self) -> tuple[bool, frozenset]:
    """(whether `data` splits the batch, the mesh axes the step's shard_map is manual over)."""
    data_sharded = self.mesh.shape[zero.DATA] > 1
    on = ((zero.DATA, data_sharded), (PIPE, self.schedule is not None),
          (CONTEXT, self.context > 1))
    return data_sharded, frozenset(a for a, yes in on if yes)

  def _sharded(self, local, params, batch, out_specs, rows=None):
    """`local(params, batch)` inside a shard_map manual over `_manual()` axes (or as it is)."""
    with jrules.use(self.rules):  # the model's activation constraints read the trainer's table
      return self._sharded_in(local, params, batch, out_specs, rows)

  def _sharded_in(self, local, params, batch, out_specs, rows=None):
    """`rows`: a per-row array (B,) beside the batch, split over `data` only, passed to
    local as a third argument."""
    _, manual = self._manual()
    extra = () if rows is None else (rows,)
    if not manual:
      return local(params, batch, *extra)
    keep = lambda tree: jax.tree_util.tree_map(lambda spec: _manual_only(spec, manual), tree,
                                               is_leaf=lambda x: isinstance(x, P))
    batch_spec = P(zero.DATA) if zero.DATA in manual else P()
    if CONTEXT in manual:  # every leaf's sequence (axis 1) in the ring's order, split over context
      batch = self.model.seq_split(batch, self.context)
      batch_spec = P(batch_spec[0] if batch_spec else None, CONTEXT)
    in_specs = (keep(self.layout.params), jax.tree_util.tree_map(lambda _: batch_spec, batch))
    in_specs += (P(zero.DATA) if zero.DATA in manual else P(),) * len(extra)
    return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=keep(out_specs),
                         axis_names=manual, check_vma=self.schedule is None)(params, batch, *extra)

  def _ctx(self, manual: frozenset) -> StepContext:
    return StepContext(self.compute_dtype, zero.mark_frozen(self.layout.param_dims, self.frozen),
                       manual, self.cfg.parallel.remat, self.context_attention)

  def _micro(self, batch):
    """Batch leaves (b, ...) -> (M, b / M, ...) for the pipeline schedule's M microbatches."""
    M = self.schedule.microbatches
    return jax.tree_util.tree_map(lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)

  def eval_loss(self, params, batch):
    """(params, global batch) -> (mean loss, metrics), no gradients, on the step's sharded path:
    manual over `data` with ZeRO-3 layers gathered one at a time, the pipeline schedule's forward
    when there is one. `params` are the state's own (stage order under the circular schedule)."""
    model, sched = self.model, self.schedule
    data_sharded, manual = self._manual()
    ctx = self._ctx(manual)

    def local(params, batch):
      if sched is not None:
        loss, aux, _ = model.pipeline(params, self._micro(batch), sched, ctx, forward_only=True)
        loss, aux = over_context(*as_float_weight(loss, aux), manual)
      else:
        loss, aux = over_context(*as_float_weight(*model.loss(params, batch, ctx)), manual)
      weighted = WEIGHT in aux
      if weighted:
        loss, aux = weighed(loss, aux)
      if data_sharded:
        loss, aux = jax.lax.pmean((loss, aux), zero.DATA)
      return unweighted(loss, aux, None, 1, manual) if weighted else (loss, aux)
    return self._sharded(local, params, batch, (P(), P()))

  def eval_weighted(self, params, batch, weight):
    """(params, global batch, weight (B,) float32) -> (loss, metrics, examples): the means over
    the rows of weight 1 (0: padding, left out exactly), and how many rows those are.

    Each row is scored alone (the model's loss vmapped over rows of one), so a padded row adds
    nothing to any mean; with a `loss_weight` metric, rows weigh by it too. Under a pipeline,
    a row runs as every microbatch of its own batch (M copies of it): M times the forward of
    the row, once per evaluation, on its last batch only."""
    model, sched = self.model, self.schedule
    data_sharded, manual = self._manual()
    ctx = self._ctx(manual)
    one_row = lambda x: x[None]

    def score(params, row):  # one example -> (loss, metrics), float32 scalars
      if sched is not None:
        M = sched.microbatches
        micro = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (M, 1) + x.shape), row)
        loss, aux, _ = model.pipeline(params, micro, sched, ctx, forward_only=True)
        if WEIGHT in aux:  # counted over the M copies: the row's own count
          aux = {**aux, WEIGHT: aux[WEIGHT] / M}
      else:
        loss, aux = model.loss(params, jax.tree_util.tree_map(one_row, row), ctx)
      loss, aux = over_context(*as_float_weight(loss, aux), manual)
      return (jnp.asarray(loss, jnp.float32),
              {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()})

    def local(params, batch, weight):
      losses, aux = jax.vmap(score, in_axes=(None, 0))(params, batch)  # (b,) each
      w = weight * aux[WEIGHT] if WEIGHT in aux else weight
      sums = {k: jnp.sum(w * v) for k, v in aux.items() if k != WEIGHT}
      totals = (jnp.sum(w * losses), sums, jnp.sum(w), jnp.sum(weight))
      if data_sharded:
        totals = jax.lax.psum(totals, zero.DATA)
      loss_sum, sums, w_sum, examples = totals
      denom = jnp.maximum(w_sum, jnp.finfo(jnp.float32).tiny)
      metrics = {k: v / denom for k, v in sums.items()}
      if WEIGHT in aux:
        metrics[WEIGHT] = w_sum
      return loss_sum / denom, metrics, examples
    return self._sharded(local, params, batch, (P(), P(), P()), rows=weight)

  def eval_jitted(self, batch_abstract: Any, weighted: bool = False):
    """`eval_loss` jitted with the state's parameter shardings -> {'loss', **metrics}; with
    `weighted`, `eval_weighted` (params, batch, weight) -> {'loss', **metrics, 'examples'}."""
    self.check_batch(batch_abstract, accum=False)
    rows = NamedSharding(self.mesh, P(zero.DATA))
    params_sharding = self.state_shardings["params"]
    if weighted:
      def fn(params, batch, weight):
        loss, aux, examples = self.eval_weighted(params, batch, weight)
        return {"loss": loss, **aux, "examples": examples}
      return jax.jit(fn, in_shardings=(params_sharding, self.batch_sharding(batch_abstract), rows))

    def fn(params, batch):
      loss, aux = self.eval_loss(params, batch)
      return {"loss": loss, **aux}
    return jax.jit(fn, in_shardings=(params_sharding, self.batch_sharding(batch_abstract)))

  def _grads(self, params, batch, scale=None, step=None):
    """(params, global batch) -> (loss, metrics, grads with the layout's grad shardings).
    `scale`: the loss scale, a traced scalar under dynamic scaling (default: the static one).
    `step`: the step counter, whose key (model.train_key) a model that takes_rng is given."""
    L = self.layout
    stage, accum = L.stage, self.cfg.train.grad_accum
    scale = precision.static_scale(self.cfg.precision) if scale is None else scale
    model, sched = self.model, self.schedule
    data_sharded, manual = self._manual()
    ctx = self._ctx(manual)
    # Without a pipeline the body is differentiated by jax.grad under vma checking; the pipeline
    # executor differentiates by hand (jax.vjp per stage), where per-device values are simply local.
    vma = sched is None
    # The key's data (uint32) enters the shard_map as a closed-over replicated value.
    key_data = (jax.random.key_data(jmodel.train_key(self.cfg.train.seed, step))
                if model.takes_rng and sched is None and step is not None else None)

    def local(params, batch):
      if data_sharded and vma:  # differentiate a per-shard copy: the reduction below is then the
        # only one, in float32 (zero.in_float32). At stage 3 that is the leaves too small to
        # shard; the others are summed by the transpose of their all-gathers.
        params = jax.tree_util.tree_map(
            lambda x, d: x if (stage == 3 and d >= 0) or d == zero.OWNED
            else jax.lax.pcast(x, zero.DATA, to="varying"), params, L.dims)

      # the global row where this shard's piece of the batch starts (the keys follow the rows)
      n_local = jax.tree_util.tree_leaves(batch)[0].shape[0]
      row0 = jax.lax.axis_index(zero.DATA) * n_local if zero.DATA in manual else 0

      def one(mb, i=0):  # -> (loss, metrics, grads) of microbatch i of this shard
        if sched is not None:
          # the schedule seeds each microbatch's backward with the scale (not a multiply after)
          loss, aux, grads = model.pipeline(params, self._micro(mb), sched, ctx, scale)
          if CONTEXT in manual:  # each device's vjp is of its share's mean: average the shares
            mean = zero.in_float32(lambda g: jax.lax.pmean(g, CONTEXT))
            grads = jax.tree_util.tree_map(mean, grads)
          loss, aux = over_context(*as_float_weight(loss, aux), manual)
          if WEIGHT in aux:  # this piece's sums, not its means (see WEIGHT), gradients too:
            # a decoder's packed documents (models/segments.py), whose schedule returns means
            w = jax.lax.stop_gradient(aux[WEIGHT])
            grads = jax.tree_util.tree_map(lambda g: g * w.astype(g.dtype), grads)
            loss, aux = weighed(loss, aux)
          return loss, aux, grads

        rng = {}
        if key_data is not None:
          first = row0 + i * jax.tree_util.tree_leaves(mb)[0].shape[0]
          ring = (jax.lax.axis_index(CONTEXT), self.context) if CONTEXT in manual else None
          rng = {"rng": jmodel.at_rows(jax.random.wrap_key_data(key_data), first, ring)}

        def scaled(p):
          if self.frozen is not None:  # no backward into frozen parameters (nor ZeRO-3's
            # reduce-scatter): inside the differentiated function, or it would stop nothing
            p = jax.tree_util.tree_map(lambda x, f: jax.lax.stop_gradient(x) if f else x, p,
                                       self.frozen)
          loss, aux = over_context(*as_float_weight(*model.loss(p, mb, ctx, **rng)), manual)
          if WEIGHT in aux:  # this piece's sums, not its means (see WEIGHT)
            loss, aux = weighed(loss, aux)
          return loss * scale, (loss, aux)
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return loss, aux, grads
      if accum == 1:
        loss, aux, grads = one(batch)
      else:  # accumulate over microbatches in one scan: memory of one microbatch
        micro = jax.tree_util.tree_map(
            lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)
        # The accumulator varies over `data` as one microbatch's result does: everything does
        # (per-shard copies, gathered shards).
        def zeros_like(a):
          z = jnp.zeros(a.shape, a.dtype)
          return jax.lax.pcast(z, zero.DATA, to="varying") if data_sharded and vma else z
        zeros = jax.tree_util.tree_map(
            zeros_like, jax.eval_shape(one, jax.tree_util.tree_map(lambda x: x[0], micro)))
        total, _ = jax.lax.scan(
            lambda acc, mb_i: (jax.tree_util.tree_map(jnp.add, acc, one(*mb_i)), None), zeros,
            (micro, jnp.arange(accum)))
        loss, aux, grads = jax.tree_util.tree_map(lambda x: x / accum, total)
      if not (isinstance(scale, float) and scale == 1.0):
        grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
      weighted = WEIGHT in aux
      if not data_sharded:  # one data shard: nothing to reduce over `data`
        return unweighted(loss, aux, grads, accum, manual) if weighted else (loss, aux, grads)
      n = jax.lax.axis_size(zero.DATA)
      total = zero.in_float32(lambda g: jax.lax.psum(g, zero.DATA))

      def reduce(g, d, frozen):
        if frozen:  # its gradient is zero: nothing to reduce, only this shard's part to give
          scattered = stage == 2 and d >= 0
          return jnp.zeros(g.shape[:d] + (g.shape[d] // n,) + g.shape[d + 1:] if scattered
                           else g.shape, g.dtype)
        if stage < 3:
          return zero.scatter_mean(g, d, scatter=stage == 2)
        # sharded leaves were summed and scattered by the transpose of their all-gathers;
        # leaves too small to shard are summed here
        return (g if d >= 0 or d == zero.OWNED else total(g)) / n
      frozen = (jax.tree_util.tree_map(lambda _: False, grads) if self.frozen is None
                else self.frozen)
      grads = jax.tree_util.tree_map(reduce, grads, L.dims, frozen)
      loss, aux = jax.lax.pmean((loss, aux), zero.DATA)
      return unweighted(loss, aux, grads, accum, manual) if weighted else (loss, aux, grads)

    return self._sharded(local, params, batch, (P(), P(), L.grads))

  def step_fn(self, state: dict, batch: dict) -> tuple[dict, dict]:
    """One optimizer step on one global batch. Pure; `compiled_step` jits it."""
    dyn = state.get("loss_scale")  # the dynamic loss scale's state, or None
    loss, aux, grads = self._grads(state["params"], batch, None if dyn is None else dyn["scale"],
                                   state["step"])
    if self.frozen is not None:  # the pipeline's own vjp gives them gradients: not counted
      grads = jax.tree_util.tree_map(lambda g, f: jnp.zeros_like(g) if f else g, grads, self.frozen)
    grads = jax.lax.with_sharding_constraint(grads, zero.named(self.mesh, self.layout.grads))
    opt = state["opt"]
    grad_norm = optax.tree.norm(grads)
    # an overflow under dynamic scaling is skipped like train.skip_nonfinite's non-finite steps
    skips = self.cfg.train.skip_nonfinite or dyn is not None
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) if skips else None
    rate = None  # the learning rate this step applies, where the transformation says
    if self.cfg.parallel.offload_optimizer:
      params, new_opt = self._offloaded_update(grads, opt, state["params"], ok)
    else:
      updates, new_opt = self.tx.update(grads, opt, state["params"])
      params = optax.apply_updates(state["params"], updates)
      if self.lr_schedule is None:  # read before a skipped step puts the old state back
        rate = optim.learning_rate(new_opt)
      if ok is not None:
        new_opt = optim.keep_unless(ok, new_opt, opt)
    if self.frozen is not None:  # the old leaves themselves, not p + 0 (XLA folds it today)
      params = jax.tree_util.tree_map(lambda new, old, f: old if f else new, params,
                                      state["params"], self.frozen)
    # The schedule's count moves with the step, skipped ones included: the rate applied above. A tx
    # of one's own reports what it injects (optax.inject_hyperparams), else NaN (null in metrics).
    if self.lr_schedule is not None:
      rate = self.lr_schedule(state["step"])
    elif rate is None:
      rate = jnp.float32(jnp.nan)
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": rate, **aux}
    if self.expose_grads:
      metrics["grads"] = grads
    if ok is not None:  # keep the old state; the loop counts the skipped steps
      params = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), params, state["params"])
      metrics["skipped"] = (~ok).astype(jnp.int32)
    new = {"step": state["step"] + 1, "params": params, "opt": new_opt}
    if dyn is not None:  # the scale this step ran with; an overflow backs it off
      metrics["loss_scale"] = dyn["scale"]
      new["loss_scale"] = precision.next_scale(dyn, ok, self.cfg.precision)
    return new, metrics

  # -- optimizer offload: the state stays in host memory, updated a piece at a time
  # (zero.offloaded_update); global-norm clipping needs every gradient, so it runs first, on device.

  def _offloaded_update(self, grads, opt, params, ok):
    """(new params, new state) of the optimizer with its state in host memory. Frozen leaves
    (no state) are left out of the piecewise update and come back as they were."""
    n, frozen = self._n_clip, self.frozen
    part = lambda tree: optim.chain_state(tree, frozen)
    inner = part(opt)
    grads = optim.trainable(grads, frozen)
    if n:
      grads, _ = optax.clip_by_global_norm(self.cfg.train.clip_norm).update(grads, inner[0])
    keep = None if ok is None else (lambda new, old: optim.keep_unless(ok, new, old))
    new, rest = zero.offloaded_update(
        self._offload_tx, grads, inner[n:], optim.trainable(params, frozen),
        part(self.state_shardings["opt"])[n:], part(self.opt_device)[n:], keep,
        stream=optim.trainable(self.state_layout.stream_layers(), frozen))
    return (optim.with_trainable(params, new, frozen),
            optim.with_chain_state(opt, inner[:n] + rest, frozen))

  def jitted(self, batch_abstract: Any):
    """The step, jitted with the state's shardings (state donated)."""
    return jax.jit(self.step_fn,
                   in_shardings=(self.state_shardings, self.batch_sharding(batch_abstract)),
                   out_shardings=(self.state_shardings, None), donate_argnums=0)

  def lower(self, batch_abstract: Any):
    """The lowered step for abstract inputs (plan.py compiles this without running anything)."""
    # The state's shardings go on the abstract values too: only they, not in_shardings, tell the
    # trace that the offloaded optimizer state is in host memory.
    self.check_batch(batch_abstract)
    state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   self.abstract_state, self.state_shardings)
    with jax.set_mesh(self.mesh):
      return self.jitted(batch_abstract).lower(state, batch_abstract)

  def step(self, state: dict, batch: dict) -> tuple[dict, dict]:
    """Runs one step, compiling on first use of each batch shape (e.g. a shorter last batch).

    Steps run asynchronously, but at most `in_flight` (default IN_FLIGHT) at once: before step n
    is dispatched, step n - in_flight is waited for, which is already over unless the host has
    run that far ahead (no transfer either way). A loop that never reads a result would
    otherwise queue steps without end: on XLA:CPU with several simulated devices on few cores
    that aborts in a collective's 40 s rendezvous timeout."""
    if not isinstance(state, dict) or "params" not in state:
      raise ValueError(f"the state is {type(state).__name__}, not the dict Trainer.init (or "
                       f"init_with, restore) returns; make one with Trainer.init(seed) first")
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(state)):
      raise ValueError("this state was consumed by an earlier step (the step donates its input "
                       "state to reuse the memory); pass the state that step returned")
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    leaves, tdef = jax.tree_util.tree_flatten(abstract)
    key = (tdef, tuple((a.shape, a.dtype) for a in leaves))
    if key not in self._steps:
      self._steps[key] = self.lower(abstract).compile()
    if self.in_flight is not None:
      while len(self._pending) >= self.in_flight:
        self._pending.popleft().block_until_ready()
    with jax.set_mesh(self.mesh):
      new, metrics = self._steps[key](state, batch)
    if self.in_flight is not None:
      # A step's outputs are ready together; its loss is one the next step does not donate.
      self._pending.append(metrics["loss"])
    return new, metrics

  def check_batch(self, batch_abstract: Any, accum: bool = True) -> None:
    """Every batch leaf's leading axis must split into the data shards, the accumulated
    microbatches (`accum`) and the schedule's microbatches: else one sentence naming the leaf."""
    parts = [("data", self.mesh.shape[zero.DATA]),
             ("grad_accum", self.cfg.train.grad_accum if accum else 1),
             ("parallel.microbatches", self.schedule.microbatches if self.schedule else 1)]
    parts = [(name, n) for name, n in parts if n > 1 or name == "data"]
    need = int(np.prod([n for _, n in parts]))
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch_abstract):
      name = jrules.path_str(path)
      if not leaf.shape:
        raise ConfigError(f"batch leaf {name!r} is a scalar; every batch leaf needs a leading "
                          f"batch axis, which the trainer splits over data")
      if leaf.shape[0] % need:
        raise ConfigError(f"batch leaf {name!r} has {leaf.shape[0]} examples, not divisible by "
                          + " x ".join(f"{n}={k}" for n, k in parts))
