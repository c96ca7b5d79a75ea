"""Sampling text from a trained decoder, with its parameters restored sharded onto any mesh.

Tokens are those of training: bytes, or the ids of the run's `tokenizers` file. A prompt is the
start of a document, so it is preceded by the end-of-text token that ends every document in the
training stream; a sampled end-of-text ends the text.
Each new token recomputes the forward over a window of the last `seq_len` tokens (no KV cache);
all new tokens come from one jitted `lax.fori_loop`, compiled once per prompt length and count.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import checkpoint, export, precision, zero
from jaxpar import config as jconfig
from jaxpar import mesh as jmesh
from jaxpar import model as jmodel
from jaxpar.config import ConfigError
from jaxpar.data import SEPARATOR, VOCAB_SIZE, tokenize
from jaxpar.models import decoder


def _overridden(cfg: jconfig.Config, overrides) -> jconfig.Config:
  """`key=value` words applied on top of a stored config (later ones win)."""
  sections: dict[str, dict] = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set takes key=value, got {item!r}")
    key, value = item.split("=", 1)
    section, _, name = key.strip().partition(".")
    sections.setdefault(section, {})[name] = value
  return jconfig.override(cfg, **sections) if sections else cfg


class Codec:
  """Text <-> token ids as the run saw them: bytes, or the `tokenizers` file of `data.tokenizer`
  (else of the `model.init_from` folder, when it holds a tokenizer.json)."""

  def __init__(self, cfg: jconfig.Config):
    path = cfg.data.tokenizer
    folder = cfg.model.init_from
    if not path and folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
      path = folder
    self.tokenizer = None
    self.eos, self.vocab = SEPARATOR, VOCAB_SIZE
    if path:
      from jaxpar.data.tfds_source import load_tokenizer
      from jaxpar.data.windows import end_of_text_id
      self.tokenizer = load_tokenizer(path)
      self.eos, self.vocab = end_of_text_id(self.tokenizer), self.tokenizer.get_vocab_size()

  def encode(self, text: bytes | str) -> np.ndarray:
    """A prompt as the start of a document: the end-of-text id, then its tokens. (n,) int32."""
    if self.tokenizer is None:
      ids = tokenize(text)
    else:
      text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
      ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    return np.concatenate([[self.eos], ids]).astype(np.int32)

  def decode(self, tokens: np.ndarray) -> str:
    """Tokens up to the first end-of-text -> text (undecodable bytes become U+FFFD)."""
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == self.eos)
    if ends.size:
      tokens = tokens[:ends[0]]
    if self.tokenizer is None:
      return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    return self.tokenizer.decode([int(t) for t in tokens])


def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """Next tokens from last-position logits (B, V) float32 -> (B,) int32; temperature 0 = greedy."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (B, 1): the k-th largest logit per row
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


class Sampler:
  """A checkpoint's parameters on a mesh (restored sharded, as the config lays them out)."""

  def __init__(self, workdir: str, mesh_shape: tuple[int, int, int] = (1, 1, 1),
               step: int | None = None, overrides=()):
    from jaxpar import loop
    directory, self.step = export.checkpoint_step(workdir, step)
    with checkpoint.readable(directory, self.step, export.STEP_REMEDY):
      stored = checkpoint.read_extra(directory, self.step).get("config")
    if stored is None:
      raise ConfigError(f"the checkpoint of step {self.step} in {directory} has no config")
    self.cfg = _overridden(jconfig.from_dict(stored), overrides)
    if self.cfg.model.kind not in jmesh.DECODERS:
      raise ConfigError(f"model.kind={self.cfg.model.kind!r} does not generate text; only "
                        f"{' and '.join(jmesh.DECODERS)} do")
    self.trainer = loop.prepare(self.cfg, mesh_shape)
    self.codec = Codec(self.cfg)
    # The parameters alone, in the checkpoint's (model) order: the optimizer state is never read.
    with checkpoint.readable(directory, self.step, export.STEP_REMEDY):
      self.params = checkpoint.restore_params(directory, self.step, self.trainer.model.abstract,
                                              self.trainer.state_shardings["params"])
    self.mesh = self.trainer.mesh
    self._compiled: dict = {}

  def _fn(self, n_prompt: int, n_new: int, batch: int, temperature: float, top_k: int):
    """The jitted sampler for one shape: (params, prompt (B, n_prompt), key) -> (B, n_new)."""
    signature = (n_prompt, n_new, batch, temperature, top_k)
    if signature in self._compiled:
      return self._compiled[signature]
    mc = self.cfg.model
    parts = jmodel.decoder_parts(mc)
    T, dtype = mc.seq_len, precision.compute_dtype(self.cfg.precision)
    N = max(n_prompt + n_new, T)  # the token buffer; the window never runs past its end

    def sample(params, prompt, key):
      out = jnp.zeros((batch, N), jnp.int32).at[:, :n_prompt].set(prompt)

      def body(i, out):
        pos = n_prompt + i  # the position this iteration fills
        start = jnp.clip(pos - T, 0, N - T)
        window = jax.lax.dynamic_slice_in_dim(out, start, T, axis=1)  # (B, T)
        # Causal attention: positions after pos - 1 (zeros still) do not change its logits.
        logits = decoder.forward(parts, params, window, dtype)  # (B, T, V)
        last = jax.lax.dynamic_index_in_dim(logits, pos - 1 - start, axis=1, keepdims=False)
        token = pick(last, jax.random.fold_in(key, i), temperature, top_k)
        return jax.lax.dynamic_update_slice_in_dim(out, token[:, None], pos, axis=1)
      out = jax.lax.fori_loop(0, n_new, body, out)
      return out[:, n_prompt:n_prompt + n_new]

    rows = NamedSharding(self.mesh, P(zero.DATA))
    fn = jax.jit(sample, in_shardings=(self.trainer.state_shardings["params"], rows, None),
                 out_shardings=rows)
    self._compiled[signature] = fn
    return fn

  def sample(self, prompt: bytes | str, max_new_tokens: int = 200, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, num_samples: int = 1) -> np.ndarray:
    """New tokens after `prompt`: [num_samples, max_new_tokens] int32 (separators included)."""
    if max_new_tokens < 0:
      raise ConfigError(f"--max-new-tokens={max_new_tokens} must not be negative")
    if not temperature >= 0 or temperature == float("inf"):  # nan too
      raise ConfigError(f"--temperature={temperature} must be a finite number, not negative "
                        f"(0 = greedy)")
    if not 0 <= top_k <= self.codec.vocab:
      raise ConfigError(f"--top-k={top_k} must be between 0 (off) and {self.codec.vocab}")
    if num_samples < 1:
      raise ConfigError(f"--num-samples={num_samples} must be positive")
    tokens = self.codec.encode(prompt)
    # Rows are split over `data`, so the batch is rounded up to a multiple of it.
    d = self.mesh.shape[zero.DATA]
    batch = -(-num_samples // d) * d
    fn = self._fn(len(tokens), max_new_tokens, batch, float(temperature), int(top_k))
    with jax.set_mesh(self.mesh):
      out = fn(self.params, np.tile(tokens, (batch, 1)), jax.random.key(seed))
    return np.asarray(out)[:num_samples]

  def generate(self, prompt: bytes | str, max_new_tokens: int = 200, temperature: float = 1.0,
               top_k: int = 0, seed: int = 0, num_samples: int = 1) -> list[str]:
    """Continuations of `prompt` as text, each cut at the first separator (end of document)."""
    out = self.sample(prompt, max_new_tokens, temperature, top_k, seed, num_samples)
    return [self.codec.decode(row) for row in out]
