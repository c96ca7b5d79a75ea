"""Packed documents (models/segments.py): rows holding several documents, each at positions from
0 and seeing only itself, give what the same documents give one per row with the padding masked.

Every layout runs one training step on 4 packed rows of T = 32 (11 documents, one row ending in
padding) and must match one device on the 11 documents one per row (fp32, 1e-5 relative): the
loss, the `loss_weight` count, every gradient, and each document's own loss (the eval loss with
a loss_mask on that document alone). The layouts together cover blockwise attention, the ring on
`context` (C = 4 load-balanced, and C = 2 in its all-gather form inside a pipeline), the 1F1B
pipeline beside data parallelism (and its row-by-row evaluation), tensor + sequence parallelism
with remat, ZeRO-3, gradient accumulation, GPT's learned and Llama's rotary positions, and a
mixture of experts. Changing one document's tokens moves no
other document's logits (exactly), on the matmul and the blockwise forms; the ring's isolation
and equality with one device's attention are in test_ring_attention.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_equivalence import assert_trees_close

from jaxpar import config
from jaxpar.data import synthetic_windows
from jaxpar.models import blockwise as bw
from jaxpar.models import decoder, gpt
from jaxpar.models import registry as jmodel
from jaxpar.parallel import mesh as jmesh
from jaxpar.train.step import Trainer

RTOL = 1e-5
T = 32
# documents' lengths per packed row of T + 1 tokens; the last row ends in 13 padding tokens
ROWS = [[10, 15, 8], [20, 13], [7, 9, 5, 12], [14, 6]]
BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
        f"model.seq_len={T}", f"train.batch_size={len(ROWS)}", "train.warmup_steps=1",
        "train.steps=2", "train.lr=1e-2", "precision.compute_dtype=float32"]
MOE = ["model.n_experts=4", "train.moe_aux_weight=0", "train.moe_z_weight=0"]  # the router's
# losses average over every token, padding too, so they would differ from the padded reference


def documents():
  """The documents' tokens, learnable (synthetic_windows' chains), one array each."""
  w = synthetic_windows(T, 0).astype(np.int32)
  return [w[i, :n] for i, n in enumerate(n for row in ROWS for n in row)]


def packed():
  """{'tokens', 'segment_ids'} (4, T+1) and each document's (row, id)."""
  docs, where = iter(documents()), []
  tokens = np.zeros((len(ROWS), T + 1), np.int32)
  seg = np.zeros((len(ROWS), T + 1), np.int32)
  for r, row in enumerate(ROWS):
    at = 0
    for d, n in enumerate(row, start=1):
      tokens[r, at:at + n], seg[r, at:at + n] = next(docs), d
      where.append((r, d))
      at += n
  return {"tokens": tokens, "segment_ids": seg}, where


def one_per_row():
  """The same documents one per row from column 0, the rest padding (segment 0)."""
  docs = documents()
  tokens = np.zeros((len(docs), T + 1), np.int32)
  seg = np.zeros((len(docs), T + 1), np.int32)
  for i, doc in enumerate(docs):
    tokens[i, :len(doc)], seg[i, :len(doc)] = doc, 1
  return {"tokens": tokens, "segment_ids": seg}


def per_document(batch, masks):
  """The batch once per document, its loss_mask on that document alone."""
  return [{**batch, "loss_mask": m.astype(np.float32)} for m in masks]


def trainer(cfg, shape):
  n = int(np.prod(shape))
  jmesh.check(shape, cfg, n)
  return Trainer(cfg, jmesh.make(shape, jax.devices()[:n]), jmodel.decoder(cfg), expose_grads=True)


def run(cfg, shape, batch, doc_batches, by_rows=False):
  """(loss, loss_weight, first step's grads (the model's layer order), each document's loss,
  with `by_rows` the row-by-row evaluation's (loss, loss_weight) of the batch (eval_weighted,
  what train.eval_steps=0 runs), else None)."""
  t = trainer(cfg, shape)
  state = t.init(cfg.train.seed)
  as_jax = lambda b: {k: jnp.asarray(v) for k, v in b.items()}
  evaluate = t.eval_jitted(jax.eval_shape(lambda: as_jax(doc_batches[0])))
  docs = [float(evaluate(state["params"], as_jax(b))["loss"]) for b in doc_batches]
  rows = None
  if by_rows:
    weighted = t.eval_jitted(jax.eval_shape(lambda: as_jax(batch)), weighted=True)
    m = weighted(state["params"], as_jax(batch), jnp.ones(len(batch["tokens"]), jnp.float32))
    rows = float(m["loss"]), float(m["loss_weight"])
  _, m = t.step(state, as_jax(batch))
  back = None if t.layer_order is None else np.argsort(t.layer_order)
  grads = jax.device_get(t._reorder(m["grads"], back))
  return float(m["loss"]), float(m["loss_weight"]), grads, np.array(docs), rows


