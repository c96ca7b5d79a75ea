"""The optax chain: global-norm clipping, AdamW with warmup + cosine decay, no decay on norms/biases;
frozen parameters (no update, no state) around it or around a user's own transformation."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import ConfigError, TrainConfig
from jaxpar.parallel import rules


def schedule(tc: TrainConfig) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `steps`."""
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=warmup,
      decay_steps=max(tc.steps, warmup + 1), end_value=tc.lr * tc.min_lr_ratio)


def decay_mask(logical: Any) -> Any:
  """Weight decay on matrices only, read off each parameter's logical axes: a leaf with at least
  two axes besides a stacked `layers` axis decays; norms' scales and biases do not.

  `logical` is the model's tree of logical-axis tuples (ModelDef.logical), so the decision follows
  what a parameter is, not what its path is called.
  """
  return jax.tree_util.tree_map(lambda names: sum(a != "layers" for a in names) >= 2, logical,
                                is_leaf=lambda x: isinstance(x, tuple))


def select(selection: Callable[[str], bool] | Any | None, abstract: Any, what: str) -> Any | None:
  """A tree of bools like `abstract` from `selection`: a predicate on each parameter's path
  ('emb/embedding', as rules.path_str writes it) or a tree of bools of the parameters' structure.
  None stays None."""
  if selection is None:
    return None
  if callable(selection):
    return jax.tree_util.tree_map_with_path(lambda path, _: bool(selection(rules.path_str(path))),
                                            abstract)
  want, got = jax.tree_util.tree_structure(abstract), jax.tree_util.tree_structure(selection)
  if want != got:
    raise ConfigError(f"{what} is a tree of {got.num_leaves} leaves that is not the parameters' "
                      f"tree ({want.num_leaves} leaves); pass one bool per parameter or a "
                      f"predicate on the parameter's path such as lambda path: path.startswith('emb')")
  return jax.tree_util.tree_map(bool, selection)


def joined(frozen: Any | None, more: Any | None) -> Any | None:
  """Two trees of bools (either None) -> a leaf is frozen in either."""
  if frozen is None or more is None:
    return more if frozen is None else frozen
  return jax.tree_util.tree_map(lambda a, b: bool(a or b), frozen, more)


def make(tc: TrainConfig, logical: Any, frozen: Any | None = None,
         decay: Any | None = None) -> optax.GradientTransformation:
  """clip_by_global_norm -> AdamW(schedule, b1, b2, weight_decay masked by `decay`, by default
  `decay_mask(logical)`), the `frozen` parameters (a tree of bools) left out (`with_frozen`)."""
  parts = []
  if tc.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(tc.clip_norm))
  parts.append(optax.adamw(schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                           mask=decay_mask(logical) if decay is None else decay))
  return with_frozen(optax.chain(*parts), frozen)


def with_frozen(tx: optax.GradientTransformation, frozen: Any | None) -> optax.GradientTransformation:
  """`tx` over the parameters not `frozen` (a tree of bools); the frozen ones get a zero update.

  multi_transform hands `tx` the trainable parameters only (the frozen ones are MaskedNodes,
  empty subtrees), so `tx` holds no state for them and its clipping norm and weight decay never
  see them.
  """
  if frozen is None or not any(jax.tree_util.tree_leaves(frozen)):
    return tx
  labels = jax.tree_util.tree_map(lambda f: "frozen" if f else "trainable", frozen)
  return optax.multi_transform({"trainable": tx, "frozen": optax.set_to_zero()}, labels)


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def learning_rate(opt_state: Any) -> jax.Array | None:
  """The first `learning_rate` hyperparameter of an `optax.inject_hyperparams` state found in
  `opt_state` (also inside chains, multi_transform and masked), in tree order; None if there is
  none. The state after an update holds the rate that update applied."""
  is_injected = lambda x: isinstance(x, _INJECTED)
  for node in jax.tree_util.tree_leaves(opt_state, is_leaf=is_injected):
    if is_injected(node) and "learning_rate" in node.hyperparams:
      return node.hyperparams["learning_rate"]
  return None


def keep_unless(ok: jax.Array, new: Any, old: Any) -> Any:
  """The optimizer state after a step that is applied only if `ok`: the old moments when not,
  but the learning-rate schedule's count advances either way, so the rate follows the training
  step (logged and applied alike) and reaches its floor at `train.steps`."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  return jax.tree_util.tree_map(
      lambda n, o: n if is_sched(n) else jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), n, o),
      new, old, is_leaf=is_sched)


def any_frozen(frozen: Any | None) -> bool:
  """Whether `with_frozen` wraps the chain (some parameter is frozen)."""
  return frozen is not None and any(jax.tree_util.tree_leaves(frozen))


def trainable(tree: Any, frozen: Any | None) -> Any:
  """`tree` (the parameters' structure) as `with_frozen`'s chain sees it: each frozen leaf an
  optax.MaskedNode, an empty subtree."""
  if not any_frozen(frozen):
    return tree
  return jax.tree_util.tree_map(lambda x, f: optax.MaskedNode() if f else x, tree, frozen)


def with_trainable(tree: Any, part: Any, frozen: Any | None) -> Any:
  """`tree` with its trainable leaves replaced by `part`'s (`trainable`'s structure)."""
  if not any_frozen(frozen):
    return part
  leaves, tdef = jax.tree_util.tree_flatten(tree)
  flags = tdef.flatten_up_to(frozen)
  new = iter(jax.tree_util.tree_leaves(part))
  return tdef.unflatten([x if f else next(new) for x, f in zip(leaves, flags)])


def chain_state(opt: Any, frozen: Any | None) -> Any:
  """The state of optim.make's own chain (clip, AdamW) inside `with_frozen`'s; a tree of
  shardings of the state's structure works too."""
  return opt.inner_states["trainable"].inner_state if any_frozen(frozen) else opt


def with_chain_state(opt: Any, inner: Any, frozen: Any | None) -> Any:
  """`opt` with `chain_state` replaced by `inner`; the frozen group's state (empty) as it was."""
  if not any_frozen(frozen):
    return inner
  group = opt.inner_states["trainable"]
  return opt._replace(inner_states={**opt.inner_states,
                                    "trainable": group._replace(inner_state=inner)})


def piecewise(tc: TrainConfig, model, opt_abstract: Any,
              frozen: Any | None = None) -> tuple[optax.GradientTransformation, int]:
  """For an offloaded optimizer (zero.offloaded_update), which runs the chain one parameter at a
  time on the trainable parameters (`trainable`; the frozen ones hold no state): (the chain
  without global-norm clipping, which needs every gradient at once and runs first, on the
  device; the number of leading clip states of `chain_state` it leaves out)."""
  n_clip = 1 if tc.clip_norm > 0 else 0
  tx = make(dataclasses.replace(tc, clip_norm=0.0), model.logical)
  rest = jax.eval_shape(tx.init, trainable(model.abstract, frozen))
  inner = chain_state(opt_abstract, frozen)
  if jax.tree_util.tree_structure(rest) != jax.tree_util.tree_structure(tuple(inner)[n_clip:]):
    raise AssertionError("optim.make's chain is no longer (clip, rest): update optim.piecewise")
  return tx, n_clip
