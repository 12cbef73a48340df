"""The GPU path, tested where CI runs (CPU): static-shape passes against the slot engine, padding
that never touches a real row, the pass as one traceable graph (no host sync), on-device
verification against the host verifier, synthetic targets. CUDA-only checks (graph replay,
torch.compile, bfloat16) skip without a GPU; scripts/gpu/static_path.py runs them on one."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.synthetic_target import (SyntheticSpec, parse_target, synthetic_config, synthetic_tensors,
                                                  tensor_shapes, weight_bytes)
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch.cuda_graphs import PassMode, PassRunner
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.llama_forward import LlamaForward
from triton_backend.engines.torch.static_decode import Bucket, BucketPolicy, StaticDecoder, device_dtype
from triton_backend.speculation.device_verify import greedy_accept, rejection_accept, sample_tokens, uniforms
from triton_backend.speculation.verify import verify_greedy

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none; scripts/gpu/static_path.py)")


def _pair(seed: int = 1, slots: int = 4, context: int = 64):
    """The slot engine (row kernels where they build) and a static decoder over the same weights."""
    model = tiny_llama(seed, vocab=64, hidden=64)
    engine = LlamaEngine(model, runtime=RuntimeConfig(max_batch_size=slots, max_seq_len=context))
    decoder = StaticDecoder(LlamaForward.from_module(engine.model), slots, context, BucketPolicy(context_quantum=16))
    return engine, decoder


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * float(a.abs().max()))


def test_static_passes_match_the_slot_engine_prefill_decode_verify_and_tree():
    engine, decoder = _pair()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    es, ds = [engine.allocate() for _ in prompts], [decoder.allocate() for _ in prompts]
    passes = [
        ([(0, p, None) for p in prompts], lambda p: len(p)),  # prefill, ragged
        ([(5, [7], None), (9, [1], None), (3, [60], None)], lambda p: 1),  # one decode step per row
        ([(6, [3, 4, 5, 6], None), (10, [2], None)], lambda p: len(p)),  # a verify row beside a decode row
        ([(10, [9, 8, 7, 6], [-1, -1, 0]), (11, [5, 4], None)], lambda p: len(p)),  # a tree row
    ]
    for rows, logits_of in passes:
        got_e = engine.forward([BatchRow(es[i], s, t, num_logits=logits_of(t), tree_parents=tp)
                                for i, (s, t, tp) in enumerate(rows)])
        got_d = decoder.run([BatchRow(ds[i], s, t, tree_parents=tp) for i, (s, t, tp) in enumerate(rows)])
        for e, d in zip(got_e, got_d):
            _close(e.logits, d)
    decoder.expand_kv = True  # keys/values repeated per query head: the same attention
    for e, d in zip(got_e, decoder.run([BatchRow(ds[i], s, t, tree_parents=tp) for i, (s, t, tp) in enumerate(rows)])):
        _close(e.logits, d)


def test_padding_never_touches_a_real_row():
    _, decoder = _pair()
    a, b = decoder.allocate(), decoder.allocate()
    prompt = list(range(1, 12))
    decoder.run([BatchRow(a, 0, prompt), BatchRow(b, 0, prompt)])
    alone = decoder.run([BatchRow(a, 11, [5])])[0]
    before = decoder.cache.keys[:, a].clone(), decoder.cache.values[:, a].clone()
    beyond = decoder.cache.keys[:, b, :, 12:].clone(), decoder.cache.values[:, b, :, 12:].clone()
    # the same step in a bigger bucket: 8 rows x 8 tokens, other rows padded, the row's own tokens too
    bucket, inputs = decoder.prepare([BatchRow(b, 11, [5])], Bucket(8, 8, 32))
    padded = decoder.step(inputs, bucket.context)[0, :1]
    torch.testing.assert_close(alone, padded, rtol=1e-5, atol=1e-4 * float(alone.abs().max()))
    after = decoder.cache.keys[:, a], decoder.cache.values[:, a]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # slot a untouched by b's padded pass
    torch.testing.assert_close(decoder.cache.keys[:, b, :, :12], decoder.cache.keys[:, a, :, :12])
    assert torch.equal(beyond[0], decoder.cache.keys[:, b, :, 12:])  # no padded token wrote past the row's end
    assert torch.equal(beyond[1], decoder.cache.values[:, b, :, 12:])


def test_bucket_policy_rounds_up_and_refuses_what_does_not_fit():
    policy = BucketPolicy()
    assert policy.bucket(3, 5, 300, 2048) == Bucket(4, 8, 512)
    assert policy.bucket(1, 1, 1, 100) == Bucket(1, 1, 100)
    assert policy.bucket(32, 16, 2048, 2048) == Bucket(32, 16, 2048)
    with pytest.raises(ValueError, match="largest bucket"):
        policy.bucket(33, 1, 10, 2048)
    with pytest.raises(ValueError, match="ascending"):
        BucketPolicy(rows=(4, 2))
    _, decoder = _pair()
    slot = decoder.allocate()
    with pytest.raises(ValueError, match="exceeds the slot"):
        decoder.prepare([BatchRow(slot, 60, [1] * 8)])
    with pytest.raises(ValueError, match="scratch"):
        decoder.prepare([BatchRow(decoder.scratch, 0, [1])])
    with pytest.raises(ValueError, match="do not fit"):
        decoder.prepare([BatchRow(slot, 0, [1, 2, 3])], Bucket(1, 2, 16))
    with pytest.raises(ValueError, match="do not fit"):
        decoder.prepare([BatchRow(slot, 0, [1])], Bucket(1, 1, 128))  # beyond the slot's 64 positions


def test_a_pass_traces_as_one_graph_without_host_sync():
    """fullgraph tracing fails on any host sync (``.item()``, ``int(t)``, ``.tolist()``) or Python
    branch on a tensor value: the static pass has none (torch's kernels: the CPU row kernel is an
    opaque extension call)."""
    model = tiny_llama(2, vocab=64, hidden=64, layers=1)
    decoder = StaticDecoder(LlamaForward.from_module(model), 2, 32, BucketPolicy(context_quantum=16))
    slot = decoder.allocate()
    bucket, inputs = decoder.prepare([BatchRow(slot, 0, [1, 2, 3])])
    eager = decoder.step(inputs, bucket.context)
    torch._dynamo.reset()
    traced = torch.compile(decoder.step, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(traced(inputs, bucket.context), eager)


def test_graph_modes_need_cuda_and_eager_runs_everywhere():
    _, decoder = _pair()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        PassRunner(decoder, PassMode.GRAPH)
    slot = decoder.allocate()
    bucket, inputs = decoder.prepare([BatchRow(slot, 0, [4, 5])])
    torch.testing.assert_close(PassRunner(decoder)(bucket, inputs), decoder.step(inputs, bucket.context))
    assert device_dtype("cpu") == torch.float32 and device_dtype("cuda") == torch.bfloat16
    assert device_dtype("cuda", "float16") == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        device_dtype("cuda", "int8")


# -- on-device verification ------------------------------------------------------------------------
def test_greedy_accept_equals_the_host_verifier_row_by_row():
    gen = torch.Generator().manual_seed(3)
    R, K, V = 64, 5, 7
    logits = torch.randint(0, 4, (R, K + 1, V), generator=gen).float()  # many ties: argmax takes the first
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(R, K, generator=gen) < 0.7, argmax[:, :K], torch.randint(0, V, (R, K), generator=gen))
    num = torch.randint(0, K + 1, (R,), generator=gen)
    out = greedy_accept(logits, drafts, num)
    assert out.shape == (R, 2) and out.dtype == torch.long
    for r in range(R):
        k = int(num[r])
        host = verify_greedy(logits[r, :k + 1], drafts[r, :k])
        assert (int(out[r, 0]), int(out[r, 1])) == (host.num_accepted, host.next_token)
    assert int(out[:, 0].sum()) > 0 and bool((out[:, 0] < num).any())  # both accepts and rejections seen


def _rejection_law(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int]) -> torch.Tensor:
    """Exact ``P(accepted = m, next = v)`` ``[K + 1, V]`` of the rejection rule for fixed drafts."""
    K, V = len(drafts), p.shape[1]
    law = torch.zeros(K + 1, V, dtype=torch.float64)
    reach = 1.0
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[i, d])
        accept = min(1.0, float(p[i, d]) / qd)
        residual = p[i].double().clone()
        if q is None:
            residual[d] = 0
        else:
            residual = (p[i].double() - q[i].double()).clamp(min=0)
        law[i] = reach * (1 - accept) * residual / residual.sum()
        reach *= accept
    law[K] = reach * p[K].double() / p[K].double().sum()
    return law


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_accept_draws_exactly_the_rejection_rule(with_q):
    """Many rows with different seeds, one batched call: for fixed drafts the empirical law of
    (accepted, next) matches the exact one (total variation bound), and with drafts drawn from
    ``q`` the first committed token is distributed as the target's own ``p`` (5 standard errors)."""
    gen = torch.Generator().manual_seed(4)
    K, V, N = 3, 6, 40_000
    p = torch.softmax(torch.randn(K + 1, V, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=gen) * 1.5, -1) if with_q else None
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) if with_q else int(p[i].argmax()) for i in range(K)]
    out = rejection_accept(p.expand(N, K + 1, V), torch.tensor([drafts]).expand(N, K),
                           None if q is None else q.expand(N, K, V), torch.full((N,), K),
                           torch.arange(N) * 7919 + 11, torch.full((N,), 40))
    empirical = torch.zeros(K + 1, V, dtype=torch.float64)
    empirical.index_put_((out[:, 0], out[:, 1]), torch.ones(N, dtype=torch.float64), accumulate=True)
    empirical /= N
    law = _rejection_law(p, q, drafts)
    assert 0.5 * float((empirical - law).abs().sum()) < 0.02
    # drafts drawn from q row by row (or a deterministic drafter's fixed ones): the first committed
    # token is distributed as the target's p
    sampled = (torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(K)], 1)
               if with_q else torch.tensor([drafts]).expand(N, K))
    out = rejection_accept(p.expand(N, K + 1, V), sampled, None if q is None else q.expand(N, K, V), torch.full((N,), K),
                           torch.arange(N) * 104729 + 5, torch.full((N,), 40))
    first = torch.where(out[:, 0] > 0, sampled[:, 0], out[:, 1])
    freq = torch.bincount(first, minlength=V).double() / N
    assert float((freq - p[0].double()).abs().max()) < 5 * (0.25 / N) ** 0.5


