"""Incremental decoding (models/kvcache.py, interop/generate.py) against the full-recompute
reference: the cached step's logits equal the full forward's (fp32, 1e-5), greedy tokens are
the same token for token on one device and tensor parallel, batched prompts of different lengths
give what each gives alone, and the sampling options, the stop token and the seq_len window rule
do what generate.py says. Tiny random models (2 layers, d_model 32, seq_len 16; and a 4-layer
GPT with a mixture of 4 experts in every second layer) whose weights are scaled up so that the
logits are peaked: greedy choices are never near-ties."""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import config
from jaxpar.interop import generate
from jaxpar.models import decoder, kvcache
from jaxpar.models import registry as jmodel

ROOT = pathlib.Path(__file__).resolve().parents[1]
T = 16  # model.seq_len
NEW = 24  # new tokens per call: past seq_len, so every call also crosses the window rule
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        f"model.seq_len={T}", "precision.compute_dtype=float32"]
KINDS = {"gpt": ["model.kind=gpt"], "llama": ["model.kind=llama", "model.n_kv_heads=2"],
         # a mixture in layers 1 and 3 of 4: the cache's layers run in groups of two
         "gpt-moe-every2": ["model.kind=gpt", "model.n_layers=4", "model.n_experts=4",
                            "model.moe_every=2"]}
# Prompt lengths 3 and 7 share the batch with one longer than seq_len (the window moves at once).
PROMPTS = [np.array([0, 72, 101]), np.array([0, 9, 250, 31, 4, 77, 128]),
           (np.arange(20) * 37) % 256]


@pytest.fixture(scope="module", params=list(KINDS))
def model(request):
  """(cfg, params as numpy, the 1x1x1 sampler) of a tiny decoder with peaked logits."""
  cfg = config.load(None, TINY + KINDS[request.param])
  sampler = generate.Sampler.from_params(cfg, (1, 1, 1))
  # Matrices x8 (std 0.16): the top two logits of every greedy step lie well apart.
  params = jax.tree_util.tree_map(lambda x: np.asarray(x) * (8.0 if x.ndim >= 2 else 1.0),
                                  sampler.params)
  return cfg, params, generate.Sampler.from_params(cfg, (1, 1, 1), params)


@pytest.fixture(scope="module")
def greedy(model):
  """The cached path's greedy tokens for PROMPTS on 1x1x1, no stop token."""
  return model[2].sample_tokens(PROMPTS, NEW, temperature=0, stop_token=-1)


def test_cached_step_logits_equal_the_full_forward(model):
  """Prefill rows of 5 and 9 tokens, then feed a fixed sequence one token at a time: each step's
  logits are the full forward's at that position."""
  cfg, params, sampler = model
  parts, full = generate._cached_parts(cfg.model), jmodel.decoder_parts(cfg.model)
  L, _, _, _, G, K = decoder.sizes(cfg.model)
  seq = (np.arange(2 * T).reshape(2, T) * 53 + 7) % 256
  lengths = jnp.array([5, 9])

  def both(params, seq):
    kv = kvcache.empty(L, 2, T, G, K, jnp.float32)
    x, kv = kvcache.extend(parts, params, kv, seq[:, :9], jnp.zeros((2,), jnp.int32))
    first = kvcache.logits_at(parts, params, x, lengths - 1)  # (B, V)

    def step(kv, t):  # feeds seq[:, lengths + t], giving the logits at that position
      pos = jnp.minimum(lengths + t, T - 1)  # row 1 ends first; its extra steps are not read
      token = jnp.take_along_axis(seq, pos[:, None], axis=1)
      x, kv = kvcache.extend(parts, params, kv, token, pos)
      return kv, kvcache.logits_at(parts, params, x, jnp.zeros((2,), jnp.int32))
    _, steps = jax.lax.scan(step, kv, jnp.arange(T - 5))  # (T-5, B, V)
    return first, steps, decoder.forward(full, params, seq)  # the last: (B, T, V)

  with jax.set_mesh(sampler.mesh):
    first, steps, want = jax.jit(both)(sampler.params, jnp.asarray(seq, jnp.int32))
  first, steps, want = map(np.asarray, (first, steps, want))
  assert np.abs(want).max() > 1.0  # the logits are not all near zero
  # a mixture's combine sums its experts' rows in another order than the full forward's batch:
  # rounding of the largest logit's size (2.5e-5 of 3.1 with moe_every=1 as with 2)
  atol = 1e-5 * (np.abs(want).max() if cfg.model.n_experts else 1.0)
  for b, n in enumerate((5, 9)):
    got = np.concatenate([first[b:b + 1], steps[:T - n, b]])  # positions n-1 .. T-1
    np.testing.assert_allclose(got, want[b, n - 1:], rtol=0, atol=atol)


