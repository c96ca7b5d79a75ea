"""jaxpar: sharded training of Flax models on one JAX mesh (data, model, pipeline).

The public surface: `Trainer` (sharded init + compiled step), `from_nnx` / `from_linen` (bring your
own Flax model), `RULES` (logical axis -> mesh axis), `make_mesh`, and `config.load`.
"""
from jaxpar import hostmem

hostmem.configure()  # before JAX starts its threads; see hostmem.py

from jaxpar import config  # noqa: E402
from jaxpar.config import Config, ConfigError  # noqa: E402
from jaxpar.model import ModelDef, from_linen, from_nnx  # noqa: E402
from jaxpar.rules import RULES  # noqa: E402
from jaxpar.step import Trainer  # noqa: E402

__version__ = "0.1.0"


def make_mesh(spec: str):
  """'2x4x1' -> Mesh(data=2, model=4, pipeline=1) over the first 8 devices."""
  import jax

  from jaxpar import mesh
  shape = mesh.parse(spec)
  n = shape[0] * shape[1] * shape[2]
  if n > len(jax.devices()):
    raise ConfigError(f"mesh {spec} needs {n} devices, found {len(jax.devices())} "
                      f"(data={shape[0]}, model={shape[1]}, pipeline={shape[2]})")
  return mesh.make(shape, jax.devices()[:n])


__all__ = ["Config", "ConfigError", "ModelDef", "RULES", "Trainer", "config", "from_linen",
           "from_nnx", "make_mesh", "__version__"]