def test_seeded_rows_reproduce_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    R, K, V = 6, 4, 50
    p = torch.softmax(torch.randn(R, K + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(R, K, V, generator=gen), -1)
    drafts = torch.randint(0, V, (R, K), generator=gen)
    seeds, positions, num = torch.arange(R) + 100, torch.arange(R) * 3, torch.full((R,), K)
    batch = rejection_accept(p, drafts, q, num, seeds, positions)
    assert torch.equal(batch, rejection_accept(p, drafts, q, num, seeds, positions))
    for r in range(R):
        alone = rejection_accept(p[r:r + 1], drafts[r:r + 1], q[r:r + 1], num[r:r + 1], seeds[r:r + 1], positions[r:r + 1])
        assert torch.equal(alone[0], batch[r])
    other = rejection_accept(p, drafts, q, num, seeds + 1, positions)
    assert not torch.equal(other, batch)


def test_draft_equal_to_target_accepts_everything():
    gen = torch.Generator().manual_seed(6)
    R, K, V = 200, 4, 30
    p = torch.softmax(torch.randn(R, K + 1, V, generator=gen), -1)
    drafts = sample_tokens(p[:, :K].reshape(R * K, V), torch.arange(R * K), torch.zeros(R * K, dtype=torch.long)).view(R, K)
    out = rejection_accept(p, drafts, p[:, :K], torch.full((R,), K), torch.arange(R), torch.zeros(R, dtype=torch.long))
    assert bool((out[:, 0] == K).all())


def test_uniforms_are_uniform_and_depend_on_every_input():
    u = uniforms(torch.tensor([[3]]), 1, torch.arange(200_000)[None, :])
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u, bins=20, min=0, max=1)
    assert float((hist / 10_000 - 1).abs().max()) < 0.05
    base = uniforms(torch.tensor(3), 1, torch.tensor(9))
    assert all(float(x) != float(base) for x in (uniforms(torch.tensor(4), 1, torch.tensor(9)),
                                                 uniforms(torch.tensor(3), 2, torch.tensor(9)),
                                                 uniforms(torch.tensor(3), 1, torch.tensor(10))))


