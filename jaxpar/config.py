"""The only place defaults live: frozen dataclasses, YAML files and `--set key=value` overrides.

A config file holds only what differs from the defaults. An unknown key, a value of the wrong type
or a value out of range raises `ConfigError` with one sentence naming the key and what is valid.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml


class ConfigError(ValueError):
  """Bad user input: the message is one sentence the CLI prints before exiting with code 2."""


class RunError(RuntimeError):
  """The run cannot go on for a reason outside its input (a full disk): the message is one
  sentence the CLI prints before exiting with code 1."""


@dataclass(frozen=True)
class ModelConfig:
  kind: str = "gpt"  # gpt (GPT-2 style) | llama (RMSNorm, rotary, SwiGLU) | cnn
  # A Hugging Face model folder (GPT-2, Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3,
  # Qwen3-MoE; docs/moe.md): its config.json sets the model keys below (what --set or the file
  # give still wins) and its weights start a new run.
  init_from: str = ""
  n_layers: int = 4  # transformer blocks (cnn: unused)
  d_model: int = 128  # width of the residual stream
  n_heads: int = 4  # attention heads; split over the model axis, so divisible by it
  n_kv_heads: int = 0  # 0 = n_heads (multi-head attention); fewer = grouped-query attention
  # gpt, llama: each head's width; 0 = d_model / n_heads. Set, the q, k, v projections are
  # n_heads x head_dim wide whatever d_model is (Qwen3's decoupled head_dim, e.g. 128 at d_model
  # 1024 with 16 heads)
  head_dim: int = 0
  d_ff: int = 512  # hidden units of each block's MLP; divisible by the model axis; at most 2**20
  vocab_size: int = 256  # byte-level tokens
  # gpt, llama: the embedding and LM head hold vocab_size rounded up to a multiple of this (GPT-2's
  # 50,257 -> 50,304, which splits over model); the padding's logits are masked out of the softmax,
  # the loss and sampling, never exported nor counted. 1 = none (a checkpoint from before the key)
  vocab_multiple: int = 64
  seq_len: int = 128  # tokens per training sequence (the context window)
  tie_embeddings: bool = False  # the LM head is the token embedding transposed (GPT-2's layout)
  # gpt: rows of the position table; 0 = seq_len (imports keep theirs). llama: the longest
  # sequence it is exact for, an imported sliding window (jaxpar's attention has none)
  max_positions: int = 0
  norm_eps: float = 1e-5  # llama: RMSNorm epsilon
  rope_theta: float = 10000.0  # llama: rotary base
  qkv_bias: bool = False  # llama: biases on the q, k, v projections (Qwen2, Qwen2-MoE)
  qk_norm: bool = False  # llama: RMSNorm of each head's q and k before rotary (Qwen3, Qwen3-MoE)
  # gpt, llama: residual dropout (GPT-2's) on the embeddings and on each block's attention and MLP
  # outputs, in training only; its masks follow each step's key (train.seed, the step) and the
  # global batch row, so every layout draws the same ones. In [0, 1); not with a pipeline.
  dropout: float = 0.0
  # gpt, llama: mixture of experts (docs/moe.md). n_experts=0: a dense MLP in every block; else
  # n_experts (at most 4096) experts of width moe_d_ff (0 = d_ff), each token sent to
  # experts_per_token of them; shared_experts: always-on experts (one dense MLP of their summed
  # width), scaled per token by sigmoid(x . w) with shared_expert_gate (Qwen2-MoE). router_softmax:
  # after_topk = softmax over the k chosen logits (Mixtral) | before_topk = over all experts
  # (Qwen2-MoE's default). capacity_factor: 0 = dropless; > 0 = each expert takes at most
  # ceil(factor x tokens x k / E) of a device's tokens. moe_every=k: layer i is a mixture iff
  # (i + 1) % k == 0 (decoder_sparse_step), the others dense MLPs of width d_ff.
  n_experts: int = 0
  experts_per_token: int = 2  # k: the experts the router sends each token to
  moe_every: int = 1  # every how many layers is a mixture (1: every layer)
  shared_experts: int = 0  # always-on experts added to every token
  moe_d_ff: int = 0  # each expert's hidden units, at most 2**20; 0 = d_ff
  router_softmax: str = "after_topk"  # after_topk | before_topk (see n_experts)
  capacity_factor: float = 0.0  # 0 = dropless; else each expert's share of a device's tokens
  shared_expert_gate: bool = False  # sigmoid(x . w) scales the shared experts (Qwen2-MoE)
  num_classes: int = 10  # cnn only

  def padded_vocab(self) -> int:
    """The rows of the embedding (columns of the head): vocab_size rounded up to vocab_multiple."""
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

  def head_width(self) -> int:
    """K, each attention head's width: head_dim, or d_model / n_heads where it is 0."""
    return self.head_dim or self.d_model // self.n_heads

  def is_mixture(self, layer: int) -> bool:
    """Whether layer `layer` (from 0) is a mixture of experts: (layer + 1) % moe_every == 0."""
    return bool(self.n_experts) and (layer + 1) % self.moe_every == 0

  def mixture_layers(self) -> int:
    """How many of the layers are mixtures of experts (0 without experts)."""
    return self.n_layers // self.moe_every if self.n_experts else 0


