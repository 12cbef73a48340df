"""The load-adaptive prefill budget (triton_backend/batching/prefill_budget.py): beside running
decode rows a long prompt is prefilled in chunks sized so the pass costs at most
``prefill_slowdown`` times the decode-only pass (the target's pass-cost model); alone it goes in
``prefill_chunk_tokens`` chunks. Outputs identical with and without it, batched, greedy and
seeded, on a tiny random Llama."""

from __future__ import annotations

import pytest

from test_scheduler import Collector, submit_all, tiny_decoder_with_every_drafter
from triton_backend.batching.prefill_budget import PrefillBudget
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import DraftLengthConfig, SamplingParams, SpeculationConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.speculation.cost_model import PassCostModel

# a target whose passes cost more with every row and every token beyond the first few
COSTS = PassCostModel({1: {1: 1.0, 4: 1.2, 16: 3.0, 64: 12.0}, 4: {1: 1.5, 8: 2.0, 32: 4.0}, 8: {1: 2.0, 4: 4.5}})


def test_the_budget_keeps_the_pass_within_the_slowdown_and_is_whole_alone() -> None:
    budget = PrefillBudget(chunk_tokens=512, slowdown=1.3)
    assert budget.tokens(0, COSTS) == 512  # alone: large chunks, as without the budget
    for rows in (1, 2, 3, 4, 6, 8):
        n = budget.tokens(rows, COSTS)
        base = COSTS.pass_cost([1] * rows)
        assert 1 <= n < 512
        assert n == 1 or COSTS.pass_cost([1] * rows + [n]) <= 1.3 * base  # within the factor
        assert COSTS.pass_cost([1] * rows + [n + 1]) > 1.3 * base  # and the most that is
    looser = PrefillBudget(chunk_tokens=512, slowdown=2.0)
    assert all(looser.tokens(r, COSTS) >= budget.tokens(r, COSTS) for r in range(1, 9))
    assert PrefillBudget(chunk_tokens=6, slowdown=50.0).tokens(4, COSTS) == 6  # never above the chunk
    assert PrefillBudget(chunk_tokens=512, slowdown=None).tokens(4, COSTS) == 512  # off


@pytest.mark.parametrize("bad", [1.0, 0.5, -2, float("nan"), float("inf"), True, "1.3"])
def test_a_bad_slowdown_is_refused(bad) -> None:
    with pytest.raises(InvalidRequestError, match="prefill_slowdown"):
        SchedulerConfig(prefill_slowdown=bad)


def _long_prompt_beside_streams(decoder, config: SchedulerConfig, requests, long_request):
    """Start the streams, then the long prompt; every output, and the prompt tokens of each pass
    that carried a prefill chunk with the number of decode rows beside it."""
    scheduler = BatchScheduler(decoder, config, cost_model=COSTS)
    forward, passes = scheduler.target.forward, []

    def recording(rows):
        # rows of the pass: prefill chunks (several tokens, logits unused) beside one-token decode rows
        passes.append([len(r.tokens) for r in rows])
        return forward(rows)

    scheduler.target.forward = recording  # the engine itself (the slot engine batches): put back below
    try:
        clients = submit_all(scheduler, requests)
        for c in clients:  # every stream decoding before the long prompt arrives
            while len(c.chunks) < 2 and not c.done.is_set():
                c.done.wait(0.001)
        long = Collector()
        scheduler.submit(*long_request, long)
        return [c.tokens() for c in clients], long.tokens(), passes
    finally:
        scheduler.shutdown()
        del scheduler.target.forward


def test_outputs_are_identical_with_and_without_the_budget_and_the_prompt_is_chunked() -> None:
    decoder = tiny_decoder_with_every_drafter()
    spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=3))
    requests = []
    for i, prompt in enumerate(([1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 8, 9])):
        sampling = i == 1
        params = SamplingParams(max_tokens=100, temperature=0.9 if sampling else 0.0, seed=7 if sampling else None,
                                ignore_eos=True)
        requests.append((prompt, params, spec))
    long_prompt = [(3 * i + 1) % 31 + 1 for i in range(90)]
    long_request = (long_prompt, SamplingParams(max_tokens=6, ignore_eos=True), SpeculationConfig(method="off"))
    expected = [decoder.generate(p, params, s).token_ids for p, params, s in requests + [long_request]]

    outputs = {}
    for slowdown in (1.3, None):
        config = SchedulerConfig(max_batch_size=4, prefill_slowdown=slowdown)
        streams, long, passes = _long_prompt_beside_streams(decoder, config, requests, long_request)
        assert streams + [long] == expected  # each request as alone, with and without the budget
        outputs[slowdown] = passes
    # with the budget, the prompt came in chunks no larger than the pass-cost model allows beside the
    # decode rows; without it, in one pass
    adaptive = outputs[1.3]
    budget = PrefillBudget(512, 1.3)
    beside = [p for p in adaptive if max(p) > 4 + 1 and len(p) > 1]  # passes carrying prompt tokens beside decode rows
    assert len(beside) >= 5
    for p in beside:
        prompt_tokens = max(p)  # the chunk row (decode/verify rows carry at most 1 + 3 drafts here)
        assert prompt_tokens <= budget.tokens(len(p) - 1, COSTS)
    assert any(max(p) >= len(long_prompt) - 1 for p in outputs[None])