_references = {}


def reference(kind, model_extra):
  """One device on the documents one per row (cached per model)."""
  key = (kind, tuple(model_extra))
  if key not in _references:
    batch = one_per_row()
    masks = [np.eye(len(batch["tokens"]), dtype=bool)[i][:, None] & (batch["segment_ids"] > 0)
             for i in range(len(batch["tokens"]))]
    cfg = config.load(None, BASE + [f"model.kind={kind}", *model_extra])
    _references[key] = run(cfg, (1, 1, 1), batch, per_document(batch, masks))
  return _references[key]


LAYOUTS = [
    ("gpt", (1, 1, 1), [], []),
    # blockwise attention (from T = 16 here), tensor + sequence parallel, ZeRO-3, remat
    ("gpt", (2, 2, 1), [], ["parallel.sequence_parallel=true", "parallel.zero_stage=3",
                           "parallel.remat=full", "blockwise"]),
    # the ring on context, C = 4 (load-balanced chunks), with gradient accumulation
    ("gpt", (1, 1, 1, 4), [], ["train.grad_accum=2"]),
    # the 1F1B pipeline beside data parallelism, its stages' attention all-gathered over a
    # context of C = 2 (GPT's learned positions taken per microbatch)
    ("gpt", (2, 1, 2, 2), [], ["parallel.schedule=1f1b", "parallel.microbatches=2"]),
    # a Llama mixture of experts (rotary positions, dropless) beside data and tensor
    # parallelism, ZeRO-3
    ("llama", (2, 2, 1), MOE + ["model.n_kv_heads=2"], ["parallel.zero_stage=3"]),
]

def layout_id(layout):
  kind, shape, model_extra, extra = layout
  return "-".join([kind, "x".join(map(str, shape)), *(["moe"] if MOE[0] in model_extra else []),
                   *(e.split("=")[0].split(".")[-1] + (e.split("=")[1] if "=" in e else "")
                     for e in extra)])


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_packed_rows_match_one_document_per_row(layout, monkeypatch):
  kind, shape, model_extra, extra = layout
  if "blockwise" in extra:
    monkeypatch.setattr(gpt, "BLOCKWISE_MIN_SEQ", 16)
    extra = [e for e in extra if e != "blockwise"]
  want_loss, want_count, want_grads, want_docs, _ = reference(kind, model_extra)
  batch, where = packed()
  masks = [(np.arange(len(ROWS))[:, None] == r) & (batch["segment_ids"] == d) for r, d in where]
  cfg = config.load(None, BASE + [f"model.kind={kind}", *model_extra, *extra])
  # the pipeline's row-by-row eval: each row runs as all M microbatches, its count its own
  by_rows = "parallel.schedule=1f1b" in extra
  loss, count, grads, docs, rows = run(cfg, shape, batch, per_document(batch, masks), by_rows)
  assert count == want_count == sum(n - 1 for row in ROWS for n in row)
  np.testing.assert_allclose(docs, want_docs, rtol=RTOL)
  np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
  assert_trees_close(grads, want_grads, "grads")
  if by_rows:
    assert rows[1] == count
    np.testing.assert_allclose(rows[0], want_loss, rtol=RTOL)


@pytest.mark.parametrize("blockwise", [False, True], ids=["matmuls", "blockwise"])
def test_changing_one_document_moves_no_other_documents_logits(blockwise, monkeypatch):
  """Row 2's second document gets other tokens: its logits move, every other token's are
  bitwise the same (the matmul form, and the blockwise one with blocks of 8)."""
  if blockwise:
    monkeypatch.setattr(gpt, "BLOCKWISE_MIN_SEQ", 16)
    monkeypatch.setattr(bw, "BLOCK", 8)
  cfg = config.load(None, BASE + ["model.kind=gpt"])
  mdef = jmodel.decoder(cfg)
  params = mdef.init(jax.random.key(0))
  parts = gpt.parts(cfg.model)
  batch, _ = packed()
  seg = jnp.asarray(batch["segment_ids"][:, :-1])
  logits = jax.jit(lambda p, x: decoder.forward(parts, p, x, segment_ids=seg))
  before = np.asarray(logits(params, jnp.asarray(batch["tokens"][:, :-1])))
  changed = batch["tokens"][:, :-1].copy()
  doc = (np.arange(len(ROWS))[:, None] == 2) & (batch["segment_ids"][:, :-1] == 2)
  changed[doc] = (changed[doc] + 7) % 256
  after = np.asarray(logits(params, jnp.asarray(changed)))
  assert np.abs(after[doc] - before[doc]).max() > 1e-3
  np.testing.assert_array_equal(after[~doc], before[~doc])
