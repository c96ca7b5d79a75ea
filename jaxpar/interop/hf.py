"""Hugging Face model folders in and out: GPT2LMHeadModel and the Llama family (Llama, Mistral,
Qwen2, Qwen3, and the mixtures Mixtral, Qwen2-MoE, Qwen3-MoE; its config.json is hf_llama.py's).

In: `config.json` gives the model keys (`model_overrides`); `*.safetensors` (one file or a sharded
index) give the parameters, read one jaxpar tensor at a time and put straight onto its sharding
(`load_params`), so no host holds more of the model than that tensor. Out (`export`): the same
layout, written tensor by tensor, with a `config.json` that `transformers` loads with
`from_pretrained` and no missing or unexpected keys, and the run's tokenizer files
(`write_tokenizer`).

Layout differences handled here: GPT-2's Conv1D weights are (in, out) like jaxpar's, Llama's
Linear weights are (out, in) and are transposed; GPT-2's joined q/k/v is split (its key bias is
dropped: it shifts every score of a query equally, which softmax ignores, and is written back as
zeros); layers are stacked on jaxpar's leading axis, a mixture's experts on the next. Both use
rotary / position conventions that jaxpar's decoders share, so nothing is permuted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np

from jaxpar import config as jconfig
from jaxpar import kinds
from jaxpar.config import ConfigError
from jaxpar.data import jsonl
from jaxpar.data.windows import END_OF_TEXT
from jaxpar.interop import hf_llama, peft
from jaxpar.interop.export import STEP_REMEDY, checkpoint_step, write_safetensors, writes
from jaxpar.interop import generate
from jaxpar.interop.generate import Codec
from jaxpar.models.hf_weights import (MIXTRAL_MOE, QWEN_MOE, Folder,  # noqa: F401 (the weights'
                                      _read_json, layers_of, load_params, names,  # side)
                                      read_param)
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train import checkpoint
from jaxpar.train.step import Trainer

GPT2, LLAMA = kinds.KINDS["gpt"].hf_architecture, kinds.KINDS["llama"].hf_architecture
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # what jax.nn.gelu (tanh form) computes


def architecture(folder: str) -> tuple[str, dict]:
  """(architecture, config.json) of a model folder; ConfigError when it is not one jaxpar reads."""
  path = os.path.join(folder, "config.json")
  hf = _read_json(path)
  arch = (hf.get("architectures") or [None])[0]
  if arch not in (GPT2,) + hf_llama.ARCHITECTURES:
    raise ConfigError(f"{path}: architecture {arch!r} is not supported (jaxpar reads {GPT2}, "
                      f"{', '.join(hf_llama.ARCHITECTURES)})")
  return arch, hf


def model_overrides(folder: str) -> dict[str, Any]:
  """The `model.*` config keys that build the folder's model in jaxpar."""
  arch, hf = architecture(folder)
  path = os.path.join(folder, "config.json")

  def refuse(key, value, want):
    raise ConfigError(f"{path}: {key}={value!r} is not supported (jaxpar needs {want})")
  if arch != GPT2:
    return hf_llama.model_overrides(arch, hf, refuse)
  if hf.get("activation_function", "gelu_new") not in _GPT2_ACTS:
    refuse("activation_function", hf.get("activation_function"), " or ".join(_GPT2_ACTS))
  if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
    refuse("layer_norm_epsilon", hf.get("layer_norm_epsilon"), 1e-5)
  for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
    if hf.get(key):
      refuse(key, hf[key], False)
  D = hf["n_embd"]
  return {"kind": "gpt", "n_layers": hf["n_layer"], "d_model": D, "n_heads": hf["n_head"],
          "n_kv_heads": 0, "d_ff": hf.get("n_inner") or 4 * D, "vocab_size": hf["vocab_size"],
          "max_positions": hf["n_positions"], "tie_embeddings": hf.get("tie_word_embeddings", True)}


def hf_config(mc, cfg) -> dict:
  """config.json for jaxpar's model config `mc` in the Hugging Face layout it came from."""
  common = {"vocab_size": mc.vocab_size, "tie_word_embeddings": mc.tie_embeddings,
            "dtype": cfg.precision.param_dtype}
  eos = Codec(cfg).eos  # documents end with the run's separator byte or its  # tokenizer's end-of-text id (transformers' GPT-2 default 50256 is neither)
  common.update(bos_token_id=eos, eos_token_id=eos)
  if mc.kind == "gpt":
    return {"architectures": [GPT2], "model_type": "gpt2", "n_layer": mc.n_layers,
            "n_embd": mc.d_model, "n_head": mc.n_heads, "n_inner": mc.d_ff,
            "n_positions": mc.max_positions or mc.seq_len, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            **common}
  return {**hf_llama.hf_config(mc, hf_llama.architecture_of(mc)), **common}


