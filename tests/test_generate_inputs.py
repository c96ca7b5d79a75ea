"""scripts/generate.py's inputs: every option bounded (one sentence, exit 2, before the checkpoint
is read), and a prompt's bytes taken as they are, whatever they are."""
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import child_env

from jaxpar import config
from jaxpar.commands import generate as generate_command
from jaxpar.interop import generate
from jaxpar.models.registry import build_model
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
        "model.seq_len=16", "train.batch_size=8"]
RAW = b"a\xff\xfeb"  # not UTF-8


def script(*args):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *args],
                        capture_output=True, timeout=300, env=child_env(), cwd=ROOT)


def errors(r) -> list[str]:
  return [l for l in r.stderr.decode().splitlines() if l.startswith("error:")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A fresh tiny GPT saved as the checkpoint of step 0."""
  cfg = config.load(None, TINY)
  trainer = Trainer(cfg, jmesh.make((1, 1, 1), jax.devices()[:1]), build_model(cfg))
  wd = tmp_path_factory.mktemp("generate") / "wd"
  trainer.save(str(wd), trainer.init(0))
  return wd


BEFORE_THE_CHECKPOINT = [
    ("--max-new-tokens", "1000000000000",
     "--max-new-tokens=1000000000000 must be between 0 and 1048576"),
    ("--seed", "99999999999999999999",
     "--seed=99999999999999999999 must be between 0 and 4294967295 (a key takes 32 bits of it)"),
    ("--num-samples", "100000", "--num-samples=100000 must be between 1 and 4096"),
    ("--top-k", "99999999999", "--top-k=99999999999 must be between 0 (off) and the vocabulary "
                               "size"),
    ("--stop-token", "99999999999", "--stop-token=99999999999 must be a token id (0 or more), "
                                    "or -1 for none"),
    ("--temperature", "inf", "--temperature=inf must be a finite number, not negative "
                             "(0 = greedy)"),
    ("--top-p", "0", "--top-p=0.0 must be above 0 and at most 1 (1 = off)"),
]


def test_an_out_of_range_option_is_one_sentence_before_the_checkpoint(tmp_path):
  """The two that crashed (OverflowError) through the script itself; every one in process. The
  workdir holds no checkpoint: checked after the read, the error would say that instead."""
  for flag, value, sentence in BEFORE_THE_CHECKPOINT[:2]:
    r = script("--workdir", str(tmp_path / "none"), "--prompt", "x", flag, value)
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr
    assert errors(r) == [f"error: {sentence}"]
  assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("flag,value,sentence", BEFORE_THE_CHECKPOINT)
def test_each_option_is_refused_in_process(tmp_path, capsys, flag, value, sentence):
  argv = ["--workdir", str(tmp_path / "none"), "--prompt", "x", flag, value]
  assert generate_command.main(argv) == 2
  assert capsys.readouterr().err == f"error: {sentence}\n"


def test_every_option_is_checked_before_the_checkpoint():
  """In process, each bound is refused by check_options itself (what the script calls first)."""
  ok = dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, num_samples=1, stop_token=None)
  generate.check_options(**ok, seed=generate.SEED_RANGE - 1, prompts=generate.MAX_ROWS)
  generate.check_options(**{**ok, "max_new_tokens": generate.MAX_NEW_TOKENS})
  for bad, match in [({"max_new_tokens": generate.MAX_NEW_TOKENS + 1}, "--max-new-tokens"),
                     ({"max_new_tokens": -1}, "--max-new-tokens"),
                     ({"temperature": float("nan")}, "--temperature"),
                     ({"top_p": 0.0}, "--top-p"), ({"top_k": -1}, "--top-k"),
                     ({"num_samples": 0}, "--num-samples"), ({"stop_token": -2}, "--stop-token"),
                     ({"seed": -1}, "--seed"), ({"seed": generate.SEED_RANGE}, "--seed"),
                     ({"prompts": 2, "num_samples": generate.MAX_ROWS}, "rows, more than"),
                     ({"num_samples": 64, "max_new_tokens": generate.MAX_NEW_TOKENS},
                      "new tokens, more than")]:
    with pytest.raises(config.ConfigError, match=match):
      generate.check_options(**{**ok, **bad})


def test_a_prompt_of_any_bytes_generates_from_those_bytes(workdir, monkeypatch):
  # In process: argv's str (surrogateescape) reaches the model as the prompt's very bytes.
  seen = []
  sample_tokens = generate.Sampler.sample_tokens

  def spy(self, prompts, *a, **k):
    seen.extend(np.asarray(p).tolist() for p in prompts)
    return sample_tokens(self, prompts, *a, **k)
  monkeypatch.setattr(generate.Sampler, "sample_tokens", spy)
  argv_prompt = os.fsdecode(RAW)  # what sys.argv holds on Linux: 'a\udcff\udcfeb'
  assert generate_command.main(["--workdir", str(workdir), "--prompt", argv_prompt,
                                "--max-new-tokens", "4", "--temperature", "0", "--mesh", "8x1x1"]) == 0
  assert seen == [[0, 97, 255, 254, 98]]  # end-of-text, then the bytes

  # The script: it generates (exit 0), shows the prompt as the samples are shown (U+FFFD for
  # invalid UTF-8), and continues as the library does from the same bytes.
  r = script("--workdir", str(workdir), "--prompt", RAW, "--max-new-tokens", "12",
             "--temperature", "0", "--stop-token", "-1")
  assert r.returncode == 0, r.stderr
  sampler = generate.Sampler(str(workdir), (8, 1, 1))  # greedy: the same on any mesh
  want = sampler.generate(RAW, 12, temperature=0, stop_token=-1)[0]
  assert r.stdout == ("a\ufffd\ufffdb" + want + "\n").encode()


def test_a_tokenizer_reads_a_prompts_bytes_as_utf8_with_replacement():
  codec = generate.Codec(config.load(None, TINY))

  class Ids:  # a tokenizers.Tokenizer's encode, recording the text it is given
    def encode(self, text, add_special_tokens):
      self.text = text
      return type("Encoding", (), {"ids": [7]})()
  codec.tokenizer = tokenizer = Ids()
  assert codec.encode(RAW).tolist() == [codec.eos, 7]
  assert tokenizer.text == "a\ufffd\ufffdb"
  codec.encode(os.fsdecode(RAW))  # argv's form: the same bytes
  assert tokenizer.text == "a\ufffd\ufffdb"