@dataclass(frozen=True)
class DataConfig:
  source: str = "local_text"  # local_text | jsonl | images | tfds | synthetic
  name: str = ""  # TFDS dataset name when source=tfds
  split: str = "train"  # the split trained on
  # local_text, images: built there, "" = <workdir>/data; tfds: "" = TFDS's default
  data_dir: str = ""
  # local_text: a folder of text files, "" = this Python's standard library; images: a folder of
  # class subfolders of images (PNG, JPEG, ...) or an .npz of images and labels (docs/data.md);
  # jsonl: a folder of <split>.jsonl files of prompt/completion or messages records
  # (docs/fine-tune-data.md)
  path: str = ""
  # images: resize every image to HxW (or SIDE) pixels, H x W at most 2**26 (8192x8192); "" = as
  # they are (each of at most 2**26 pixels: a larger one is refused before it is decoded)
  image_size: str = ""
  max_bytes: int = 8_000_000  # local_text: cap on bytes read from the folder (0 = no cap)
  eval_split: str = "validation"  # split evaluated every train.eval_every steps
  augment: bool = False  # images: random flips and 4-pixel crops of training batches
  tokenizer: str = ""  # text: a `tokenizers` file (tokenizer.json) or a folder with one; "" = bytes
  # jsonl: a record longer than a window (model.seq_len + 1 tokens) is refused (refuse) or cut
  # into window-long pieces, each packed as a record of its own (split)
  long_records: str = "refuse"
  # local_text, images: seconds a run waits for another process building the same dataset under
  # data.data_dir (it says which pid and host hold the build while it waits) before it gives up;
  # a builder stopped on this host (SIGSTOP) is given up on at once
  lock_timeout: float = 3600.0
  # tfds: background threads reading and transforming batches; local_text and synthetic: any
  # N > 0 is one thread reading two batches ahead (0 = everything in the loop)
  workers: int = 2
  # text (local_text, tfds; docs/packing.md): documents = segment_ids keep a window's documents
  # apart (positions from 0, attention inside each; a document a window cuts goes on in the next
  # as a segment of its own). stream = attention across documents (jaxpar before this key).
  # Default documents: a folder's files are unrelated texts. Cost: a (B, T+1) int32 leaf, a mask
  # on attention's scores, no cuDNN fused attention on GPU. synthetic data: the two are the same
  packing: str = "documents"  # documents | stream


