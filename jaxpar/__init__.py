"""jaxpar: sharded training of Flax models on one JAX mesh (data, model, pipeline).

The public surface: `Trainer` (sharded init + compiled step, `save` / `load` of checkpoints),
`from_nnx` / `from_linen` (bring your own Flax model), `from_stack` (your own stack of blocks,
which the pipeline cuts into stages), `RULES` (logical axis -> mesh axis) and `rules`
(`rules.constrain` for activations), `make_mesh`, `SpikeGuard` (the loss-spike guard for a loop of your own), and `config.load`. The package's layers:
ARCHITECTURE.md.
"""
from jaxpar.parallel import hostmem

hostmem.configure()  # before JAX starts its threads; see parallel/hostmem.py

from jaxpar import config  # noqa: E402
from jaxpar.config import Config, ConfigError  # noqa: E402
from jaxpar.models.base import ModelDef, from_linen, from_nnx  # noqa: E402
from jaxpar.models.user_stack import from_stack  # noqa: E402
from jaxpar.parallel import mesh as _mesh  # noqa: E402
from jaxpar.parallel import rules  # noqa: E402  (jaxpar.rules.constrain in a model)
from jaxpar.parallel.rules import RULES  # noqa: E402
from jaxpar.train.guard import SpikeGuard  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402
from jaxpar.version import __version__  # noqa: E402


def make_mesh(spec: str):
  """'2x4x1' -> Mesh(data=2, model=4, pipeline=1, context=1) over the first 8 devices;
  '2x2x1x2' splits the sequence over context=2 as well."""
  import jax
  shape = _mesh.parse(spec)
  n = shape[0] * shape[1] * shape[2] * shape[3]
  if n > len(jax.devices()):
    named = ", ".join(f"{a}={s}" for a, s in zip(_mesh.AXES, shape) if a != _mesh.CONTEXT or s > 1)
    raise ConfigError(f"mesh {spec} needs {n} devices, found {len(jax.devices())} ({named})")
  return _mesh.make(shape, jax.devices()[:n])


__all__ = ["Config", "ConfigError", "ModelDef", "RULES", "SpikeGuard", "Trainer", "config", "from_linen",
           "from_nnx", "from_stack", "make_mesh", "rules", "__version__"]
