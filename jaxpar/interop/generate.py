"""Sampling text from a trained decoder, with its parameters restored sharded onto any mesh.

Tokens are those of training: bytes, or the ids of the run's `tokenizers` file. A prompt is the
start of a document, so it is preceded by the end-of-text token that ends every document in the
training stream; a sampled end-of-text ends the text.
Decoding is incremental by default: the prompts are encoded in one pass that fills a key/value
cache (models/kvcache.py), then each new token runs the stack once, for that token only, inside
one jitted `lax.while_loop` over a fixed-size cache, so nothing recompiles per token. The same
loop with `cache=False` recomputes the model over the whole window for every token: the
reference the cached path is tested against, token for token.

The window rule, the same on both paths: the model sees at most `model.seq_len` tokens of a row,
at positions 0..seq_len-1 as in training. A row whose next token would not fit continues from
its last `seq_len // 2` tokens, re-encoded at positions 0..seq_len//2-1 (one prefill), and grows
again from there; a prompt longer than seq_len starts that way. So past seq_len each token sees
between seq_len/2 and seq_len tokens of context, and the cached path re-encodes half a window
once per seq_len/2 tokens instead of a whole window per token.

Rows are independent: prompts of different lengths run as one batch (each row at its own
positions, no left padding) and give what each would alone; sampled rows draw from keys folded
from the seed, the step and the row's index.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import config as jconfig
from jaxpar import kinds
from jaxpar.config import ConfigError
from jaxpar.data import SEPARATOR, VOCAB_SIZE, tokenize
from jaxpar.data.windows import end_of_text_id, load_tokenizer
from jaxpar.interop import export
from jaxpar.models import decoder, gpt, kvcache, llama, lora, precision
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.parallel import zero
from jaxpar.parallel.context import StepContext
from jaxpar.train import checkpoint, loop
from jaxpar.train.step import Trainer


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
  (else of the `model.init_from` folder, when it holds a tokenizer.json). `bos` (the id a prompt
  starts with) and `eos` (the one that ends a sample) are the end-of-text id unless a Hugging
  Face folder says otherwise (hf.sampler); `stops`, the ids any of which ends a sample by
  default, are (eos,) unless a folder names more (a chat model's end of turn)."""

  def __init__(self, cfg: jconfig.Config):
    path = cfg.data.tokenizer
    folder = cfg.model.init_from
    if not path and folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
      path = folder
    self.tokenizer = None
    self.eos, self.vocab = SEPARATOR, VOCAB_SIZE
    # the tokenizers file itself ("" for byte tokens): export --hf copies it beside the weights
    self.path = os.path.join(path, "tokenizer.json") if path and os.path.isdir(path) else path
    if path:
      self.tokenizer = load_tokenizer(path)
      self.eos, self.vocab = end_of_text_id(self.tokenizer), self.tokenizer.get_vocab_size()
    self.bos = self.eos
    self.stops: tuple[int, ...] | None = None  # None: (eos,)

  def default_stops(self) -> tuple[int, ...]:
    """The ids that end a sample when no --stop-token is given."""
    return tuple(self.stops) if self.stops is not None else (int(self.eos),)

  def encode(self, text: bytes | str, start: bool = True) -> np.ndarray:
    """A prompt as the start of a document: the `bos` id (the end of text unless a folder says
    otherwise), then its tokens; without it where `start` is False (a chat template's text,
    which holds its own). (n,) int32.

    Any bytes are a prompt: byte tokens take them as they are; a tokenizer reads them as UTF-8,
    an invalid sequence becoming U+FFFD. A str is its UTF-8 bytes (with the bytes a
    surrogateescape decoding stands for, as in argv and file names on Linux)."""
    if isinstance(text, str):
      try:
        text = text.encode("utf-8", "surrogateescape")
      except UnicodeEncodeError as e:
        raise ConfigError(f"the prompt holds {text[e.start]!r} at character {e.start}, a lone "
                          f"surrogate with no UTF-8 bytes; pass the prompt as bytes") from None
    if self.tokenizer is None:
      ids = tokenize(text)
    else:
      ids = self.tokenizer.encode(text.decode("utf-8", errors="replace"),
                                  add_special_tokens=False).ids
    return np.concatenate([[self.bos] if start else [], ids]).astype(np.int32)

  def decode(self, tokens: np.ndarray) -> str:
    """Tokens up to the first end-of-text -> text (undecodable bytes become U+FFFD)."""
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == self.eos)
    if ends.size:
      tokens = tokens[:ends[0]]
    if self.tokenizer is None:
      return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    return self.tokenizer.decode([int(t) for t in tokens])