def test_greedy_cached_equals_recompute_on_one_device_and_tensor_parallel(model, greedy):
  cfg, params, sampler = model
  reference = sampler.sample_tokens(PROMPTS, NEW, temperature=0, stop_token=-1, cache=False)
  assert np.array_equal(greedy, reference)
  assert len(set(greedy[0].tolist())) > 3  # not one token repeated
  tp = generate.Sampler.from_params(cfg, (1, 2, 1), params)
  assert np.array_equal(tp.sample_tokens(PROMPTS, NEW, temperature=0, stop_token=-1), reference)
  # the cache splits the kv heads over `model`, like wk and wv's output columns
  L, _, _, _, G, K = decoder.sizes(cfg.model)
  with jax.set_mesh(tp.mesh):
    cache = jax.jit(lambda: kvcache.empty(L, 2, T, G, K, jnp.float32))()
  assert cache["k"].addressable_shards[0].data.shape == (L, 2, T, G // 2, K)


def test_batched_prompts_of_different_lengths_equal_each_alone(model, greedy):
  sampler = model[2]
  for i in (0, 1):
    alone = sampler.sample_tokens([PROMPTS[i]], NEW, temperature=0, stop_token=-1)
    assert np.array_equal(alone[0], greedy[i]), i


def test_window_rule_at_seq_len(model, greedy):
  """A row whose window is full continues exactly as a new prompt of its last seq_len//2 tokens
  would, at positions 0..: generation past seq_len is re-encoding, not positions past the table."""
  sampler = model[2]
  keep = generate.window_keep(T)
  prompt = PROMPTS[1]
  text = np.concatenate([prompt, greedy[1]])
  moved = T + 1  # the first token predicted from a moved window: indices moved-keep .. moved-1
  restart = sampler.sample_tokens([text[moved - keep:moved]], NEW, temperature=0, stop_token=-1)
  tail = greedy[1][moved - len(prompt):]
  assert np.array_equal(restart[0][:len(tail)], tail)
  # the sentence scripts/generate.py prints when a request passes seq_len
  assert sampler.window_note(len(prompt), T - len(prompt)) is None
  note = sampler.window_note(len(prompt), NEW)
  assert note == (f"prompt ({len(prompt)} tokens) + --max-new-tokens {NEW} pass "
                  f"model.seq_len={T}: a row whose window is full continues from its last "
                  f"{keep} tokens, re-encoded at positions 0-{keep - 1}")


def test_sampling_follows_the_seed_and_no_option_recompiles(model):
  sampler = model[2]
  kw = dict(temperature=1.0, stop_token=-1)
  a = sampler.sample_tokens(PROMPTS, NEW, seed=0, **kw)
  assert np.array_equal(a, sampler.sample_tokens(PROMPTS, NEW, seed=0, **kw))
  assert not np.array_equal(a, sampler.sample_tokens(PROMPTS, NEW, seed=1, **kw))
  assert np.array_equal(a, sampler.sample_tokens(PROMPTS, NEW, seed=0, cache=False, **kw))
  # a row draws by its index: the first row alone draws what it drew in the batch, and the
  # same prompt twice in one batch draws twice
  assert np.array_equal(sampler.sample_tokens(PROMPTS[:1], NEW, seed=0, **kw)[0], a[0])
  twice = sampler.sample_tokens([PROMPTS[0], PROMPTS[0], PROMPTS[2]], NEW, seed=0, **kw)
  assert np.array_equal(twice[0], a[0]) and not np.array_equal(twice[1], a[0])
  fn = sampler._fn(32, NEW, 3, True)  # the batch's shape: temperature, top-k/p, seed and stop
  assert fn._cache_size() == 1  # are arguments of one compiled loop


def test_top_k_and_top_p_restrict_the_support():
  probs = np.array([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0])
  logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (4000, 1))  # (B, V): B draws
  draw = jax.jit(lambda k, p, t: generate.pick(logits, jax.random.key(0), t, k, p))

  def support(top_k=0, top_p=1.0, temperature=1.0):
    got = np.asarray(draw(top_k, top_p, temperature))
    return set(np.unique(got).tolist()), np.bincount(got, minlength=8) / len(got)
  assert support()[0] == {0, 1, 2, 3}
  assert support(top_k=2)[0] == {0, 1}
  assert support(top_k=1, temperature=5.0)[0] == {0}
  assert support(top_p=0.7)[0] == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
  assert support(top_p=0.85)[0] == {0, 1, 2}
  assert support(top_p=1e-6)[0] == {0}
  assert support(top_k=3, top_p=0.9)[0] == {0, 1, 2}  # top-p after top-k: 0.85 of 0.95 < 0.9
  # the kept tokens keep their relative odds: 0.5 / 0.8 and 0.3 / 0.8
  np.testing.assert_allclose(support(top_k=2)[1][:2], [0.625, 0.375], atol=0.03)
  assert support(temperature=0.0)[0] == {0}


def test_top_p_and_top_k_of_one_are_greedy(model, greedy):
  sampler = model[2]
  for kw in (dict(top_k=1), dict(top_p=1e-6)):
    got = sampler.sample_tokens(PROMPTS, NEW, temperature=1.5, seed=4, stop_token=-1, **kw)
    assert np.array_equal(got, greedy), kw


