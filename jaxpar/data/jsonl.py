"""Instruction and chat data from JSON Lines files, packed into windows, the loss on the answers.

data.source=jsonl reads split S from <data.path>/S.jsonl (train.jsonl, validation.jsonl). A line
is one record, either

  {"prompt": "...", "completion": "..."}   the prompt's tokens, the completion's, end-of-text;
                                           the loss on the completion and the end-of-text token
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}
                                           rendered by the tokenizer folder's chat template (its
                                           tokenizer_config.json's chat_template, or
                                           chat_template.jinja); the loss on each assistant
                                           turn, its end-of-turn token included

Text is tokenised with data.tokenizer (byte tokens without one; those have no chat template).
Each record's tokens come with an answer mask. Records are packed whole into windows of
seq_len + 1 tokens by best-fit decreasing (longest first, each into the fullest window it fits),
and each window carries, beside its `tokens`, `segment_ids` (1, 2, ... for its records, 0 for
padding) and `loss_mask` (1.0 where the token is an answer's). A record longer than a window is
refused (data.long_records=refuse) or cut into window-long pieces, each its own segment
(data.long_records=split).

Chat answers are found by rendering the conversation up to each assistant turn: the text from the
end of the rendering of the turns before it with the generation prompt to the end of the
rendering through it (trailing whitespace left out) is the answer, and every token overlapping
it is masked in (as transformers' return_assistant_tokens_mask does with `{% generation %}`
blocks). A template that renders an earlier turn differently once later turns follow is refused,
naming the record. Rendering is transformers' apply_chat_template where transformers is
installed, else jinja2 in the environment transformers gives templates.

One pass over a split reads, checks and tokenises every record, keeping each line's file offset
and token count (12 bytes a record); a batch reads and tokenises again only its windows'
records. Bad input is a ConfigError naming the file and line.
"""
from __future__ import annotations

import bisect
import json
import os
from datetime import datetime

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.tokens import SEPARATOR, tokenize
from jaxpar.data.windows import end_of_text_id

ROLES = ("system", "user", "assistant", "tool")


def split_file(path: str, split: str) -> str:
  """<path>/<split>.jsonl; ConfigError if data.path is not a folder holding it."""
  if not path:
    raise ConfigError("data.source=jsonl needs data.path, a folder holding train.jsonl (and "
                      "validation.jsonl to evaluate on)")
  if not os.path.isdir(path):
    raise ConfigError(f"data.path={path} is not a folder: data.source=jsonl reads "
                      f"<data.path>/{split}.jsonl")
  file = os.path.join(path, f"{split}.jsonl")
  if not os.path.isfile(file):
    have = sorted(f for f in os.listdir(path) if f.endswith(".jsonl"))
    raise ConfigError(f"{file} does not exist: data.source=jsonl reads split {split!r} from "
                      f"<data.path>/{split}.jsonl (found: {', '.join(have) or 'no .jsonl files'})")
  return file


# -- chat templates ------------------------------------------------------------------------------

def tokenizer_folder(tokenizer_path: str) -> str:
  """The folder of data.tokenizer (itself, or the folder of its tokenizer.json)."""
  return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)


def _config(folder: str) -> dict:
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} is not a JSON file ({e})") from None
  return out if isinstance(out, dict) else {}


def template_text(folder: str) -> str | None:
  """The folder's chat template: chat_template.jinja, else tokenizer_config.json's chat_template
  (a string, or a list of named ones: 'default'); None without one."""
  jinja = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  template = _config(folder).get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return template if isinstance(template, str) and template else None


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def special_token(folder: str, name: str) -> str | None:
  """tokenizer_config.json's special token `name` (e.g. "eos_token") as text, or None."""
  return _token_text(_config(folder).get(name))