def _hf_tensors(mc) -> dict[str, tuple[list[str], Callable]]:
  """HF tensor name -> (the jaxpar parameters it is made of, how): the inverse of `names`."""
  out: dict[str, tuple[list[str], Callable]] = {}
  at = lambda idx, f: (lambda *xs: f(*(x[idx] for x in xs)))  # one layer's (and expert's) slice
  same = lambda x: x
  arch = GPT2 if mc.kind == "gpt" else hf_llama.architecture_of(mc)
  layout = MIXTRAL_MOE if arch == hf_llama.MIXTRAL else QWEN_MOE
  for path, (hf_name, transform) in names(mc, layout).items():
    if mc.kind == "gpt" and "c_attn" in hf_name:
      continue  # joined below
    inverse = np.transpose if transform is np.transpose else same
    if path == "layers/shared_gate":  # (D,) per layer <- Linear(D, 1)'s (1, D)
      inverse = lambda x: x[None]
    if "{e}" in hf_name:  # row r of the stack is Hugging Face's layer i
      for r, i in enumerate(layers_of(mc, path)):
        for e in range(mc.n_experts):
          out[hf_name.format(i=i, e=e)] = ([path], at((r, e), inverse))
    elif "{i}" in hf_name:
      for r, i in enumerate(layers_of(mc, path)):
        out[hf_name.format(i=i)] = ([path], at(r, inverse))
    else:
      out[hf_name] = ([path], inverse)
  if mc.kind == "gpt":
    for i in range(mc.n_layers):
      h = f"transformer.h.{i}.attn.c_attn."
      out[h + "weight"] = (["layers/wq", "layers/wk", "layers/wv"],
                           at(i, lambda q, k, v: np.concatenate([q, k, v], -1)))
      out[h + "bias"] = (["layers/bq", "layers/bv"],
                         at(i, lambda q, v: np.concatenate([q, np.zeros_like(q), v], -1)))
  if arch == hf_llama.QWEN2_MOE:
    out.update(_qwen2_moe_fill(mc))
  V = mc.vocab_size
  if mc.padded_vocab() != V:  # the padding's rows (model.vocab_multiple) are not exported
    for hf_name, (paths, make) in list(out.items()):
      if paths in (["wte"], ["head"]):
        out[hf_name] = (paths, lambda x, make=make: make(x)[:V])
  return out


def _qwen2_moe_fill(mc) -> dict[str, tuple[list[str], Callable]]:
  """What Qwen2-MoE has and jaxpar's model may not: q/k/v biases (zeros), the shared expert's
  gate (a zero weight: sigmoid(0) = 1/2, so the shared down projection is written doubled; both
  factors powers of two, the product exact)."""
  out: dict[str, tuple[list[str], Callable]] = {}
  zeros_of = lambda x: np.zeros(x.shape[-1], x.dtype)  # a bias as wide as a kernel's outputs
  for i in range(mc.n_layers):
    h = f"model.layers.{i}."
    if not mc.qkv_bias:
      for x in "qkv":
        out[h + f"self_attn.{x}_proj.bias"] = ([f"layers/w{x}"], lambda w, i=i: zeros_of(w[i]))
  for r, i in enumerate(layers_of(mc, "layers/s_down")):  # row r of the mixtures: layer i
    h = f"model.layers.{i}."
    if not mc.shared_expert_gate:
      out[h + "mlp.shared_expert_gate.weight"] = (
          ["layers/mlp_norm"], lambda n: np.zeros((1,) + n.shape[1:], n.dtype))
      out[h + "mlp.shared_expert.down_proj.weight"] = (
          ["layers/s_down"], lambda w, r=r: np.transpose(w[r] * np.asarray(2, w.dtype)))
  return out


@dataclasses.dataclass
class Exported:
  """What `export` wrote: config.json's content, whether a generation_config.json was written,
  the `model.init_from` folder it kept the fields of (None: a run from scratch, or a folder no
  longer there: `note` says so), and the fields the run changed ('key: old -> new')."""
  config: dict
  generation_config: bool = False
  source: str | None = None
  changed: list[str] = dataclasses.field(default_factory=list)
  note: str = ""