@dataclass(frozen=True)
class TrainConfig:
  steps: int = 300  # total optimizer steps (--steps); the schedule is compiled from it
  batch_size: int = 16  # global, in sequences (or images)
  grad_accum: int = 1  # microbatches accumulated per step; divides batch_size
  lr: float = 3e-3  # AdamW's peak learning rate, after the linear warmup
  warmup_steps: int = 30  # linear warmup from 0 (capped at steps - 1)
  min_lr_ratio: float = 0.1  # the cosine decay ends at this fraction of lr
  weight_decay: float = 0.1  # AdamW's decoupled weight decay
  b1: float = 0.9  # Adam's first-moment decay
  b2: float = 0.95  # Adam's second-moment decay
  clip_norm: float = 1.0  # global gradient-norm clipping (0 = none)
  seed: int = 0  # data shuffling and each step's dropout key
  log_every: int = 10  # steps between logged metrics rows
  eval_every: int = 0  # evaluate on data.eval_split every N steps (0 = never)
  # batches per evaluation (0 = the whole split: every example, the last batch padded and masked)
  eval_steps: int = 10
  skip_nonfinite: bool = False  # a step with a non-finite loss or gradient leaves the state as it was
  # Loss-spike guard (off at 0; jaxpar.SpikeGuard for a loop of your own): a non-finite loss or
  # gradient norm, or spike_steps losses in a row above spike_factor x the median of the last
  # spike_window losses, restores the last state a good loss has judged (a host copy), skips the
  # batches since and goes on; after max_rollbacks rollbacks the next spike stops the run.
  spike_factor: float = 0.0
  spike_steps: int = 2  # losses in a row above the threshold that make a spike
  spike_window: int = 100  # losses the running median is taken over
  max_rollbacks: int = 3  # rollbacks allowed before a spike stops the run
  # A step that makes no progress this long ends the run (exit 1) with every thread's Python
  # stack and one sentence naming the processes that stopped answering. 0 = the default: 900 s
  # for the first step, saves and evaluations; later, the larger of 60 s and 10x the longest wait.
  stall_timeout: float = 0.0
  first_step_timeout: float = 0.0  # the same limit for the first step, saves and evaluations
  # With several processes, a wait on the others ends early once a process's heartbeat has stood
  # still this long, naming it; a shorter pause is waited out. 0 = the default, 0.3 x the heartbeat
  # timeout JAX is given (60 s of 200 s: --heartbeat-timeout); at most 0.4 x it, since JAX aborts
  # every process for a silent one from half its heartbeat timeout on.
  peer_timeout: float = 0.0
  # Compiled programs kept on disk, so a restart loads its step instead of compiling it: "" = none
  # if $JAX_ENABLE_COMPILATION_CACHE is false, else $JAX_COMPILATION_CACHE_DIR, else
  # $JAXPAR_COMPILE_CACHE (a folder or off), else ~/.cache/jaxpar/xla; "off" = none; else a folder.
  compile_cache: str = ""
  # The most the cache keeps, in GiB, for JAX's programs (<cache>/jax) and again for jaxpar's
  # stored steps (<cache>/jaxpar-steps): past it the least recently used entries go first (only
  # entries jaxpar wrote there ever go). 0 = no bound.
  compile_cache_max_gb: float = 10.0
  # mixture of experts: weights of the router's load-balancing loss (Switch/Mixtral: n_experts x
  # sum over experts of token fraction x mean router probability) and z-loss (ST-MoE: mean squared
  # log-sum-exp of the router logits), added to the training loss
  moe_aux_weight: float = 0.01
  moe_z_weight: float = 0.001  # weight of the router's z-loss (see moe_aux_weight)
  # LoRA (gpt, llama; docs/lora.md): lora_rank > 0 trains rank-r adapters A (in x r) and B
  # (r x out, zero at first) beside each weight lora_targets names (wq, wk, wv, wo; gpt's w1, w2;
  # llama's w_gate, w_up, w_down; e_* experts, s_* shared experts; or the groups attention, mlp,
  # experts, shared): W + lora_alpha / lora_rank * A @ B. The rest is frozen. 0 = off.
  lora_rank: int = 0
  lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank (PEFT's)
  lora_targets: str = "attention"


@dataclass(frozen=True)
class ParallelConfig:
  zero_stage: int = 0  # ZeRO over data: 1 optimizer state, 2 + gradients, 3 + parameters
  offload_optimizer: bool = False  # keep the AdamW moments in pinned host memory
  microbatches: int = 0  # pipeline microbatches per step; 0 = 2 x the pipeline degree
  schedule: str = "gpipe"  # gpipe | circular | 1f1b
  virtual_stages: int = 1  # layer blocks per pipeline stage (circular schedule only)
  # per-layer activation checkpointing: none | full (save only each layer's input) |
  # dots_saveable (keep weight matmuls' outputs) | offload (keep them in pinned_host); true = full
  remat: str = "none"
  # Megatron sequence parallelism: norms and residuals split along `seq` over `model`; the
  # tensor-parallel all-reduces become reduce-scatter + all-gather
  sequence_parallel: bool = False
  # attention over a `context` axis: ring (keys and values passed round, one chunk pair held at a
  # time) | allgather (all gathered at once, C chunk pairs held) | auto (ring, or allgather
  # under a pipeline, whose stages may run only all-gathers and reduce-scatters in their branches)
  context_attention: str = "auto"


@dataclass(frozen=True)
class PrecisionConfig:
  param_dtype: str = "float32"  # storage dtype of the parameters (and their optimizer state)
  compute_dtype: str = "auto"  # auto = bfloat16 on GPU, float32 elsewhere
  # float16 compute: a static scale (a number) or "dynamic" (a no-op with other compute dtypes):
  # an overflowing step is skipped and multiplies the scale by `backoff` (not below `min_scale`);
  # `growth_interval` finite steps in a row double it. The scale is part of the train state.
  loss_scale: str = "1.0"
  initial_scale: float = 65536.0  # 2**16, DeepSpeed's and torch.amp's start
  growth_interval: int = 2000  # finite steps in a row that double a dynamic scale
  backoff: float = 0.5  # factor on the scale after an overflowing step
  min_scale: float = 1.0  # the dynamic scale's floor


@dataclass(frozen=True)
class CheckpointConfig:
  every: int = 0  # 0 = only at the end
  keep: int = 3  # complete checkpoints kept; older ones are deleted


@dataclass(frozen=True)
class Config:
  model: ModelConfig = field(default_factory=ModelConfig)
  data: DataConfig = field(default_factory=DataConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  parallel: ParallelConfig = field(default_factory=ParallelConfig)
  precision: PrecisionConfig = field(default_factory=PrecisionConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_DTYPES = ("float32", "bfloat16", "float16")
_CHOICES = {
    "data.source": ("local_text", "jsonl", "images", "tfds", "synthetic"),
    "data.long_records": ("refuse", "split"),
    "data.packing": ("documents", "stream"),
    "parallel.schedule": ("gpipe", "circular", "1f1b"),
    "parallel.remat": ("none", "full", "dots_saveable", "offload"),
    "parallel.context_attention": ("auto", "ring", "allgather"),
    "model.router_softmax": ("after_topk", "before_topk"),
    "precision.param_dtype": _DTYPES,
    "precision.compute_dtype": ("auto",) + _DTYPES,
}
_POSITIVE = ("model.n_layers", "model.d_model", "model.n_heads", "model.d_ff", "model.vocab_size",
             "model.seq_len", "model.num_classes", "train.steps", "train.batch_size",
             "train.grad_accum", "train.log_every",
             "parallel.virtual_stages", "checkpoint.keep", "precision.initial_scale",
             "precision.growth_interval", "precision.min_scale", "model.norm_eps", "model.rope_theta",
             "train.spike_steps", "train.spike_window", "model.experts_per_token",
             "model.moe_every", "model.vocab_multiple", "data.lock_timeout")
# Upper bounds, checked before anything is allocated (a typo is one sentence, not an allocation
# that fails minutes later); far above any published model's (Llama 3 405B: d_ff 53,248).
_AT_MOST = {"model.d_ff": 2**20, "model.moe_d_ff": 2**20, "model.n_experts": 4096}
# The most pixels of one image jaxpar reads or resizes to (8192 x 8192): a larger one is refused
# before it is decoded (a decompression bomb: 20000 x 20000 zeros are 400 MB from a few KB).
MAX_IMAGE_PIXELS = 2**26
_BELOW_ONE = ("train.b1", "train.b2", "model.dropout")  # in [0, 1): Adam's betas, dropout
_FRACTION = ("train.min_lr_ratio",)  # in [0, 1]: the final learning rate, a fraction of the peak
_NON_NEGATIVE = ("model.n_kv_heads", "model.head_dim", "model.max_positions", "parallel.microbatches", "train.warmup_steps", "train.weight_decay", "train.clip_norm",
                 "checkpoint.every", "data.max_bytes", "train.lr", "data.workers",
                 "train.eval_every", "train.eval_steps", "train.max_rollbacks",
                 "train.stall_timeout", "train.first_step_timeout", "train.peer_timeout",
                 "train.compile_cache_max_gb", "model.n_experts", "model.shared_experts",
                 "model.moe_d_ff", "model.capacity_factor", "train.moe_aux_weight",
                 "train.moe_z_weight", "train.lora_rank")


def _field_types(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, typ: Any) -> Any:
  """Converts a YAML or --set value to the field's type, or raises ConfigError."""
  if isinstance(value, str) and typ is not str:
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError:
      pass
  if typ is bool:
    if isinstance(value, bool):
      return value
  elif typ is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif typ is float:
    if isinstance(value, str):
      try:
        return float(value)  # YAML reads "1e-3" as a string
      except ValueError:
        pass
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif typ is str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
  raise ConfigError(f"config key {key} must be of type {typ.__name__}, got {value!r}")


# Earlier spellings still accepted: parallel.remat was a bool.
_ALIASES = {"parallel.remat": {True: "full", False: "none", "true": "full", "false": "none"}}


def _apply(cfg: Config, key: str, value: Any) -> Config:
  if key in _ALIASES and isinstance(value, (bool, str)):
    value = _ALIASES[key].get(value.lower() if isinstance(value, str) else value, value)
  parts = key.split(".")
  if len(parts) != 2:
    raise ConfigError(f"unknown config key: {key} (keys look like section.name, e.g. train.lr)")
  section, name = parts
  sections = _field_types(Config)
  if section not in sections:
    raise ConfigError(f"unknown config key: {key} (sections: {', '.join(sections)})")
  sub = getattr(cfg, section)
  types_ = _field_types(type(sub))
  if name not in types_:
    raise ConfigError(f"unknown config key: {key} (valid in {section}: {', '.join(types_)})")
  new_sub = dataclasses.replace(sub, **{name: _coerce(key, value, types_[name])})
  return dataclasses.replace(cfg, **{section: new_sub})


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  if isinstance(tree, dict):
    out = []
    for k, v in tree.items():
      out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    return out
  return [(prefix, tree)]


def validate(cfg: Config) -> Config:
  """Range and choice checks that do not depend on the mesh."""
  for key, choices in _CHOICES.items():
    value = get(cfg, key)
    if value not in choices:
      raise ConfigError(f"config key {key}={value!r} is not one of {', '.join(choices)}")
  for section in dataclasses.fields(cfg):
    for f in dataclasses.fields(getattr(cfg, section.name)):
      value = getattr(getattr(cfg, section.name), f.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {section.name}.{f.name}={value} must be a finite number")
  for key in _POSITIVE:
    if get(cfg, key) <= 0:
      raise ConfigError(f"config key {key}={get(cfg, key)} must be positive")
  for key in _NON_NEGATIVE:
    if get(cfg, key) < 0:
      raise ConfigError(f"config key {key}={get(cfg, key)} must not be negative")
  for key, most in _AT_MOST.items():
    if get(cfg, key) > most:
      raise ConfigError(f"config key {key}={get(cfg, key)} is above {most:,}, the most jaxpar "
                        f"builds")
  if cfg.data.image_size:
    parse_image_size(cfg.data.image_size, "data.image_size=")
  for key in _BELOW_ONE + _FRACTION:
    value = get(cfg, key)
    if not (0 <= value < 1 or (key in _FRACTION and value == 1)):
      raise ConfigError(f"config key {key}={value} must be in {'[0, 1]' if key in _FRACTION else '[0, 1)'}")
  if cfg.train.spike_factor and not cfg.train.spike_factor > 1:
    raise ConfigError(f"config key train.spike_factor={cfg.train.spike_factor} must be 0 (no "
                      f"loss-spike guard) or above 1 (a multiple of the running median loss)")
  if cfg.parallel.virtual_stages > 1 and cfg.parallel.schedule != "circular":
    raise ConfigError("parallel.virtual_stages > 1 needs parallel.schedule=circular")
  if cfg.parallel.zero_stage not in (0, 1, 2, 3):
    raise ConfigError(f"config key parallel.zero_stage={cfg.parallel.zero_stage} must be 0, 1, 2 or 3")
  _check_loss_scale(cfg.precision)
  _check_experts(cfg.model)
  _check_lora(cfg)
  if cfg.train.batch_size % cfg.train.grad_accum:
    raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by "
                      f"train.grad_accum={cfg.train.grad_accum}")
  if cfg.data.source == "tfds" and not cfg.data.name:
    raise ConfigError("data.source=tfds needs data.name (a TFDS dataset name, e.g. lm1b)")
  return cfg


def parse_image_size(text: str, what: str = "--size ") -> tuple[int, int]:
  """'32' or '32x48' -> (height, width), at most MAX_IMAGE_PIXELS; `what` names the setting."""
  m = re.fullmatch(r"(\d+)(?:x(\d+))?", text.strip())
  if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
    raise ConfigError(f"{what}{text} is not HEIGHTxWIDTH or SIDE in pixels (e.g. 32x32 or 32)")
  h, w = int(m.group(1)), int(m.group(2) or m.group(1))
  if h * w > MAX_IMAGE_PIXELS:
    raise ConfigError(f"{what}{text} is {h * w:,} pixels an image, more than the "
                      f"{MAX_IMAGE_PIXELS:,} (8192x8192) jaxpar resizes to")
  return h, w


_MOE_KEYS = ("experts_per_token", "moe_every", "shared_experts", "moe_d_ff", "router_softmax",
             "capacity_factor", "shared_expert_gate")


def _check_experts(mc: ModelConfig) -> None:
  for name in ("qkv_bias", "qk_norm"):
    if getattr(mc, name) and mc.kind != "llama":
      raise ConfigError(f"config key model.{name}=True is for model.kind=llama, not {mc.kind}")
  if not mc.n_experts:
    dense = ModelConfig()
    for name in _MOE_KEYS:
      if getattr(mc, name) != getattr(dense, name):
        raise ConfigError(f"config key model.{name}={getattr(mc, name)!r} needs "
                          f"model.n_experts > 0 (a mixture of experts)")
    return
  if mc.experts_per_token > mc.n_experts:
    raise ConfigError(f"config key model.experts_per_token={mc.experts_per_token} is more than "
                      f"model.n_experts={mc.n_experts}")
  if mc.shared_expert_gate and not mc.shared_experts:
    raise ConfigError("config key model.shared_expert_gate=True needs model.shared_experts > 0")
  if mc.n_layers % mc.moe_every:
    raise ConfigError(f"config key model.moe_every={mc.moe_every} does not divide "
                      f"model.n_layers={mc.n_layers}: every group of moe_every layers ends in one "
                      "mixture of experts")


def _check_lora(cfg: Config) -> None:
  tc, off = cfg.train, TrainConfig()
  if not tc.lora_rank:
    for name in ("lora_alpha", "lora_targets"):
      if getattr(tc, name) != getattr(off, name):
        raise ConfigError(f"config key train.{name}={getattr(tc, name)!r} needs "
                          f"train.lora_rank > 0 (LoRA adapters)")
    return
  if not tc.lora_alpha > 0:
    raise ConfigError(f"config key train.lora_alpha={tc.lora_alpha} must be positive (the "
                      f"adapters' scale is lora_alpha / lora_rank)")
  if cfg.model.kind not in ("gpt", "llama"):
    raise ConfigError(f"config key train.lora_rank={tc.lora_rank} is for model.kind gpt or llama, "
                      f"not {cfg.model.kind}")


def _check_loss_scale(pc: PrecisionConfig) -> None:
  if pc.loss_scale != "dynamic":
    try:
      value = float(pc.loss_scale)
    except ValueError:
      value = math.nan
    if not (math.isfinite(value) and value > 0):
      raise ConfigError(f"config key precision.loss_scale={pc.loss_scale!r} must be a positive "
                        f"number or dynamic")
  if not 0 < pc.backoff < 1:
    raise ConfigError(f"config key precision.backoff={pc.backoff} must be between 0 and 1")
  if pc.min_scale > pc.initial_scale:
    raise ConfigError(f"config key precision.min_scale={pc.min_scale} is above "
                      f"precision.initial_scale={pc.initial_scale}")


def microbatches(cfg: Config, stages: int) -> int:
  """parallel.microbatches, with 0 meaning 2 x the pipeline degree (1 without a pipeline)."""
  return cfg.parallel.microbatches or (2 * stages if stages > 1 else 1)


def compile_cache_max_bytes(cfg: Config) -> int:
  """train.compile_cache_max_gb in bytes (0: no bound)."""
  return int(cfg.train.compile_cache_max_gb * 2**30)


def get(cfg: Config, key: str) -> Any:
  section, name = key.split(".")
  return getattr(getattr(cfg, section), name)


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
         base: Callable[[str], dict[str, Any]] | None = None,
         follow: Callable[[Config], dict[str, Any]] | None = None) -> Config:
  """Defaults, then the YAML file at `path`, then `key=value` overrides (later wins).

  With `model.init_from`, `base(folder)` gives the model keys read from that folder (for a Hugging
  Face folder, `jaxpar.interop.hf.model_overrides`); they come right after the defaults, as do
  the keys `follow(config)` gives ({'section.key': value}: what follows from the data, such as
  the class count of data.source=images). A folder's tokenizer: `with_folder_tokenizer`.
  """
  cfg = _load(Config(), path, overrides)
  first = Config()
  if cfg.model.init_from:
    if base is None:
      raise ConfigError(f"model.init_from={cfg.model.init_from} needs the folder's model keys: "
                        "load with base=jaxpar.interop.hf.model_overrides")
    first = _apply(first, "model.init_from", cfg.model.init_from)
    for name, value in base(cfg.model.init_from).items():
      first = _apply(first, f"model.{name}", value)
  if follow is not None:
    for key, value in follow(cfg).items():
      first = _apply(first, key, value)
  if first != Config():
    cfg = _load(first, path, overrides)
  return validate(with_folder_tokenizer(cfg))


def with_folder_tokenizer(cfg: Config) -> Config:
  """`cfg` with data.tokenizer set to the model.init_from folder when that holds a tokenizer.json
  and text is read without one: a model fine-tunes on its own tokens, as generation and
  export --hf speak them. Synthetic data stays byte tokens."""
  folder = cfg.model.init_from
  if (folder and not cfg.data.tokenizer and cfg.data.source in ("local_text", "jsonl", "tfds")
      and os.path.isfile(os.path.join(folder, "tokenizer.json"))):
    return _apply(cfg, "data.tokenizer", folder)
  return cfg


def _load(cfg: Config, path: str | None, overrides) -> Config:
  """`cfg` with the YAML file at `path` and then the `key=value` overrides applied."""
  if path:
    if not os.path.isfile(path):
      raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
      try:
        tree = yaml.safe_load(f) or {}
      except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
      raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(tree).__name__}")
    sections = {f.name for f in dataclasses.fields(cfg)}
    for section, body in tree.items():
      if section in sections and not isinstance(body, dict):
        raise ConfigError(f"config file {path}: section {section} must hold a mapping of its "
                          f"keys, like 'train: {{steps: 10}}', got {body!r}")
    for key, value in _flatten(tree):
      cfg = _apply(cfg, key, value)
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set takes key=value, got {item!r}")
    key, value = item.split("=", 1)
    cfg = _apply(cfg, key.strip(), value)
  return cfg


def override(cfg: Config, **sections: dict[str, Any]) -> Config:
  """Python-side overrides: override(cfg, train={'steps': 5}). Same checks as --set."""
  for section, values in sections.items():
    for name, value in values.items():
      cfg = _apply(cfg, f"{section}.{name}", value)
  return validate(cfg)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
  return dataclasses.asdict(cfg)


def from_dict(tree: dict[str, Any]) -> Config:
  """A stored config (a checkpoint's) back as a Config; one written before model.vocab_multiple
  existed held its vocabulary unpadded, so it is read with 1."""
  if isinstance(tree.get("model"), dict) and "vocab_multiple" not in tree["model"]:
    tree = {**tree, "model": {**tree["model"], "vocab_multiple": 1}}
  cfg = Config()
  for key, value in _flatten(tree):
    cfg = _apply(cfg, key, value)
  return validate(cfg)




# Keys that decide *what* is trained: a checkpoint only continues a run that agrees on all of them.
# The rest say *how* it runs (mesh, ZeRO stage, schedule, steps, learning rate...) and may change
# between a save and a resume. Where the data lives (data.data_dir) and how many threads read it
# (data.workers) do not change the data.
_WHAT_IS_TRAINED = ("model.", "data.", "train.batch_size", "train.seed", "precision.param_dtype",
                    "train.lora_")
_HOW_DATA_IS_READ = ("data.data_dir", "data.workers")
# Paths: compared as the files they name. A run stores them absolute (`absolute_paths`), so a
# relative one typed in another folder is not taken for the same data.
_PATH_KEYS = ("data.path", "data.tokenizer")


def absolute_paths(cfg: Config) -> Config:
  """`cfg` with its data paths absolute, as a run saves them."""
  paths = {key.split(".")[1]: os.path.abspath(v) for key, v in _flatten(to_dict(cfg))
           if key in _PATH_KEYS and v}
  return override(cfg, data=paths) if paths else cfg


def resume_mismatch(stored: dict, cfg: Config) -> list[str]:
  """Keys that decide what is trained on which `stored` (a checkpoint's config dict) and `cfg`
  disagree, as 'key=stored->now'; empty when the checkpoint continues this run."""
  now = dict(_flatten(to_dict(cfg)))
  defaults = dict(_flatten(to_dict(Config())))
  out = []
  for key, value in now.items():
    if not key.startswith(_WHAT_IS_TRAINED) or key in _HOW_DATA_IS_READ:
      continue
    section, name = key.split(".")
    before = stored.get(section, {}).get(name, defaults[key])  # saved before the key existed
    if key in _PATH_KEYS and before and value:  # the same file however it is spelled
      same = os.path.realpath(before) == os.path.realpath(value)
    elif key == "model.vocab_multiple":  # the same rows, however rounded (unpadded before it)
      before = stored.get("model", {}).get(name, 1)
      V = stored.get("model", {}).get("vocab_size", defaults["model.vocab_size"])
      same = -(-V // before) * before == cfg.model.padded_vocab()
    else:
      same = before == value
    if not same:
      out.append(f"{key}={before!r}->{value!r}")
  return out
