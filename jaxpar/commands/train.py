"""Train a model on a DxMxP[xC] mesh: jaxpar-train --mesh 2x4x1 [--config F] [--set k=v ...]
(or python -m jaxpar train, or python scripts/train.py in a checkout)."""
from __future__ import annotations

import math
import os
import sys

from jaxpar import config, kinds
from jaxpar.commands import cli
from jaxpar.config import ConfigError
from jaxpar.parallel import distributed
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import watchdog


def main(argv=None) -> int:
  p = cli.Parser(description=__doc__)
  cli.add_common(p)
  p.add_argument("--steps", type=int, help="total steps (overrides train.steps)")
  p.add_argument("--workdir", default="workdir", help="checkpoints, TensorBoard, built data")
  p.add_argument("--metrics-file", help="JSON Lines: one object per logged step, then a final one")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--deepspeed", metavar="DS_CONFIG",
                 help="a DeepSpeed config (ds_config.json) read as overrides before --set")
  p.add_argument("--profile-steps", metavar="A:B",
                 help="trace steps A..B with the JAX profiler into <workdir>/profile; the summary "
                      "splits their time into compute and collectives")
  distributed.add_flags(p)
  args = p.parse_args(argv)

  def body():
    # Lazy, as in every command: these import JAX, which must start after cli.setup has set the
    # simulated device count (XLA_FLAGS); profile is light and refuses bad input first.
    from jaxpar.analysis import profile  # bad input is refused before any device is touched
    window = profile.parse_window(args.profile_steps) if args.profile_steps is not None else None
    spec = distributed.resolve(args)
    if args.deepspeed:  # its overrides go first: --config < --deepspeed < --set
      from jaxpar.interop import deepspeed  # only --deepspeed reads a DeepSpeed config
      args.set = deepspeed.cli_overrides(args.deepspeed, args.mesh, args.set,
                                         show=spec.process_id == 0 and not args.print_config
                                         ) + args.set
    if args.print_config:  # what this run would train, checked against the mesh; nothing runs
      cfg = kinds.check(config.load(args.config, args.set, base=cli.hf_model_keys,
                                    follow=cli.data_keys))
      if args.steps is not None:  # as loop.run applies it
        cfg = config.override(cfg, train={"steps": args.steps})
      shape = jmesh.parse(args.mesh)
      jmesh.check(shape, cfg, math.prod(shape))
      return cli.print_config(cfg, args.mesh, args.workdir)
    cli.check_outputs(("--workdir", args.workdir, "folder"),
                      *(("--workdir", os.path.join(args.workdir, sub), "folder")
                        for sub in ("checkpoints", "tb")),  # what the run makes inside it
                      ("--metrics-file", args.metrics_file, "file"))
    cfg, shape = cli.setup(args, processes=spec.num_processes)
    if spec.multi:
      watchdog.check_peer_timeout(cfg.train, spec.heartbeat_timeout)
    distributed.initialize(spec)  # before anything touches the devices
    distributed.preflight(cfg, shape)
    _not_a_users_model(os.path.join(args.workdir, "checkpoints"))
    from jaxpar.train import loop  # imports JAX: after cli.setup has set the device count
    log = print if distributed.is_main() else (lambda *a, **k: None)
    try:
      result = loop.run(cfg, shape, args.workdir, args.metrics_file, args.steps,
                        progress=not args.no_progress, log=log, profile_steps=window,
                        step_store=True)
    except Exception as e:
      distributed.exit_if_peer_lost(e)
      raise
    return 0 if result.steps else 1
  return cli.guard(body, args.debug, exit_on_signal=True)


def _not_a_users_model(directory: str) -> None:
  """A workdir whose latest checkpoint holds a model of the user's own (jaxpar.Trainer.save) is
  refused in one sentence before anything is built (its data under the workdir among them)."""
  from jaxpar.train import checkpoint  # imports JAX: after cli.setup has set the device count
  if not os.path.isdir(directory):
    return
  with checkpoint.Checkpointer(directory, keep=1, every=0) as reader:
    step = reader.latest_step()
  if step is None:
    return
  with checkpoint.readable(directory, step, checkpoint.RESUME_REMEDY):
    extra = checkpoint.read_extra(directory, step)
  if checkpoint.users_model(extra):
    raise ConfigError(f"the checkpoint of step {step} in {directory} holds a model of your own; "
                      f"jaxpar-train trains jaxpar's own model kinds only: go on with "
                      f"jaxpar.Trainer.load in your own loop, or use another --workdir")


if __name__ == "__main__":
  sys.exit(main())