class ChatTemplate:
  """render(messages, add_generation_prompt) -> str, as transformers' apply_chat_template
  renders the folder's template (tokenize=False)."""

  def __init__(self, folder: str, text: str):
    self.folder, self.text = folder, text
    try:
      import transformers  # noqa: F401  (lazy: a heavy optional dependency; the reference renderer)
    except ImportError:
      self._render = self._jinja(text, folder)
    else:
      self._render = self._transformers(folder)

  def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
    return self._render(messages, add_generation_prompt)

  @staticmethod
  def _transformers(folder: str):
    from transformers import AutoTokenizer  # lazy: a heavy optional dependency
    try:
      tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises many kinds for a folder it cannot read
      raise ConfigError(f"data.tokenizer={folder}: transformers cannot load the tokenizer whose "
                        f"chat template renders messages records ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def render(messages, add_generation_prompt):
      return tok.apply_chat_template(messages, tokenize=False,
                                     add_generation_prompt=add_generation_prompt)
    return render

  @staticmethod
  def _jinja(text: str, folder: str):
    """The environment transformers compiles chat templates in (its chat_template_utils):
    sandboxed, trim_blocks and lstrip_blocks, loop controls, its tojson, raise_exception and
    strftime_now; `{% generation %}` blocks render their body."""
    try:
      import jinja2  # lazy: an optional dependency, only for messages records
      from jinja2 import ext, nodes
      from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
      raise ConfigError("messages records need transformers or jinja2 to render the chat "
                        "template: pip install jinja2") from None

    class Generation(ext.Extension):
      tags = {"generation"}

      def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

      def _body(self, caller):
        return caller()

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
      template = env.from_string(text)
    except jinja2.TemplateError as e:
      raise ConfigError(f"the chat template of {folder} does not parse ({e})") from None
    config = _config(folder)
    special = {name: _token_text(config.get(name)) for name in
               ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")}
    special = {k: v for k, v in special.items() if v is not None}

    def render(messages, add_generation_prompt):
      return template.render(messages=messages, tools=None, documents=None,
                             add_generation_prompt=add_generation_prompt, **special)
    return render


# -- one record -> tokens and answer mask ---------------------------------------------------------

class Encoder:
  """A record's tokens [L] int32 and answer mask [L] bool, with the run's tokenizer (or bytes)."""

  def __init__(self, tokenizer=None, tokenizer_path: str = ""):
    self.tokenizer = tokenizer
    self.folder = tokenizer_folder(tokenizer_path) if tokenizer_path else ""
    if tokenizer is None:
      self.eos = SEPARATOR
    else:  # the folder's own end of text (an instruct model's end of turn), else the usual ones
      eos = _token_text(_config(self.folder).get("eos_token")) if self.folder else None
      i = tokenizer.token_to_id(eos) if eos else None
      self.eos = i if i is not None else end_of_text_id(tokenizer)
    self._template = None  # made at the first messages record

  def encode(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    if "messages" in record:
      return self._chat(record["messages"], where)
    prompt, completion = self._text(record["prompt"]), self._text(record["completion"])
    ids = np.concatenate([prompt, completion, [self.eos]]).astype(np.int32)
    mask = np.arange(len(ids)) >= len(prompt)
    return ids, mask

  def _text(self, text: str) -> np.ndarray:
    if self.tokenizer is None:
      return tokenize(text).astype(np.int32)
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def template(self, where: str) -> ChatTemplate:
    if self._template is None:
      if self.tokenizer is None:
        raise ConfigError(f"{where}: a messages record needs a chat template, and byte tokens "
                          f"have none: set data.tokenizer to a tokenizer folder whose "
                          f"tokenizer_config.json has a chat_template, or write "
                          f"prompt/completion records")
      text = template_text(self.folder)
      if text is None:
        raise ConfigError(f"{where}: a messages record needs a chat template, and the tokenizer "
                          f"folder {self.folder} has none (no chat_template in its "
                          f"tokenizer_config.json, no chat_template.jinja): use a folder with "
                          f"one, or write prompt/completion records")
      self._template = ChatTemplate(self.folder, text)
    return self._template

  def _chat(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    template = self.template(where)
    render = lambda msgs, gen: self._render(template, msgs, gen, where)
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      before, through = render(messages[:i], True), render(messages[:i + 1], False)
      if not (through.startswith(before) and full.startswith(through)):
        raise ConfigError(f"{where}: the chat template of {self.folder} renders the turns up to "
                          f"message {i} differently once more turns follow, so the answer's "
                          f"tokens cannot be told apart; give each answer its own record "
                          f"(the conversation up to it)")
      spans.append((len(before), max(len(before), len(through.rstrip()))))
    enc = self.tokenizer.encode(full, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), bool)
    for a, b in spans:  # every token overlapping an answer
      mask |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
    return ids, mask

  @staticmethod
  def _render(template: ChatTemplate, messages, gen: bool, where: str) -> str:
    try:
      return template.render(messages, gen)
    except ConfigError:
      raise
    except Exception as e:  # the template's own raise_exception, or an error in it
      raise ConfigError(f"{where}: the chat template of {template.folder} fails on this record "
                        f"({type(e).__name__}: {e})") from None


def check_record(record, where: str) -> dict:
  """The record as it is when it is one of the two forms; ConfigError naming `where` if not."""
  if not isinstance(record, dict):
    raise ConfigError(f"{where}: a record must be a JSON object with prompt and completion, or "
                      f"messages; got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
      raise ConfigError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} "
                        f"objects")
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
        raise ConfigError(f"{where}: message {i} must be an object with a role and a string "
                          f"content, got {json.dumps(m)[:80]}")
      if m["role"] not in ROLES:
        raise ConfigError(f"{where}: message {i} has role {m['role']!r}, not one of "
                          f"{', '.join(ROLES)}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
      raise ConfigError(f"{where}: the conversation has no assistant message, so nothing to "
                        f"learn")
    if roles[0] == "assistant":
      raise ConfigError(f"{where}: the conversation starts with an assistant message; an answer "
                        f"needs a message before it")
    return record
  if not all(isinstance(record.get(k), str) for k in ("prompt", "completion")):
    raise ConfigError(f"{where}: a record needs string fields prompt and completion, or a "
                      f"messages list; it has {', '.join(sorted(record)) or 'no fields'}")
  return record


# -- a split: lines, counts, the packing ----------------------------------------------------------

def best_fit_decreasing(lengths: np.ndarray, width: int) -> list[list[int]]:
  """Bins of at most `width` for items of `lengths` (each <= width): the longest first, each
  into the bin it leaves the least room in (a new bin where none fits). Items' indices by bin."""
  room_bins: dict[int, list[int]] = {}  # room left -> bins with that much room
  rooms: list[int] = []  # the distinct rooms of room_bins, sorted
  bins: list[list[int]] = []
  for item in np.argsort(-np.asarray(lengths), kind="stable").tolist():
    n = int(lengths[item])
    k = bisect.bisect_left(rooms, n)
    if k == len(rooms):
      b, room = len(bins), width
      bins.append([])
    else:
      room = rooms[k]
      b = room_bins[room].pop()
      if not room_bins[room]:
        del room_bins[room], rooms[k]
    bins[b].append(item)
    room -= n
    if room:
      if room not in room_bins:
        room_bins[room] = []
        bisect.insort(rooms, room)
      room_bins[room].append(b)
  return bins


class PackedRecords:
  """A JSONL split packed into windows [n, seq_len + 1], read when indexed.

  packed=False puts one record in each window (the baseline benchmarks/packing.py measures).
  Indexing by an int array gives {'tokens' int32, 'segment_ids' int32, 'loss_mask' float32},
  each [len(rows), seq_len + 1]. Safe to index from several threads.
  """

  def __init__(self, file: str, seq_len: int, encoder: Encoder, split_long: bool = False,
               packed: bool = True):
    self.file, self.encoder, self.width, self.split_long = file, encoder, seq_len + 1, split_long
    offsets, counts, answers = [0], [], 0
    with open(file, "rb") as f:
      for number, line in enumerate(f, 1):
        offsets.append(offsets[-1] + len(line))
        if not line.strip():  # a blank line holds no record
          counts.append(-1)
          continue
        ids, mask = self._record(line, number)
        if len(ids) > self.width and not split_long:
          raise ConfigError(f"{file}:{number}: the record is {len(ids)} tokens, longer than a "
                            f"window of model.seq_len + 1 = {self.width}: raise model.seq_len, "
                            f"or set data.long_records=split to cut it into windows")
        counts.append(len(ids))
        answers += int(mask[1:].sum())
    self._offsets = np.asarray(offsets, np.int64)  # line k (from 0) is bytes [o[k], o[k+1])
    self._counts = np.asarray(counts, np.int32)  # its tokens, -1 for a blank line
    lines = np.flatnonzero(self._counts >= 0)
    if not len(lines):
      raise ConfigError(f"{file} holds no records")
    # pieces: (line, first token, tokens); a record longer than a window is several
    pieces = [(int(k), s, min(self.width, int(self._counts[k]) - s))
              for k in lines.tolist() for s in range(0, int(self._counts[k]), self.width)]
    self._pieces = np.asarray(pieces, np.int64).reshape(-1, 3)
    self._rows = (best_fit_decreasing(self._pieces[:, 2], self.width) if packed else
                  [[p] for p in range(len(pieces))])  # one record a row: what packing saves
    self.records, self.answer_tokens = len(lines), answers
    self.long_records = int((self._counts > self.width).sum())  # each cut into several pieces
    self.tokens = int(self._pieces[:, 2].sum())
    self.n = len(self._rows)
    self.dtype = np.dtype(np.int32)

  def _record(self, line: bytes, number: int) -> tuple[np.ndarray, np.ndarray]:
    where = f"{self.file}:{number}"
    try:
      record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
      raise ConfigError(f"{where}: the line is not JSON ({e})") from None
    return self.encoder.encode(check_record(record, where), where)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.n, self.width)

  @property
  def ndim(self) -> int:
    return 2

  def __len__(self) -> int:
    return self.n

  def element_spec(self, rows: int) -> dict:
    """{name: (shape, dtype)} of a batch of `rows` windows."""
    shape = (rows, self.width)
    return {"tokens": (shape, np.dtype(np.int32)), "segment_ids": (shape, np.dtype(np.int32)),
            "loss_mask": (shape, np.dtype(np.float32))}

  def _read(self, fd: int, line: int) -> tuple[np.ndarray, np.ndarray]:
    start, end = self._offsets[line], self._offsets[line + 1]
    ids, mask = self._record(os.pread(fd, int(end - start), int(start)), line + 1)
    if len(ids) != self._counts[line]:
      raise RuntimeError(f"{self.file}:{line + 1} now gives {len(ids)} tokens, not the "
                         f"{self._counts[line]} counted: the file or the tokenizer changed while "
                         f"training")
    return ids, mask

  def __getitem__(self, index) -> dict:
    rows = np.asarray(index, np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= self.n):
      raise IndexError(f"window index out of range for {self.n} windows")
    pieces = [self._rows[r] for r in rows.tolist()]
    lines = sorted({int(self._pieces[p, 0]) for row in pieces for p in row})
    fd = os.open(self.file, os.O_RDONLY)  # pread: no shared file position between threads
    try:
      records = {line: self._read(fd, line) for line in lines}  # each record read once per call
    finally:
      os.close(fd)
    out = {"tokens": np.zeros((len(rows), self.width), np.int32),
           "segment_ids": np.zeros((len(rows), self.width), np.int32),
           "loss_mask": np.zeros((len(rows), self.width), np.float32)}
    for i, row in enumerate(pieces):
      at = 0
      for segment, p in enumerate(row, 1):
        line, first, n = (int(v) for v in self._pieces[p])
        ids, mask = records[line]
        out["tokens"][i, at:at + n] = ids[first:first + n]
        out["segment_ids"][i, at:at + n] = segment
        out["loss_mask"][i, at:at + n] = mask[first:first + n]
        at += n
    return out

  def padding(self) -> float:
    """The share of the windows' tokens that are padding."""
    return 1.0 - self.tokens / (self.n * self.width)

  def summary(self) -> str:
    """The start-up line saying how the split packed (the training run prints it)."""
    count = lambda n, what: f"{n:,} {what}" + ("" if n == 1 else "s")
    line = (f"data: {count(self.records, 'record')} of {os.path.basename(self.file)} -> "
            f"{count(self.n, 'window')} of {self.width:,} tokens, {self.padding():.1%} padding")
    if self.split_long:  # under refuse, a long record stops the run before this line
      pieces = len(self._pieces) - (self.records - self.long_records)
      line += (f", {count(self.long_records, 'record')} split into {count(pieces, 'piece')} "
               f"(data.long_records=split)")
    return line