def test_verification_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="expected target"):
        greedy_accept(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        greedy_accept(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_accept(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 4),
                         torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


# -- synthetic targets ----------------------------------------------------------------------------
def test_synthetic_targets_take_the_shipped_shapes_with_seeded_weights():
    from transformers import LlamaForCausalLM

    with pytest.raises(ValueError, match="one of"):
        parse_target("synthetic:gpt-5")
    with pytest.raises(ValueError, match="not a synthetic"):
        parse_target("smollm2-135m")
    big = synthetic_config(parse_target("synthetic:llama-3.1-8b"))
    assert (big.hidden_size, big.num_hidden_layers, big.num_key_value_heads, big.vocab_size) == (4096, 32, 8, 128256)
    with torch.device("meta"):  # the names and shapes a Hugging Face model of the full 8B config has
        reference = {k: tuple(v.shape) for k, v in LlamaForCausalLM(big).state_dict().items()}
    assert tensor_shapes(big) == reference
    tiny = SyntheticSpec("smollm2-135m", seed=1, layers=1, vocab=128)
    config, tensors = synthetic_tensors(tiny, "cpu", torch.float32)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == tensor_shapes(config)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert all(torch.equal(t, u) for t, u in zip(tensors.values(), synthetic_tensors(tiny, "cpu", torch.float32)[1].values()))
    other = synthetic_tensors(SyntheticSpec("smollm2-135m", seed=2, layers=1, vocab=128), "cpu", torch.float32)[1]
    assert not torch.equal(tensors["model.norm.weight"], other["model.norm.weight"])
    assert weight_bytes(tensors) == 4 * sum(t.numel() for t in tensors.values())  # tied: the head reads the embedding
    assert "lm_head.weight" not in tensors and config.tie_word_embeddings  # tied, as SmolLM2
    decoder = StaticDecoder(LlamaForward(config, tensors, None), 1, 32, BucketPolicy(context_quantum=16))
    logits = decoder.run([BatchRow(decoder.allocate(), 0, [1, 2, 3])])[0]
    assert logits.shape == (3, 128) and bool(torch.isfinite(logits).all())


# -- CUDA only ------------------------------------------------------------------------------------
@CUDA
@pytest.mark.parametrize("mode", [PassMode.GRAPH, PassMode.COMPILE])
def test_graph_and_compiled_passes_equal_eager_on_cuda(mode):
    spec = SyntheticSpec("smollm2-135m", layers=2, vocab=512)
    config, tensors = synthetic_tensors(spec, "cuda", torch.bfloat16)
    decoder = StaticDecoder(LlamaForward(config, tensors, None), 4, 128, BucketPolicy(context_quantum=64))
    assert decoder.cache.keys.dtype == torch.bfloat16
    slots = [decoder.allocate() for _ in range(3)]
    decoder.run([BatchRow(s, 0, list(range(1, 20))) for s in slots])
    runner = PassRunner(decoder, mode)
    for step, n in itertools.product(range(3), (1, 4)):
        rows = [BatchRow(s, 19, list(range(5 + step, 5 + step + n))) for s in slots]
        bucket, inputs = decoder.prepare(rows)
        eager = decoder.step(inputs, bucket.context).clone()
        torch.testing.assert_close(runner(bucket, inputs), eager, rtol=2e-2, atol=2e-2)


@CUDA
def test_device_verification_draws_the_same_on_cuda_as_on_cpu():
    gen = torch.Generator().manual_seed(8)
    R, K, V = 16, 4, 300
    p = torch.softmax(torch.randn(R, K + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(R, K, V, generator=gen), -1)
    args = (p, torch.randint(0, V, (R, K), generator=gen), q, torch.randint(0, K + 1, (R,), generator=gen),
            torch.arange(R) * 31, torch.arange(R) + 5)
    on_cpu = rejection_accept(*args)
    assert torch.equal(rejection_accept(*(a.cuda() for a in args)).cpu(), on_cpu)
    assert torch.equal(greedy_accept(p.cuda(), args[1].cuda(), args[3].cuda()).cpu(), greedy_accept(p, args[1], args[3]))