def test_stop_token_ends_each_row(model, greedy):
  sampler = model[2]
  stop = int(greedy[1][5])  # a token row 1 picks at step 5 (perhaps earlier too)
  got = sampler.sample_tokens(PROMPTS, NEW, temperature=0, stop_token=stop)
  for row, full in zip(got, greedy):
    hits = np.flatnonzero(full == stop)
    end = hits[0] + 1 if hits.size else NEW
    assert np.array_equal(row[:end], full[:end])  # the same up to and with the stop token
    assert (row[end:] == stop).all()  # then the stop token
  # generate() cuts the text before the stop token (and before the end-of-text byte, as always)
  tokens = sampler.sample(["hi"], NEW, temperature=0, stop_token=-1)[0]
  stop = int(tokens[3])
  cut = tokens[:np.flatnonzero(tokens == stop)[0]]
  assert sampler.generate(["hi"], NEW, temperature=0, stop_token=stop) == [sampler.codec.decode(cut)]


def test_two_stop_ids_stop_each_row_at_whichever_comes_first(model, greedy):
  """A set of stop ids: each row stops at its first token that is any of them (kept, then
  repeated), the rows at different ids; the text is cut before it; an int is the set of one."""
  sampler = model[2]
  first = lambda row, ids: next((i for i, t in enumerate(row) if t in ids), len(row))
  # a pair where row 0 meets `a` before `b` and row 1 meets `b` before `a`, both rows late
  # but with tokens to sample after (the rows' text is longest, and the stop shows)
  pairs = [(min(first(greedy[0], {a}), first(greedy[1], {b})), int(a), int(b))
           for a in set(greedy[0].tolist()) for b in set(greedy[1].tolist()) if a != b
           and first(greedy[0], {a}) < min(first(greedy[0], {b}), NEW - 2)
           and first(greedy[1], {b}) < min(first(greedy[1], {a}), NEW - 2)]
  _, a, b = max(pairs)
  got = sampler.sample_tokens(PROMPTS, NEW, temperature=0, stop_token=[a, b])
  for row, full in zip(got, greedy):
    end = first(full, {a, b})
    assert np.array_equal(row[:end + 1], full[:end + 1])  # the same up to and with the stop
    assert (row[end:] == full[end]).all() if end < NEW else True  # then that id again
  assert got[0][first(greedy[0], {a})] == a and got[1][first(greedy[1], {b})] == b
  texts = sampler.texts(got, [a, b])
  assert texts[:2] == [sampler.codec.decode(full[:first(full, {a, b})]) for full in greedy[:2]]
  assert sampler.stop_ids(a) == (a,) and sampler.stop_ids(-1) == sampler.stop_ids([]) == ()
  assert sampler.stop_ids(None) == (sampler.codec.eos,)


def test_bad_options_are_one_sentence(model):
  sampler = model[2]
  for kw, words in ((dict(top_p=0.0), "--top-p=0.0 must be above 0 and at most 1 (1 = off)"),
                    (dict(top_p=float("nan")), "--top-p=nan must be above 0"),
                    (dict(top_k=-1), "--top-k=-1 must be between 0 (off) and the vocabulary size"),
                    (dict(top_k=257), "--top-k=257 must be between 0 (off) and 256"),
                    (dict(stop_token=256), "--stop-token=256 must be a token id from 0 to 255, "
                                           "or -1 for none"),
                    (dict(stop_token=[3, 256]), "--stop-token=256 must be a token id from 0 to "
                                                "255, or -1 for none"),
                    (dict(max_new_tokens=-1), "--max-new-tokens=-1 must be between 0 and ")):
    with pytest.raises(config.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
      sampler.sample_tokens([[0, 1]], **{"max_new_tokens": 4, **kw})
  for bad in (300, 256, -1):  # the vocabulary is 0 to 255: its size is one past it
    with pytest.raises(config.ConfigError, match=rf"^prompt token {bad} is not in the model's "
                                                 rf"vocabulary \(0 to 255\)$"):
      sampler.sample_tokens([[0, 255], [0, bad]], 4)


def test_generate_script_refuses_bad_options_before_loading(tmp_path, capsys):
  """Bad values are one sentence and exit 2 before the workdir is read (it is not there)."""
  spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  for args, words in ((["--top-p", "1.5"], "--top-p=1.5 must be above 0 and at most 1 (1 = off)"),
                      (["--temperature", "-1"], "--temperature=-1.0 must be a finite number, not "
                                                 "negative (0 = greedy)"),
                      (["--stop-token", "-2"], "--stop-token=-2 must be a token id (0 or more), "
                                               "or -1 for none"),
                      (["--stop-token", "5", "--stop-token", "-2"], "--stop-token=-2 must be a "
                                                                    "token id (0 or more), or -1 "
                                                                    "for none"),
                      (["--stop-token", "-1", "--stop-token", "5"], "--stop-token=-1 (none) "
                                                                    "cannot be given with other "
                                                                    "stop tokens (5)")):
    assert script.main(["--workdir", str(tmp_path / "none"), *args]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == \
        [f"error: {words}"], err
    assert "Traceback" not in err
