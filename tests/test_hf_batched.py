"""The HF-wrapped batched engine: slots, ragged rows, rollback by start, tree rows; against
TorchSession on tiny random Llamas, and greedy decoding of several interleaved sequences on
the real model against plain decoding alone."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.batch import BatchedEngine, BatchRow, SlotsExhaustedError
from triton_backend.engines.torch.hf_batched import HFBatchedEngine
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.core.errors import ContextLengthError


def hf_engine(seed: int) -> TorchEngine:
    """The Hugging Face-wrapped torch engine (what the batched wrapper must reproduce exactly)."""
    return TorchEngine(tiny_llama(seed, vocab=32), name=f"hf{seed}", runtime=RuntimeConfig(), eos_token_ids=[])


@pytest.fixture(scope="module")
def tiny():
    engine = hf_engine(3)
    return engine, HFBatchedEngine(engine, num_slots=3)


def test_slots_allocate_release_and_protocol(tiny) -> None:
    _, batched = tiny
    assert isinstance(batched, BatchedEngine)
    slots = [batched.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    with pytest.raises(SlotsExhaustedError):
        batched.allocate()
    batched.release(1)
    batched.release(1)  # idempotent
    assert batched.allocate() == 1
    for slot in slots:
        batched.release(slot)


def test_ragged_rows_match_sessions_and_rollback(tiny) -> None:
    engine, batched = tiny
    a, b = batched.allocate(), batched.allocate()
    seq_a, seq_b = [1, 5, 7, 9, 2], [4, 4, 8]
    out = batched.forward([BatchRow(a, 0, seq_a, num_logits=2), BatchRow(b, 0, seq_b)])
    ref_a, ref_b = engine.new_session(), engine.new_session()
    torch.testing.assert_close(out[0].logits, ref_a.logits(seq_a, 2), rtol=0, atol=0)
    torch.testing.assert_close(out[1].logits, ref_b.logits(seq_b, 1), rtol=0, atol=0)
    # a verify row on a, a decode row on b; then roll a back by starting earlier
    out = batched.forward([BatchRow(a, 5, [3, 11, 12], num_logits=3), BatchRow(b, 3, [6])])
    torch.testing.assert_close(out[0].logits, ref_a.logits(seq_a + [3, 11, 12], 3), rtol=0, atol=0)
    torch.testing.assert_close(out[1].logits, ref_b.logits(seq_b + [6], 1), rtol=0, atol=0)
    out = batched.forward([BatchRow(a, 6, [13, 14], num_logits=2)])  # rejected 11, 12: overwritten
    torch.testing.assert_close(out[0].logits, ref_a.logits(seq_a + [3, 13, 14], 2), rtol=0, atol=0)
    assert batched.cached_length(a) == 8
    with pytest.raises(ValueError, match="twice"):
        batched.forward([BatchRow(a, 8, [1]), BatchRow(a, 8, [2])])
    with pytest.raises(ValueError, match="holds only"):
        batched.forward([BatchRow(b, 9, [1])])
    with pytest.raises(ContextLengthError):
        batched.forward([BatchRow(b, 4, [1] * 200)])
    batched.release(a)
    batched.release(b)


def test_tree_row_and_compaction_match_the_session(tiny) -> None:
    engine, batched = tiny
    slot = batched.allocate()
    tokens, nodes, parents = [2, 9, 4, 6], [7, 8, 1, 3], [-1, -1, 0, 2]
    out = batched.forward([BatchRow(slot, 0, tokens + nodes, num_logits=1 + len(nodes), tree_parents=parents,
                                    return_hidden=True)])[0]
    session = engine.new_session()
    logits, hidden = session.tree_logits(tokens, nodes, parents)
    torch.testing.assert_close(out.hidden, hidden, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    batched.keep_tree_path(slot, len(tokens), [0, 2])
    session.keep_tree_path([0, 2])
    assert batched.cached_length(slot) == 6
    nxt = batched.forward([BatchRow(slot, 6, [5], num_logits=1)])[0]
    torch.testing.assert_close(nxt.logits, session.logits(tokens + [7, 1, 5], 1), rtol=0, atol=0)
    assert batched.kv_cache_bytes() > 0
    batched.release(slot)


@pytest.mark.slow
def test_interleaved_greedy_decoding_equals_plain_decoding(reference, reference_prompts) -> None:
    """Four sequences decoded in one ragged pass per step (prefill rows beside decode rows,
    a late joiner) give exactly the tokens of each decoded alone."""
    engine, tokenizer = reference
    batched = HFBatchedEngine(engine, num_slots=4)
    prompts = [tokenizer.encode(p) for p in reference_prompts[:4]]
    steps = 10
    alone = []
    for ids in prompts:
        session, seq = engine.new_session(), list(ids)
        for _ in range(steps):
            seq.append(int(session.logits(seq, 1)[0].argmax()))
        alone.append(seq[len(ids):])
    seqs = {i: list(ids) for i, ids in enumerate(prompts)}
    slots: dict[int, int] = {}
    fed: dict[int, int] = {}
    for step in range(steps + 3):
        rows, order = [], []
        for i in seqs:
            if step < i or len(seqs[i]) - len(prompts[i]) >= steps:  # sequence i joins at step i
                continue
            if i not in slots:
                slots[i], fed[i] = batched.allocate(), 0
            rows.append(BatchRow(slots[i], fed[i], seqs[i][fed[i]:]))
            order.append(i)
        for i, out in zip(order, batched.forward(rows)):
            fed[i] = len(seqs[i])
            seqs[i].append(int(out.logits[0].argmax()))
    assert [seqs[i][len(prompts[i]):] for i in range(4)] == alone
