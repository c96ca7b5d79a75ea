"""A byte-level BPE tokenizer trained on a folder of text files (the `tokenizers` library),
written as a folder transformers' AutoTokenizer loads: tokenizer.json, tokenizer_config.json and
a ChatML chat template (chat_template.jinja). With it, a model folder with a tokenizer is made
without any download: train with data.tokenizer=FOLDER, then export --hf (docs/huggingface.md's
offline recipe)."""
from __future__ import annotations

import json
import os

from jaxpar.config import ConfigError
from jaxpar.data import local_text

END, START, STOP = "<|endoftext|>", "<|im_start|>", "<|im_end|>"  # ids 0, 1, 2
SPECIAL = (END, START, STOP)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BYTES = 256  # the byte-level alphabet every vocabulary starts from


def train(source: str, out: str, vocab_size: int, max_bytes: int = 1 << 20) -> list[str]:
  """Trains the tokenizer on the text files under `source` (as data.source=local_text reads
  them, at most `max_bytes`) and writes FILES into `out`; returns their paths. Bad input (no
  text, a vocabulary below the byte alphabet and the special tokens, a folder that already holds
  a tokenizer) is one sentence before anything is written."""
  if vocab_size < BYTES + len(SPECIAL):
    raise ConfigError(f"--vocab-size={vocab_size} must be at least {BYTES + len(SPECIAL)} (the "
                      f"{BYTES} bytes and {', '.join(SPECIAL)})")
  if not os.path.isdir(source):
    raise ConfigError(f"{source} is not a folder of text files")
  files = local_text.scan(source, only_py=False, max_bytes=max_bytes)
  if not files:
    raise ConfigError(f"{source} holds no UTF-8 text files to train a tokenizer on")
  taken = [name for name in FILES if os.path.exists(os.path.join(out, name))]
  if taken:
    raise ConfigError(f"{out} already holds {taken[0]}; give a new --out folder")
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  def texts():
    for rel, n in files:
      with open(os.path.join(source, rel), "rb") as f:
        yield f.read(n).decode("utf-8", errors="ignore")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts(), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  os.makedirs(out, exist_ok=True)
  paths = [os.path.join(out, name) for name in FILES]
  tok.save(paths[0])
  with open(paths[1], "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END, "eos_token": END,
               "unk_token": None, "pad_token": END}, f, indent=2)
    f.write("\n")
  with open(paths[2], "w") as f:
    f.write(CHAT_TEMPLATE)
  return paths
