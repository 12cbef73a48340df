"""The slot engine (compact Llama forward + static KV cache) against Hugging Face's forward.

Real SmolLM2 weights (float32) for logits, greedy decoding, batch invariance and rollback;
tiny random models for the architecture variants (Qwen2 biases, untied head, RoPE scaling),
the fallback choice and slot bookkeeping."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from tests.conftest import tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.batch import BatchedEngine, BatchRow, SlotsExhaustedError
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.llama_forward import load_safetensors_weights
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.engines.torch.model_loading import make_torch_engine, resolve_model_path
from triton_backend.core.tree import path_to

REL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def smol(reference, reference_prompts):
    engine, tokenizer = reference
    assert isinstance(engine, LlamaEngine), "the slot engine is the default torch runtime for SmolLM2"
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in reference_prompts]
    return engine, prompts


# -- real weights --------------------------------------------------------------------------
@pytest.mark.slow
def test_logits_match_hf_prefill_and_step_by_step(smol):
    engine, prompts = smol
    assert len(prompts) >= 10
    for ids in prompts:
        continuation = [(37 * i + 11) % engine.vocab_size for i in range(6)]
        ref = _hf_logits(engine.model, ids + continuation)
        session = engine.new_session()
        prefill = session.logits(ids, len(ids))  # every prompt position
        assert _rel(prefill, ref[:len(ids)]) < REL
        for i in range(1, len(continuation) + 1):
            step = session.logits(ids + continuation[:i], 1)[0]
            assert _rel(step, ref[len(ids) + i - 1]) < REL
        session.release()


@pytest.mark.slow
def test_batched_greedy_equals_hf_generate(smol):
    """10 prompts x 64 tokens, decoded together (one ragged pass per step), each equal to HF generate."""
    engine, prompts = smol
    new_tokens = 64
    slots = [engine.allocate() for _ in prompts]
    try:
        outs = engine.forward([BatchRow(s, 0, ids) for s, ids in zip(slots, prompts)])
        seqs = [list(ids) for ids in prompts]
        for _ in range(new_tokens):
            nxt = [int(o.logits[-1].argmax()) for o in outs]
            rows = [BatchRow(s, len(seq), [t]) for s, seq, t in zip(slots, seqs, nxt)]
            for seq, t in zip(seqs, nxt):
                seq.append(t)
            outs = engine.forward(rows)
    finally:
        for s in slots:
            engine.release(s)
    for ids, seq in zip(prompts, seqs):
        x = torch.tensor([ids])
        with torch.inference_mode():
            ref = engine.model.generate(x, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, attention_mask=torch.ones_like(x))
        assert seq[len(ids):] == ref[0, len(ids):].tolist()


def _mixed_rows(engine: LlamaEngine, prompts: list[list[int]]) -> tuple[list[int], list[BatchRow]]:
    """Four slots warmed with different prompts, then one row of each kind."""
    slots = [engine.allocate() for _ in range(4)]
    for s, ids in zip(slots, prompts[:3]):
        engine.forward([BatchRow(s, 0, ids)])
    a, b, c, d = prompts[:4]
    rows = [
        BatchRow(slots[0], len(a), [a[-1]]),  # decode
        BatchRow(slots[1], len(b), [b[0], b[1], b[2], b[3], b[4]], num_logits=5),  # verify k = 4
        BatchRow(slots[2], len(c) - 2, c[-2:] + [c[0], c[1], c[2]], num_logits=4,  # tree, 3 nodes
                 tree_parents=[-1, 0, -1], return_hidden=True),
        BatchRow(slots[3], 0, d, num_logits=2),  # prefill
    ]
    return slots, rows


@pytest.mark.slow
@pytest.mark.parametrize("invariant,row_kernel", [(False, True), (True, True), (False, False), (True, False)])
def test_batch_invariance_mixed_rows(smol, invariant, row_kernel):
    """Each row of a ragged batch gives what it gives alone: bit for bit with the row-invariant
    CPU kernel (the default), and on torch's kernels when every pass has >= 2 tokens or with
    ``batch_invariant``; greedy tokens and 1e-5 otherwise (M = 1 is a GEMV)."""
    base, prompts = smol
    engine = LlamaEngine(base.model, name="smol", eos_token_ids=[],
                         runtime=RuntimeConfig(max_batch_size=8, max_seq_len=512, batch_invariant=invariant,
                                               row_kernel=row_kernel))
    exact = engine.forward_impl.row_invariant
    assert exact == row_kernel, "the row-invariant kernel builds on the CI machine"
    slots, rows = _mixed_rows(engine, prompts)
    together = engine.forward(rows)
    for row, out in zip(rows, together):
        alone = engine.forward([row])[0]  # the same row again: same positions, same cache below it
        if exact or invariant or len(row.tokens) > 1:
            assert torch.equal(alone.logits, out.logits)
        else:
            assert _rel(out.logits, alone.logits) < 1e-5
        assert alone.logits.argmax(-1).tolist() == out.logits.argmax(-1).tolist()
    tree = together[2]
    assert tree.hidden is not None and tree.hidden.shape == (4, engine.hidden_size)
    # an all-decode batch (the rows at different lengths) against each row alone
    decode = [BatchRow(s, r.start + len(r.tokens), [r.tokens[-1]]) for s, r in zip(slots, rows)]
    batched = engine.forward(decode)
    for row, out in zip(decode, batched):
        alone = engine.forward([row])[0]
        if exact or invariant:
            assert torch.equal(alone.logits, out.logits)
        assert alone.logits.argmax(-1).tolist() == out.logits.argmax(-1).tolist()
    for s in slots:
        engine.release(s)


@pytest.mark.slow
def test_verify_and_tree_passes_equal_plain_decoding_bit_for_bit(smol):
    """On the row kernel (linear layers and attention computed per token in one fixed order) a
    position's logits are the same bits in a decode step, a verify chain and a tree pass whose
    path is then kept: speculation cannot change a greedy token, even at a near-tie."""
    engine, prompts = smol
    if not engine.forward_impl.row_invariant:
        pytest.skip("torch kernels: verify and decode passes may differ in the last bits")
    ids, drafts = prompts[5], [101, 202, 303, 404]
    plain_slot, spec_slot = engine.allocate(), engine.allocate()
    try:
        engine.forward([BatchRow(plain_slot, 0, ids)])
        engine.forward([BatchRow(spec_slot, 0, ids)])
        plain = [engine.forward([BatchRow(plain_slot, len(ids) + i - 1, [([ids[-1]] + drafts)[i]])])[0].logits[0]
                 for i in range(len(drafts) + 1)]
        chain = engine.forward([BatchRow(spec_slot, len(ids) - 1, [ids[-1]] + drafts, num_logits=len(drafts) + 1)])[0]
        for i, step in enumerate(plain):
            assert torch.equal(chain.logits[i], step), i
        # a tree whose path 0 -> 2 is drafts[0], drafts[1]; a side branch (node 1) between them
        nodes, parents = [drafts[0], 999, drafts[1]], [-1, -1, 0]
        tree = engine.forward([BatchRow(spec_slot, len(ids) - 1, [ids[-1]] + nodes, num_logits=4, tree_parents=parents)])[0]
        assert torch.equal(tree.logits[0], plain[0]) and torch.equal(tree.logits[1], plain[1])
        assert torch.equal(tree.logits[3], plain[2])
        engine.keep_tree_path(spec_slot, len(ids), [0, 2])
        after = engine.forward([BatchRow(spec_slot, len(ids) + 2, [drafts[2]])])[0]
        assert torch.equal(after.logits[0], plain[3])
    finally:
        engine.release(plain_slot)
        engine.release(spec_slot)


@pytest.mark.slow
def test_tree_row_and_kept_path_match_a_chain(smol):
    engine, prompts = smol
    ids = prompts[4]
    nodes, parents = [11, 22, 33, 44, 55], [-1, -1, 0, 2, 1]
    slot = engine.allocate()
    out = engine.forward([BatchRow(slot, 0, ids + nodes, num_logits=1 + len(nodes), tree_parents=parents)])[0]
    for i in range(len(nodes)):
        chain = ids + [nodes[j] for j in path_to(i, parents)]
        assert _rel(out.logits[1 + i], _hf_logits(engine.model, chain)[-1]) < REL
    path = path_to(3, parents)  # nodes 0, 2, 3
    engine.keep_tree_path(slot, len(ids), path)
    seq = ids + [nodes[i] for i in path] + [7]
    step = engine.forward([BatchRow(slot, len(seq) - 1, [7])])[0]
    assert _rel(step.logits[0], _hf_logits(engine.model, seq)[-1]) < REL
    engine.release(slot)


@pytest.mark.slow
def test_rollback_after_random_rounds_equals_fresh_forward(smol):
    engine, prompts = smol
    rng = random.Random(7)
    session = engine.new_session()
    seq = list(prompts[2])
    session.logits(seq, 1)
    for _ in range(25):
        k = rng.randint(0, 6)
        drafts = [rng.randrange(engine.vocab_size) for _ in range(k)]
        session.logits(seq + drafts, k + 1)
        accepted = rng.randint(0, k)
        seq = seq + drafts[:accepted] + [rng.randrange(engine.vocab_size)]
    assert session.cached_length < len(seq)
    got = session.logits(seq, 3)
    assert _rel(got, _hf_logits(engine.model, seq)[-3:]) < REL
    # an arbitrary list that parts from the cache early still gets the right answer
    other = seq[:5] + [1, 2, 3]
    assert _rel(session.logits(other, 1)[0], _hf_logits(engine.model, other)[-1]) < REL
    session.release()


@pytest.mark.slow
def test_safetensors_loader_reads_the_same_weights(smol):
    engine, _ = smol
    folder, _ = resolve_model_path("smollm2-135m-instruct")
    config, tensors = load_safetensors_weights(folder)
    assert config.num_hidden_layers == engine.forward_impl.shape.num_layers
    layer = engine.forward_impl.layers[7]
    assert torch.equal(tensors["model.layers.7.self_attn.q_proj.weight"], layer.q.weight)
    assert torch.equal(tensors["model.embed_tokens.weight"], engine.forward_impl.embed)


# -- tiny models ---------------------------------------------------------------------------
def _qwen2(rope_scaling: dict | None) -> Qwen2ForCausalLM:
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         rope_scaling=rope_scaling)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random biases so they matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_qwen2_biases_untied_head_and_rope_scaling(rope_scaling):
    model = _qwen2(rope_scaling)
    engine = make_torch_engine(model, name="qwen2", runtime=RuntimeConfig(max_batch_size=2, max_seq_len=128))
    assert isinstance(engine, LlamaEngine) and isinstance(engine, BatchedEngine)
    tokens = [(5 * i + 3) % 64 for i in range(40)]
    session = engine.new_session()
    assert _rel(session.logits(tokens[:30], 30), _hf_logits(model, tokens[:30])) < REL
    for n in range(31, 41):
        assert _rel(session.logits(tokens[:n], 1)[0], _hf_logits(model, tokens[:n])[-1]) < REL


def test_unsupported_architecture_falls_back_to_hf_engine():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert isinstance(make_torch_engine(gpt2, name="gpt2"), TorchEngine)
    assert isinstance(make_torch_engine(tiny_llama(0), runtime=RuntimeConfig(torch_engine="hf")), TorchEngine)


def test_slots_exhausted_is_a_typed_error_and_sessions_give_slots_back():
    engine = make_torch_engine(tiny_llama(1), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    first, second = engine.new_session(), engine.new_session()
    with pytest.raises(SlotsExhaustedError, match="2 KV-cache slots"):
        engine.new_session()
    first.release()
    third = engine.new_session()
    del second, third
    gc.collect()
    assert engine.cache.slots_in_use == 0
    assert engine.kv_cache_bytes() == 2 * 2 * 2 * 2 * 64 * 8 * 4  # K+V x layers x slots x kv heads x len x dim x fp32


def test_bad_rows_are_refused():
    engine = make_torch_engine(tiny_llama(2), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=16))
    slot = engine.allocate()
    with pytest.raises(ValueError, match="not allocated"):
        engine.forward([BatchRow(1, 0, [1])])
    with pytest.raises(Exception, match="twice"):
        engine.forward([BatchRow(slot, 0, [1]), BatchRow(slot, 1, [2])])
    with pytest.raises(Exception, match="context"):
        engine.forward([BatchRow(slot, 10, [1] * 7)])
    with pytest.raises(Exception, match="out of range"):
        engine.forward([BatchRow(slot, 0, [999])])


@pytest.mark.gpu
def test_cuda_forward_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_llama(4)
    cpu = make_torch_engine(model, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    tokens = [(3 * i + 1) % 32 for i in range(20)]
    ref = cpu.new_session().logits(tokens, 20)
    gpu = make_torch_engine(tiny_llama(4), runtime=RuntimeConfig(device="cuda", max_batch_size=2, max_seq_len=64))
    assert _rel(gpu.new_session().logits(tokens, 20).cpu(), ref) < REL
