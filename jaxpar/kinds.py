"""The model kinds `model.kind` names: one entry per kind, the one place a new model is declared.

Each entry says what the layers above need to know without building the model: whether it is a
decoder (attention heads and a stack of layers, so tensor parallelism, the pipeline, sequence
parallelism, generation and Hugging Face interop apply), the module that builds it (its
`model_def(cfg)`; models/registry.py imports it), the Hugging Face architecture it reads and
writes, and the checks of its `model.*` keys that need no mesh. The mesh check
(parallel/mesh.py), the model registry, the commands and interop/hf.py all read this table.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpar.config import Config, ConfigError, ModelConfig


def _decoder_problems(m: ModelConfig) -> list[str]:
  problems = []
  if m.d_model % m.n_heads and not m.head_dim:
    problems.append(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
  kv = m.n_kv_heads or m.n_heads
  if m.n_heads % kv:
    problems.append(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv}")
  if m.max_positions and m.max_positions < m.seq_len:
    problems.append(f"model.max_positions={m.max_positions} is shorter than "
                    f"model.seq_len={m.seq_len}")
  return problems


def _llama_problems(m: ModelConfig) -> list[str]:
  problems = _decoder_problems(m)
  K, says = (m.head_dim, "model.head_dim") if m.head_dim else (m.d_model // m.n_heads,
                                                                  "model.d_model/model.n_heads")
  if not problems and K % 2:
    problems.append(f"{says}={K} must be even: rotary embeddings turn pairs of dimensions")
  return problems


@dataclasses.dataclass(frozen=True)
class Kind:
  name: str
  module: str  # the module whose model_def(cfg) builds it
  decoder: bool  # heads and a layer stack: tensor/sequence parallel, pipeline, generate, HF
  hf_architecture: str | None = None  # the Hugging Face `architectures` entry it reads/writes
  problems: Callable[[ModelConfig], list[str]] = lambda m: []  # mesh-free checks of model.*


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("gpt", "jaxpar.models.gpt", decoder=True, hf_architecture="GPT2LMHeadModel",
         problems=_decoder_problems),
    Kind("llama", "jaxpar.models.llama", decoder=True, hf_architecture="LlamaForCausalLM",
         problems=_llama_problems),
    Kind("cnn", "jaxpar.models.cnn", decoder=False,
         problems=lambda m: [f"model.{k}={getattr(m, k)} is for the decoders (gpt, llama); the "
                             "cnn has none, use 0" for k in ("dropout", "n_experts")
                             if getattr(m, k)]),
)}
DECODERS = tuple(name for name, k in KINDS.items() if k.decoder)


def get(name: str) -> Kind:
  """The entry of `name`; one sentence naming the kinds there are where it is none of them."""
  if name not in KINDS:
    raise ConfigError(f"config key model.kind={name!r} is not one of {', '.join(KINDS)}")
  return KINDS[name]


def check(cfg: Config) -> Config:
  """`cfg` when its model.kind exists and its model keys fit that kind (no mesh needed)."""
  problems = get(cfg.model.kind).problems(cfg.model)
  if problems:
    raise ConfigError(problems[0] if len(problems) == 1 else "; ".join(problems))
  return cfg


def by_architecture(arch: str | None) -> Kind | None:
  return next((k for k in KINDS.values() if arch and k.hf_architecture == arch), None)