def export(workdir: str, out_dir: str, step: int | None = None) -> Exported:
  """Writes `out_dir`/model.safetensors and config.json from a jaxpar checkpoint (and the
  `model.init_from` folder's generation_config.json, when it has one). Every field of the
  folder's config.json and generation_config.json that the run did not change is written as it
  was (`keep_source`). Tensors are written one at a time; at most the three q/k/v parameters are
  held."""
  directory, step = checkpoint_step(workdir, step)
  made = not os.path.exists(out_dir)
  try:
    with checkpoint.readable(directory, step, STEP_REMEDY):
      extra = checkpoint.read_extra(directory, step)
      if checkpoint.users_model(extra):
        raise ConfigError(f"the checkpoint of step {step} in {directory} holds a model of your "
                          f"own, which has no Hugging Face layout; export it with --out "
                          f"FILE.safetensors")
      return _export(directory, step, out_dir, jconfig.from_dict(extra.get("config", {})))
  except BaseException:
    if made and os.path.isdir(out_dir):  # nothing half-written: the folder goes with its files
      shutil.rmtree(out_dir)
    raise


def _export(directory: str, step: int, out_dir: str, cfg) -> dict:
  """`export` once the step is chosen and its config read."""
  mc = cfg.model
  if mc.kind not in ("gpt", "llama"):
    raise ConfigError(f"model.kind={mc.kind!r} has no Hugging Face layout; gpt and llama do")
  if mc.kind == "gpt" and mc.n_experts:
    raise ConfigError("a gpt-kind mixture of experts has no Hugging Face layout; llama-kind "
                      "mixtures export as Mixtral, Qwen2-MoE or Qwen3-MoE")
  if mc.kind == "gpt" and mc.head_dim and mc.head_dim != mc.d_model // mc.n_heads:
    raise ConfigError(f"a gpt-kind model with model.head_dim={mc.head_dim} has no Hugging Face "
                      f"layout (GPT-2's heads are d_model / n_heads = "
                      f"{mc.d_model // mc.n_heads} wide); llama-kind ones export as Qwen3")
  stored = checkpoint.stored_params(directory, step)
  tensors = _hf_tensors(mc)
  read = peft.merged_reader(directory, step, cfg)  # a LoRA run's weights merged with its adapters
  cache: dict[str, np.ndarray] = {}

  def param(path):  # the last few parameters read, so q/k/v and per-layer slices read each once
    if path not in cache:
      if len(cache) >= 3:
        cache.pop(next(iter(cache)))
      cache[path] = read(path)
    return cache[path]

  def shape_of(hf_name):  # from the stored shapes, on zero-stride stand-ins that take no memory
    paths, make = tensors[hf_name]
    x = make(*[np.broadcast_to(np.zeros((), stored[p].dtype), stored[p].shape) for p in paths])
    return tuple(x.shape), x.dtype
  shapes = {n: shape_of(n) for n in sorted(tensors)}
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(shapes, lambda n: tensors[n][1](*[param(p) for p in tensors[n][0]]),
                    os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
  done = keep_source(cfg)
  for name, content in (("config.json", done.config),
                        ("generation_config.json", done.generation_config)):
    if content:
      path = os.path.join(out_dir, name)
      with writes(path), open(path, "w") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
  write_tokenizer(Codec(cfg), out_dir, mc.max_positions or mc.seq_len)
  return dataclasses.replace(done, generation_config=bool(done.generation_config))


_RENDERED = object()  # a source value the run's rendering never equals: compared with the file's


def keep_source(cfg) -> Exported:
  """config.json (and generation_config.json: `generation_config`, a dict or None) for the run
  `cfg`: jaxpar's rendering of its model (`hf_config`), where the run started from a
  `model.init_from` folder merged into that folder's files, so a field the run did not change is
  the folder's, byte for byte as JSON values (token ids, max_position_embeddings, rope
  parameters, torch_dtype, architectures, anything jaxpar does not read).

  A field counts as changed where jaxpar renders it differently for the run's model than for the
  folder's own (what `model_overrides` reads from it: a `--set` of a model key shows here), and
  the rendering differs from the file's value; dicts are merged key by key. Beyond that: the token
  ids change when the run's tokens are not the folder's tokenizer's (another data.tokenizer,
  bytes); the dtype when the tensors are written in another than the file names; the longest
  position when the run trained on more positions than the file says."""
  mc = cfg.model
  ours = hf_config(mc, cfg)
  folder = mc.init_from
  if not folder:
    return Exported(ours)
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    return Exported(ours, note=f"{path} is gone: config.json is jaxpar's rendering of the model")
  source = _read_json(path)
  mc_source = dataclasses.replace(mc, **model_overrides(folder))
  base = hf_config(mc_source, dataclasses.replace(cfg, model=mc_source))
  codec = Codec(cfg)
  own_tokens = bool(codec.path) and os.path.abspath(codec.path) == os.path.abspath(
      os.path.join(folder, "tokenizer.json"))
  tokens = ("bos_token_id", "eos_token_id")
  if not own_tokens:
    base.update({k: _RENDERED for k in tokens})
  base["dtype"] = _RENDERED  # the tensors' dtype against what the file says
  if "dtype" not in source and "torch_dtype" in source:  # transformers 4's name for it
    ours["torch_dtype"] = ours.pop("dtype")
    base["torch_dtype"] = _RENDERED
  changed: list[str] = []
  config = _merged(source, ours, base, changed, "")
  for key in ("max_position_embeddings", "n_positions"):  # never fewer than the run trained on
    if key in ours and isinstance(config.get(key), int) and config[key] < ours[key]:
      changed.append(f"{key}: {config[key]} -> {ours[key]}")
      config[key] = ours[key]
  generation = None
  gpath = os.path.join(folder, "generation_config.json")
  if os.path.isfile(gpath):
    generation = _read_json(gpath)
    for key in tokens if not own_tokens else ():
      if key in generation and generation[key] != ours[key]:
        changed.append(f"generation_config.json {key}: {generation[key]!r} -> {ours[key]!r}")
        generation[key] = ours[key]
  return Exported(config, generation, folder, changed)


def _merged(source: dict, ours: dict, base: dict, changed: list[str], prefix: str) -> dict:
  """`source` with each of `ours`' fields that the run changed (ours != base, and != source):
  those are named in `changed`; fields only jaxpar writes are added, the rest left as they are."""
  out = dict(source)
  for key, value in ours.items():
    if key not in source:
      out[key] = value
    elif value == base.get(key) or value == source[key]:
      continue
    elif isinstance(value, dict) and isinstance(source[key], dict):
      out[key] = _merged(source[key], value, base.get(key) if isinstance(base.get(key), dict)
                         else {}, changed, f"{prefix}{key}.")
    else:
      changed.append(f"{prefix}{key}: {source[key]!r} -> {value!r}")
      out[key] = value
  return out


# What a Hugging Face folder's tokenizer is made of; export --hf copies those the run's has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


def write_tokenizer(codec: Codec, out_dir: str, max_length: int) -> list[str]:
  """The run's tokenizer beside the weights, so `AutoTokenizer.from_pretrained(out_dir)` gives the
  ids it trained on: its `tokenizers` file as tokenizer.json and, when that file is a folder's
  tokenizer.json, the folder's other tokenizer files (TOKENIZER_FILES). Without a
  tokenizer_config.json among them, one naming the fast tokenizer and its end-of-text token is
  written. Returns the names written; none for byte tokens."""
  if not codec.path:
    return []
  sources = {"tokenizer.json": codec.path}
  if os.path.basename(codec.path) == "tokenizer.json":
    folder = os.path.dirname(codec.path)
    sources.update({name: os.path.join(folder, name) for name in TOKENIZER_FILES[1:]
                    if os.path.isfile(os.path.join(folder, name))})
  for name, src in sources.items():
    dst = os.path.join(out_dir, name)
    with writes(dst):
      shutil.copyfile(src, dst)
  if "tokenizer_config.json" not in sources:
    eos = codec.tokenizer.id_to_token(codec.eos)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with writes(path), open(path, "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                 **({"eos_token": eos, "bos_token": eos} if eos is not None else {})}, f, indent=2)
      f.write("\n")
  return sorted({*sources, "tokenizer_config.json"})


# The longest window a folder is sampled with unless model.seq_len is set: the key/value cache
# holds (rows, window) keys per layer, and many folders allow 32k positions or more.
MAX_WINDOW = 2048


def sampler(folder: str, mesh_shape: tuple[int, ...] = (1, 1, 1), overrides=()) -> generate.Sampler:
  """A generate.Sampler over a Hugging Face folder's weights (any architecture `architecture`
  reads: jaxpar's exports and others), put onto the mesh's shardings tensor by tensor.

  It speaks the folder's tokenizer.json (bytes without one). A prompt starts with the folder's
  bos_token_id (generation_config.json's, else config.json's; the first of a list), and a sample
  ends at the first of `stop_ids`: the end of text and every eos_token_id, as transformers'
  generate does, and the tokenizer's eos_token (a chat model's end of turn). The window
  (model.seq_len) is the folder's longest position, at most MAX_WINDOW; `overrides` ('key=value'
  words, e.g. model.seq_len=4096 or precision.param_dtype=bfloat16) win. An unsupported folder
  is one sentence (ConfigError) before anything is read."""
  _, hfc = architecture(folder)
  positions = hfc.get("n_positions") or hfc.get("max_position_embeddings") or 0
  sets = [f"model.init_from={folder}"] + ([f"model.seq_len={min(positions, MAX_WINDOW)}"]
                                          if positions else [])
  cfg = kinds.check(jconfig.load(None, sets + list(overrides), base=model_overrides))
  generate.check_mesh(mesh_shape)
  n = int(np.prod(mesh_shape))
  jmesh.check(mesh_shape, cfg, min(n, len(jax.devices())))
  trainer = Trainer(cfg, jmesh.make(mesh_shape, jax.devices()[:n]), jmodel.decoder(cfg))
  params = load_params(folder, cfg.model, trainer.model.abstract, trainer.state_shardings["params"])
  codec = Codec(cfg)
  codec.bos = _token_id(folder, hfc, "bos_token_id", codec.bos)
  end_of_text = codec.eos
  codec.eos = _token_id(folder, hfc, "eos_token_id", codec.eos)
  codec.stops = stop_ids(folder, hfc, codec.tokenizer, end_of_text)
  return generate.Sampler.from_trainer(cfg, trainer, params, codec)


def stop_ids(folder: str, hfc: dict, tokenizer, end_of_text: int) -> tuple[int, ...]:
  """The ids that end a sample of the folder's model by default: `end_of_text` (the tokenizer's,
  or the byte separator), every eos_token_id of generation_config.json (an int or a list; else
  config.json's), and the id of tokenizer_config.json's eos_token (a chat model's end of turn,
  Qwen's <|im_end|> or Llama 3's <|eot_id|>, is one of these), in that order, each once."""
  path = os.path.join(folder, "generation_config.json")
  generation = _read_json(path) if os.path.isfile(path) else {}
  # a tokenizer's fallback id 0 (end_of_text_id, when it knows no END_OF_TEXT token) is no stop
  known = tokenizer is None or tokenizer.id_to_token(end_of_text) in END_OF_TEXT
  ids = [end_of_text] if known else []
  for source in (generation, hfc):
    value = source.get("eos_token_id")
    if value is not None:
      ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
      break
  eos = jsonl.special_token(folder, "eos_token") if tokenizer is not None else None
  if eos is not None and tokenizer.token_to_id(eos) is not None:
    ids.append(tokenizer.token_to_id(eos))
  return tuple(dict.fromkeys(int(i) for i in ids))


def _token_id(folder: str, hfc: dict, key: str, default: int) -> int:
  """A special token's id as the folder gives it: generation_config.json, then config.json."""
  path = os.path.join(folder, "generation_config.json")
  for source in ((_read_json(path) if os.path.isfile(path) else {}), hfc):
    value = source.get(key)
    value = value[0] if isinstance(value, list) and value else value
    if isinstance(value, int):
      return value
  return default


def render_chat(folder: str, messages: list[dict]) -> str:
  """`messages` ([{"role", "content"}]) as the folder's chat template writes them, ending with
  the assistant's turn opened (add_generation_prompt): the renderer data.source=jsonl trains
  chat records with (transformers' apply_chat_template, else jinja2 set up as transformers
  sets it up)."""
  template = jsonl.template_text(folder)
  if template is None:
    raise ConfigError(f"{folder} has no chat template (chat_template.jinja, or chat_template in "
                      f"tokenizer_config.json); leave out --chat to continue the prompt as text")
  try:
    return jsonl.ChatTemplate(folder, template).render(messages, add_generation_prompt=True)
  except ConfigError:
    raise
  except Exception as e:  # jinja2's TemplateError (raise_exception), or transformers' own kinds
    raise ConfigError(f"{folder}'s chat template refused the messages ({type(e).__name__}: "
                      f"{e})") from None