def window_keep(seq_len: int) -> int:
  """The tokens a full window restarts from (the module's window rule)."""
  return max(1, seq_len // 2)


def _restrict(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Logits z (B, V) with everything outside the top-k, then outside the top-p nucleus, at -inf.

  top_k 0 = all; top_p 1 = all: the nucleus is the fewest likeliest tokens whose probabilities
  (after temperature and top-k) sum to at least top_p. A token tied with the last one kept is
  kept too.
  """
  V = z.shape[-1]
  desc = -jnp.sort(-z, axis=-1)  # (B, V), largest first
  k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
  ranks = jnp.arange(V)[None, :]
  desc = jnp.where(ranks < k, desc, -jnp.inf)
  probs = jax.nn.softmax(desc, axis=-1)
  above = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked before each
  # (B, V), a prefix of each row; top_p 1 keeps all k even where the sum rounds past 1
  kept = ((ranks == 0) | (above < top_p) | (top_p >= 1)) & (ranks < k)
  floor = jnp.take_along_axis(desc, jnp.sum(kept, -1, keepdims=True) - 1, axis=-1)  # (B, 1)
  return jnp.where(z < floor, -jnp.inf, z)


def pick(logits: jax.Array, key: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
  """Next tokens from last-position logits (B, V) float32 -> (B,) int32.

  temperature 0 = greedy; else a draw from softmax(logits / temperature) restricted to the top-k
  and the top-p nucleus. Row b draws with fold_in(key, b), so a row's draw does not depend on
  how many rows run with it. The options may be traced values: one compiled loop serves all.
  """
  temperature, top_k, top_p = (jnp.asarray(temperature, jnp.float32),
                               jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
  V = logits.shape[-1]

  def draw(logits):
    z = logits / jnp.maximum(temperature, jnp.finfo(jnp.float32).tiny)
    narrow = ((top_k > 0) & (top_k < V)) | (top_p < 1)
    z = jax.lax.cond(narrow, lambda z: _restrict(z, top_k, top_p), lambda z: z, z)
    keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(z.shape[0]))
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, z).astype(jnp.int32)
  greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(temperature == 0, greedy, draw, logits)


def _cached_parts(mc) -> kvcache.CachedParts:
  return {"gpt": gpt, "llama": llama}[mc.kind].cached_parts(mc)


def _rows(x: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """Per-row slices: x (B, N), start (B,) -> (B, width), row b from start[b]."""
  return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width))(x, start)


def decode_fn(cfg: jconfig.Config, n_prompt: int, n_new: int, batch: int, cache: bool = True):
  """The sampling loop for one shape, not yet jitted: (params, prompts (B, n_prompt) int32, each
  row's tokens first and padding after, lengths (B,) int32 >= 1, key, temperature, top_k, top_p,
  stop (S,) int32) -> new tokens (B, n_new) int32. A row that samples any id of `stop` (-1
  entries match nothing: padding, or no stop at all) stops there, and the rest of its row
  repeats that id; the loop ends when every row has stopped.
  `cache` False recomputes the whole window per token (the reference)."""
  mc = cfg.model
  T, keep = mc.seq_len, window_keep(mc.seq_len)
  dtype = precision.compute_dtype(cfg.precision)
  full_parts, parts = jmodel.decoder_parts(mc), _cached_parts(mc)
  L, _, _, _, G, K = decoder.sizes(mc)
  B, N = batch, n_prompt + n_new + T  # the token buffer: room for any window's T tokens

  def recompute(params, tokens, origin, ahead):
    """Logits (B, V) of the token at index `ahead` from the window origin..ahead-1 of each row."""
    logits = decoder.forward(full_parts, params, _rows(tokens, origin, T),
                             StepContext(dtype))  # (B, T, V)
    # Causal attention: the window's tokens from `ahead` on do not change these logits.
    return jnp.take_along_axis(logits, (ahead - 1 - origin)[:, None, None], axis=1)[:, 0]

  def encode(params, kv, tokens, origin, ahead, width):
    """Re-encodes origin..ahead-1 of each row at slots 0.. (ahead - origin <= width) ->
    (logits of the token at `ahead` (B, V), the cache)."""
    x, kv = kvcache.extend(parts, params, kv, _rows(tokens, origin, width),
                           jnp.zeros((B,), jnp.int32), dtype)
    return kvcache.logits_at(parts, params, x, ahead - 1 - origin), kv

  def advance(params, tokens, kv, origin, ahead, full, token):
    """Logits of the token at `ahead` once `token` (at ahead - 1) is in (B,), and the cache."""
    if not cache:
      return recompute(params, tokens, origin, ahead), kv
    # Rows whose window just moved (`full`) have slot ahead-1-origin = keep-1 here: the step
    # writes a stale slot of theirs, and the re-encoding below replaces their whole cache.
    x, stepped = kvcache.extend(parts, params, kv, token[:, None], ahead - 1 - origin, dtype)
    logits = kvcache.logits_at(parts, params, x, jnp.zeros((B,), jnp.int32))

    def refill(_):
      new_logits, new = encode(params, stepped, tokens, origin, ahead, keep)
      take = lambda a, b: jnp.where(full.reshape((1, B) + (1,) * (a.ndim - 2)), a, b)
      return (jnp.where(full[:, None], new_logits, logits),
              {name: take(new[name], stepped[name]) for name in stepped})
    return jax.lax.cond(jnp.any(full), refill, lambda _: (logits, stepped), None)

  def run(params, prompts, lengths, key, temperature, top_k, top_p, stop):
    tokens = jnp.zeros((B, N), jnp.int32).at[:, :n_prompt].set(prompts)
    origin = jnp.where(lengths > T, lengths - keep, 0)  # a long prompt starts a moved window
    if cache:
      kv = kvcache.empty(L, B, T, G, K, dtype)
      logits, kv = encode(params, kv, tokens, origin, lengths, min(n_prompt, T))
    else:
      logits, kv = recompute(params, tokens, origin, lengths), None

    def body(state):
      i, tokens, kv, origin, logits, done, last = state
      token = pick(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
      token = jnp.where(done, last, token)  # a stopped row repeats the id it stopped at
      tokens = tokens.at[jnp.arange(B), lengths + i].set(token)
      done = done | jnp.any(token[:, None] == stop[None, :], axis=-1)
      ahead = lengths + i + 1  # the index of the token the next iteration picks
      full = ahead - origin > T
      origin = jnp.where(full, ahead - keep, origin)
      logits, kv = advance(params, tokens, kv, origin, ahead, full, token)
      return i + 1, tokens, kv, origin, logits, done, token

    state = (jnp.int32(0), tokens, kv, origin, logits, jnp.zeros((B,), bool),
             jnp.zeros((B,), jnp.int32))
    state = jax.lax.while_loop(lambda s: (s[0] < n_new) & ~jnp.all(s[5]), body, state)
    steps, tokens, last = state[0], state[1], state[6]
    new = _rows(tokens, lengths, n_new)
    # an early end: every row has stopped, and repeats its stop id
    return jnp.where(jnp.arange(n_new)[None, :] < steps, new, last[:, None])
  return run


def check_mesh(mesh_shape) -> None:
  """Decoding has no context-parallel form: a context axis is one sentence."""
  c = jmesh.normalize(mesh_shape)[3]
  if c > 1:
    raise ConfigError(f"generation runs without a context axis (mesh {jmesh.spec_str(mesh_shape)} "
                      f"has context={c}); a checkpoint trained with any context split loads on "
                      f"a DxMxP mesh")


class Sampler:
  """A decoder's parameters on a mesh, and sampling from them."""

  def __init__(self, workdir: str, mesh_shape: tuple[int, ...] = (1, 1, 1),
               step: int | None = None, overrides=()):
    """Restores a checkpoint's parameters sharded, as the config stored with it lays them out."""
    directory, self.step = export.checkpoint_step(workdir, step)
    with checkpoint.readable(directory, self.step, export.STEP_REMEDY):
      extra = checkpoint.read_extra(directory, self.step)
    stored = extra.get("config")
    if checkpoint.users_model(extra):
      raise ConfigError(f"the checkpoint of step {self.step} in {directory} holds a model of "
                        f"your own; jaxpar samples from its own decoders only")
    if stored is None:
      raise ConfigError(f"the checkpoint of step {self.step} in {directory} has no config")
    cfg = _overridden(jconfig.from_dict(stored), overrides)
    _check_kind(cfg)
    check_mesh(mesh_shape)
    trainer = loop.prepare(cfg, mesh_shape)
    # The parameters alone, in the checkpoint's (model) order: the optimizer state is never read.
    with checkpoint.readable(directory, self.step, export.STEP_REMEDY):
      params = checkpoint.restore_params(directory, self.step, trainer.model.abstract,
                                         trainer.state_shardings["params"])
    self._setup(cfg, trainer, params)

  @classmethod
  def from_params(cls, cfg: jconfig.Config, mesh_shape: tuple[int, ...] = (1, 1, 1),
                  params=None, seed: int = 0) -> "Sampler":
    """A sampler over given parameters (a tree like the model's, placed onto the mesh's
    shardings here), or over freshly initialised ones (`seed`) when params is None. The mesh
    takes the first devices it needs."""
    _check_kind(cfg)
    check_mesh(mesh_shape)
    n = int(np.prod(mesh_shape))
    jmesh.check(mesh_shape, cfg, min(n, len(jax.devices())))
    trainer = Trainer(cfg, jmesh.make(mesh_shape, jax.devices()[:n]), jmodel.decoder(cfg))
    if params is None:  # the model's own init (the trainer's would also build optimizer state)
      with jax.set_mesh(trainer.mesh):
        params = jax.jit(trainer.model.init, out_shardings=trainer.state_shardings["params"])(
            jax.random.key(seed))
    else:
      params = jax.device_put(params, trainer.state_shardings["params"])
    self = cls.__new__(cls)
    self.step = None
    self._setup(cfg, trainer, params)
    return self

  @classmethod
  def from_trainer(cls, cfg: jconfig.Config, trainer: Trainer, params, codec: Codec) -> "Sampler":
    """A sampler over parameters already on `trainer`'s shardings (a Hugging Face folder's,
    hf.sampler), speaking `codec`."""
    _check_kind(cfg)
    self = cls.__new__(cls)
    self.step = None
    self._setup(cfg, trainer, params, codec)
    return self

  def _setup(self, cfg, trainer, params, codec: Codec | None = None) -> None:
    if cfg.train.lora_rank:  # sample from W + alpha/r * A @ B, the model the adapters trained
      with jax.set_mesh(trainer.mesh):
        params = jax.jit(lambda p: lora.merge_params(p, cfg.train),
                         out_shardings=lora.base_only(trainer.state_shardings["params"]))(params)
    self.cfg, self.trainer, self.params = cfg, trainer, params
    self.codec = codec or Codec(cfg)
    self.mesh = trainer.mesh
    self._compiled: dict = {}

  def _fn(self, n_prompt: int, n_new: int, batch: int, cache: bool):
    """The jitted decode_fn of one shape (sampling options are arguments, not constants)."""
    signature = (n_prompt, n_new, batch, cache)
    if signature not in self._compiled:
      rows = NamedSharding(self.mesh, P(zero.DATA))
      run = decode_fn(self.cfg, n_prompt, n_new, batch, cache)
      self._compiled[signature] = jax.jit(
          run, in_shardings=(lora.base_only(self.trainer.state_shardings["params"]), rows, rows)
          + (None,) * 5,
          out_shardings=rows)
    return self._compiled[signature]

  def window_note(self, longest_prompt: int, max_new_tokens: int) -> str | None:
    """The sentence that says how the window rule applies to a request, if it does (else None)."""
    T = self.cfg.model.seq_len
    if longest_prompt + max_new_tokens <= T:
      return None
    keep = window_keep(T)
    return (f"prompt ({longest_prompt} tokens) + --max-new-tokens {max_new_tokens} pass "
            f"model.seq_len={T}: a row whose window is full continues from its last {keep} "
            f"tokens, re-encoded at positions 0-{keep - 1}")

  def _check(self, max_new_tokens, temperature, top_k, top_p, num_samples, stop_token, seed,
             prompts) -> tuple[int, ...]:
    """check_options, and the bounds set by the vocabulary; returns the stop ids (() = none)."""
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples, stop_token, seed,
                  prompts)
    if top_k > self.codec.vocab:
      raise ConfigError(f"--top-k={top_k} must be between 0 (off) and {self.codec.vocab}")
    return self.stop_ids(stop_token)

  def stop_ids(self, stop_token=None) -> tuple[int, ...]:
    """The ids that end a sample: `stop_token` None = the codec's default set; -1 (or [-1], or
    []) = none; an id or a list of ids = those. Each must be in the model's vocabulary."""
    if stop_token is None:
      return self.codec.default_stops()
    ids = _stop_list(stop_token)
    V = self.cfg.model.vocab_size
    for t in ids:
      if not -1 <= t < V:
        raise ConfigError(f"--stop-token={t} must be a token id from 0 to {V - 1}, "
                          f"or -1 for none")
    return tuple(dict.fromkeys(int(t) for t in ids if t != -1))

  def sample_tokens(self, prompts, max_new_tokens: int = 200, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
                    stop_token: int | list[int] | None = None, cache: bool = True) -> np.ndarray:
    """New tokens after each prompt, a list of (n_i,) token ids with n_i >= 1:
    [len(prompts) * num_samples, max_new_tokens] int32, the samples of a prompt together.

    stop_token: None = the codec's default stop ids (the end-of-text id, and a Hugging Face
    folder's end-of-turn ids); an id or a list of ids; -1 = none. A row stops at the first token
    that is any of them, which is kept, and the rest of the row repeats it. cache False: the
    full-recompute reference.
    """
    prompts = list(prompts)
    stops = self._check(max_new_tokens, temperature, top_k, top_p, num_samples, stop_token, seed,
                       len(prompts))
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not prompts or min(len(p) for p in prompts) == 0:
      raise ConfigError("every prompt needs at least one token")
    V = self.cfg.model.vocab_size
    for p in prompts:
      if p.min() < 0 or p.max() >= V:
        raise ConfigError(f"prompt token {int(p.min() if p.min() < 0 else p.max())} is not "
                          f"in the model's vocabulary (0 to {V - 1})")
    rows = [p for p in prompts for _ in range(num_samples)]
    # Rows are split over `data`, so the batch is rounded up to a multiple of it (copies of the
    # last row, which then stop when it does).
    d = self.mesh.shape[zero.DATA]
    batch = -(-len(rows) // d) * d
    rows += [rows[-1]] * (batch - len(rows))
    n_prompt = _bucket(max(len(p) for p in rows))
    padded = np.zeros((batch, n_prompt), np.int32)
    for i, p in enumerate(rows):
      padded[i, :len(p)] = p
    lengths = np.array([len(p) for p in rows], np.int32)
    # A static-size array inside the loop: a few widths serve any set (-1 pads, matching nothing)
    stop = np.full(_bucket(len(stops)), -1, np.int32)
    stop[:len(stops)] = stops
    fn = self._fn(n_prompt, max_new_tokens, batch, bool(cache))
    with jax.set_mesh(self.mesh):
      out = fn(self.params, padded, lengths, jax.random.key(seed), np.float32(temperature),
               np.int32(top_k), np.float32(top_p), stop)
    return np.asarray(out)[:len(prompts) * num_samples]

  def sample(self, prompt, max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0, num_samples: int = 1, top_p: float = 1.0,
             stop_token: int | list[int] | None = None, cache: bool = True) -> np.ndarray:
    """New tokens after `prompt` (text, or a list of texts): [prompts * num_samples,
    max_new_tokens] int32, separators included (see sample_tokens)."""
    texts = [prompt] if isinstance(prompt, (str, bytes)) else list(prompt)
    return self.sample_tokens([self.codec.encode(t) for t in texts], max_new_tokens,
                              temperature, top_k, top_p, seed, num_samples, stop_token, cache)

  def generate(self, prompt, max_new_tokens: int = 200, temperature: float = 1.0,
               top_k: int = 0, seed: int = 0, num_samples: int = 1, top_p: float = 1.0,
               stop_token: int | list[int] | None = None, cache: bool = True) -> list[str]:
    """Continuations of `prompt` (text, or a list of texts) as text, each cut before the first
    end-of-text and the first stop token of any kind."""
    out = self.sample(prompt, max_new_tokens, temperature, top_k, seed, num_samples, top_p,
                      stop_token, cache)
    return self.texts(out, stop_token)

  def texts(self, out: np.ndarray, stop_token=None) -> list[str]:
    """sample_tokens' rows as text, each cut before the first end-of-text and the first of the
    stop ids (`stop_token` as sample_tokens takes it)."""
    stops = self.stop_ids(stop_token)
    return [self.codec.decode(row[:_first(row, stops)]) for row in out]


# Caps on a request, checked before anything is read. The token buffer is (rows, prompt +
# max_new_tokens + seq_len) int32, and a row's positions are int32: 2**20 new tokens keep a row's
# buffer at 4 MiB. The rows (prompts x samples) and their new tokens together are capped too, so
# the (rows, max_new_tokens) result stays within 64 MiB.
MAX_NEW_TOKENS = 1 << 20
MAX_ROWS = 1 << 12
MAX_TOKENS = 1 << 24
SEED_RANGE = 1 << 32  # a key takes 32 bits of the seed (without jax_enable_x64): 2**32 is seed 0
INT32_MAX = (1 << 31) - 1  # token ids and top-k reach the loop as int32


def check_options(max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  num_samples: int, stop_token: int | list[int] | None, seed: int = 0,
                  prompts: int = 1) -> None:
  """The sampling options that need no model, each refused with one sentence (ConfigError);
  `prompts`: how many are sampled together."""
  if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
    raise ConfigError(f"--max-new-tokens={max_new_tokens} must be between 0 and {MAX_NEW_TOKENS}")
  if not temperature >= 0 or temperature == float("inf"):  # nan too
    raise ConfigError(f"--temperature={temperature} must be a finite number, not negative "
                      f"(0 = greedy)")
  if not 0 <= top_k <= INT32_MAX:
    raise ConfigError(f"--top-k={top_k} must be between 0 (off) and the vocabulary size")
  if not 0 < top_p <= 1:  # nan too
    raise ConfigError(f"--top-p={top_p} must be above 0 and at most 1 (1 = off)")
  if not 1 <= num_samples <= MAX_ROWS:
    raise ConfigError(f"--num-samples={num_samples} must be between 1 and {MAX_ROWS}")
  rows = prompts * num_samples
  if rows > MAX_ROWS:
    raise ConfigError(f"{prompts} prompts x --num-samples={num_samples} make {rows} rows, more "
                      f"than the {MAX_ROWS} sampled at once")
  if rows * max_new_tokens > MAX_TOKENS:
    raise ConfigError(f"{rows} rows x --max-new-tokens={max_new_tokens} make "
                      f"{rows * max_new_tokens} new tokens, more than the {MAX_TOKENS} of one "
                      f"request; ask for fewer tokens or rows")
  ids = _stop_list(stop_token) if stop_token is not None else []
  for t in ids:
    if not -1 <= t <= INT32_MAX:
      raise ConfigError(f"--stop-token={t} must be a token id (0 or more), or -1 for none")
  if -1 in ids and len(ids) > 1:
    raise ConfigError(f"--stop-token=-1 (none) cannot be given with other stop tokens "
                      f"({', '.join(str(t) for t in ids if t != -1)})")
  if not 0 <= seed < SEED_RANGE:
    raise ConfigError(f"--seed={seed} must be between 0 and {SEED_RANGE - 1} (a key takes "
                      f"32 bits of it)")


def _bucket(n: int) -> int:
  """A prompt width that serves many prompt lengths, so a new length seldom compiles anew: a
  power of two from 8 (the padding only widens the first prefill)."""
  return max(8, 1 << (n - 1).bit_length())


def _stop_list(stop_token) -> list[int]:
  """stop_token as a list of ints: an id, or a sequence of them."""
  if isinstance(stop_token, (int, np.integer)):
    return [int(stop_token)]
  return [int(t) for t in stop_token]


def _first(row: np.ndarray, tokens) -> int:
  """The index of the first of `tokens` in row, or its length."""
  hits = np.flatnonzero(np.isin(row, np.asarray(tokens, np.int64)))
  return int(hits[0]) if hits.size else len(row)


def _check_kind(cfg: jconfig.Config) -> None:
  if cfg.model.kind not in kinds.DECODERS:
    raise ConfigError(f"model.kind={cfg.model.kind!r} does not generate text; only "
                      f"{' and '.join(kinds.DECODERS)} do")
