"""Builds the model `model.kind` names (jaxpar/kinds.py lists the kinds and where each is built)."""
from __future__ import annotations

import importlib
from dataclasses import replace
from types import ModuleType

from jaxpar import kinds
from jaxpar.config import Config, ConfigError
from jaxpar.models.base import ModelDef


def module(kind: str) -> ModuleType:
  """The module that builds `kind` (one of this package's models/ modules, named by kinds.py)."""
  return importlib.import_module(kinds.get(kind).module)


def build_model(cfg: Config) -> ModelDef:
  """The ModelDef for `model.kind`, once its model keys are checked."""
  kinds.check(cfg)
  return replace(module(cfg.model.kind).model_def(cfg), kind=cfg.model.kind)


def decoder(cfg: Config) -> ModelDef:
  """jaxpar's decoder `model.kind` (gpt or llama): see models/decoder.py."""
  if not kinds.get(cfg.model.kind).decoder:
    raise ConfigError(f"model.kind={cfg.model.kind} is not a decoder "
                      f"({' and '.join(kinds.DECODERS)} are)")
  return build_model(cfg)


gpt = decoder  # the name jaxpar's GPT has always been built by


def decoder_parts(mc):
  """The embed / block / head functions of the decoder `mc.kind` (models/decoder.py)."""
  return module(mc.kind).parts(mc)
