"""Where the train state lives on one mesh, and what it is, before any of it exists.

`StateLayout` reads the model's abstract parameters and logical axes, the rules, the ZeRO stage,
the pipeline schedule and the optimizer, and gives the state's PartitionSpecs, shardings (the
optimizer's in host memory when offloaded) and abstract shapes. The trainer builds the state and
the step on it; plan.py and autoplan read it to say what a layout costs without training.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, ConfigError, microbatches
from jaxpar.models import precision
from jaxpar.models.base import ModelDef
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import pipeline, rules, zero


class StateLayout:
  """The train state's specs, shardings and abstract shapes for `model` on `mesh` under `cfg`,
  with the optimizer `tx` and the rules `table` (logical axis -> mesh axis).

  specs: the rules' parameter specs; zero: ZeRO's params/grads/opt specs (zero.Layout);
  schedule: the pipeline schedule (None without a pipeline); state_specs, state_shardings,
  abstract_state: {'step', 'params', 'opt'[, 'loss_scale']}; opt_device: the optimizer state's
  shardings on the device (where an offloaded one is updated); layer_order: the circular
  schedule's row order of the layer stack (None = the model's own).
  """

  def __init__(self, cfg: Config, mesh, model: ModelDef, tx: optax.GradientTransformation,
               table: rules.Table = rules.RULES):
    pc = cfg.parallel
    self.cfg, self.mesh, self.model = cfg, mesh, model
    n_stages = mesh.shape[jmesh.PIPE]
    self.schedule = None
    if n_stages > 1:
      if model.pipeline is None:
        raise ConfigError("this model has no pipeline form (give jaxpar its stack of blocks with "
                          "jaxpar.from_stack); use a mesh with pipeline=1")
      self.schedule = pipeline.build(pc.schedule, n_stages, microbatches(cfg, n_stages),
                                     pc.virtual_stages)
    stack = model.abstract["layers"] if self.schedule and "layers" in model.abstract else None
    # the longest leaf's rows: with model.moe_every > 1 the dense and mixture MLPs have fewer
    self.n_layers = max(x.shape[0] for x in jax.tree_util.tree_leaves(stack)) if stack else 0
    if self.schedule is not None:  # before the specs, whose message would name one parameter
      stages = n_stages * self.schedule.virtual_stages
      if self.n_layers % stages:
        raise ConfigError(f"the model's {self.n_layers} layers are not divisible by its {stages} "
                          f"pipeline stages (pipeline={n_stages} x parallel.virtual_stages="
                          f"{self.schedule.virtual_stages})")
    self.specs = rules.param_specs(model.abstract, model.logical, mesh, table)
    self.zero = zero.layout(model.abstract, self.specs, model.logical, mesh, pc.zero_stage)
    opt_abstract = jax.eval_shape(tx.init, model.abstract)
    opt_specs = zero.opt_state_specs(opt_abstract, model.abstract, self.zero.opt)
    self.state_specs = {"step": P(), "params": self.zero.params, "opt": opt_specs}
    if pc.offload_optimizer:
      zero.check_host_memory(mesh)
    self.opt_device = zero.named(mesh, opt_specs)
    self.state_shardings = {
        "step": NamedSharding(mesh, P()), "params": zero.named(mesh, self.zero.params),
        "opt": zero.named(mesh, opt_specs, memory_kind=zero.HOST if pc.offload_optimizer else None)}
    self.abstract_state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": model.abstract,
                           "opt": opt_abstract}
    # A dynamic loss scale is state: checkpointed with the rest, so a resumed run continues it.
    self.dynamic_scale = precision.is_dynamic(cfg.precision)
    if self.dynamic_scale:
      self.state_specs["loss_scale"] = {"scale": P(), "good_steps": P()}
      self.state_shardings["loss_scale"] = {k: NamedSharding(mesh, P())
                                            for k in ("scale", "good_steps")}
      self.abstract_state["loss_scale"] = precision.scale_abstract()
    self.layer_order: np.ndarray | None = pipeline.layer_order(self.schedule, self.n_layers)

  def stream_layers(self) -> Any:
    """Per parameter: whether its offloaded moments reach the device one layer at a time."""
    return zero.stream_layers(self.model.abstract, self.model.logical, self.zero.opt, self.mesh)

  def in_stage_order(self, tree: Any, inverse: bool = False) -> Any:
    """Every layer stack of `tree` in the state's order (inverse: the model's), inside a jit."""
    return pipeline.in_stage_order(tree, self.schedule, self.n_layers, inverse)

  def state_in_stage_order(self, state: dict, inverse: bool) -> dict:
    """`in_stage_order` of a whole train state. Offloaded optimizer moments are reordered on
    device copies, one leaf at a time (zero.offloaded_map)."""
    if not self.cfg.parallel.offload_optimizer or self.layer_order is None:
      return self.in_stage_order(state, inverse)
    rest = self.in_stage_order({k: v for k, v in state.items() if k != "opt"}, inverse)
    n = self.n_layers
    opt = zero.offloaded_map(pipeline.stage_rows(self.schedule, inverse), state["opt"],
                             self.state_shardings["opt"], self.opt_device,
                             lambda path, x: pipeline.is_stacked(path, x, n))
    return {**rest, "opt": opt}
