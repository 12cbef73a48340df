"""EAGLE in the serving loops: every draft the loop makes equals the drafter run from scratch
over the target's features of the committed text (no feature off by a position, no stale
drafter cache after a rejection, a partial accept or a pause), in the single-request loop
and the batch scheduler; the drafter's lazy catch-up after paused rounds gives the drafts
of a drafter fed every step; scripted pause/resume stays exact (greedy and sampling)."""

from __future__ import annotations

from itertools import chain, repeat
from typing import Any, Iterator, Sequence

import pytest
import torch

from conftest import tiny_engine
from test_eagle import REFERENCE_DRAFTER, _decoder, _exact_joint, _random_drafter, _sample_pairs
from test_scheduler import Collector
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.controller import SpeculationController
from triton_backend.speculation.drafters.eagle import EagleDrafter, EagleSession
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig

FIXED = SpeculationConfig(method="eagle", draft_length=DraftLengthConfig(num_draft_tokens=3),
                          fallback=FallbackConfig(enabled=False))


class ProposalLog:
    """Records what every EAGLE session proposed: (tokens it drafted after, the length of the
    drafter's first-choice chain in its proposal, that chain's tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rounds: list[tuple[list[int], int, list[int]]] = []
        propose, propose_trees = EagleSession.propose, EagleDrafter.propose_trees

        def spy(session: EagleSession, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> Any:
            proposal = propose(session, tokens, k, processor, generator)
            if proposal.tokens:
                self.rounds.append((list(tokens), k, list(proposal.tokens)))
            return proposal

        def spy_trees(drafter: EagleDrafter, sessions: Sequence[EagleSession], tokens: Sequence[Sequence[int]],
                      *args: Any) -> Any:
            proposals = propose_trees(drafter, sessions, tokens, *args)
            for toks, proposal in zip(tokens, proposals):
                chain = first_choices(proposal)
                if chain:
                    self.rounds.append((list(toks), len(chain), chain))
            return proposals

        monkeypatch.setattr(EagleSession, "propose", spy)
        monkeypatch.setattr(EagleDrafter, "propose_trees", spy_trees)


def first_choices(proposal: Any) -> list[int]:
    """The drafter's first-choice chain in a tree proposal (rank-0 children from the root)."""
    out, node = [], -1
    if not proposal.tokens:
        return out
    while True:
        nxt = next((i for i, (p, r) in enumerate(zip(proposal.parents, proposal.ranks)) if p == node and r == 0), None)
        if nxt is None:
            return out
        out.append(proposal.tokens[nxt])
        node = nxt


def scripted_draft_lengths(monkeypatch: pytest.MonkeyPatch, script: Sequence[int]) -> None:
    """Every controller's draft lengths follow ``script`` (then 2 for ever): rounds of 0 pause
    the drafter, the next positive one resumes it."""
    lengths: dict[int, Iterator[int]] = {}

    def next_length(controller: SpeculationController) -> int:
        return next(lengths.setdefault(id(controller), chain(script, repeat(2))))

    monkeypatch.setattr(SpeculationController, "next_draft_length", next_length)


def features(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """The target's last hidden states (after the final norm) of ``tokens`` in one full pass: [n, H]."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([list(tokens)])).last_hidden_state[0]


def from_scratch(drafter: EagleDrafter, hidden: torch.Tensor, tokens: Sequence[int], k: int) -> list[int]:
    """The greedy chain written out on the drafter's net alone (not the session code under
    test): pairs ``(feature_j, token_{j+1})`` for ``j = 0 .. len(tokens) - 2`` in one pass, the
    last output's argmax is draft 1, then one step per draft on the net's own feature."""
    n = len(tokens) - 1
    kv = drafter.new_cache(1, n + k)
    ids = torch.tensor([list(tokens[1:])])
    with torch.inference_mode():
        out = drafter.net(hidden[None, :n], drafter.embed[ids], torch.tensor([0]), kv)[:, -1]  # [1, H]
        drafts: list[int] = []
        for step in range(k):
            drafts.append(int(drafter._logits(out)[0].argmax()))
            out = drafter.net(out[:, None], drafter.embed[torch.tensor([[drafts[-1]]])], torch.tensor([n + step]), kv)[:, 0]
    return drafts


def assert_drafts_from_scratch(log: ProposalLog, drafter: EagleDrafter, model: Any,
                               outputs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    """Each logged round drafted what a fresh drafter drafts from the final text's features."""
    finals = [list(p) + list(out) for p, out in outputs]
    hidden = [features(model, f) for f in finals]
    rounds = list(log.rounds)  # the fresh sessions below are logged too: check only the loop's rounds
    assert rounds
    for tokens, k, drafts in rounds:
        owner = next(i for i, f in enumerate(finals) if f[: len(tokens)] == tokens)
        assert from_scratch(drafter, hidden[owner], tokens, k) == drafts, f"round after {len(tokens)} tokens"
    log.rounds.clear()


def _scheduled(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], params: SamplingParams,
               spec: SpeculationConfig, batch: int) -> list[list[int]]:
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=batch, policy="per_request"))
    try:
        clients = [Collector() for _ in prompts]
        for prompt, client in zip(prompts, clients):
            scheduler.submit(list(prompt), params, spec, client)
        return [client.tokens() for client in clients]
    finally:
        scheduler.shutdown()


PROMPTS = ([1, 2, 3], [5, 9, 9, 4, 1, 7, 2], [30, 3, 30, 3, 30])
PAUSES = [3, 0, 0, 2, 0, 0, 0, 0, 1, 3, 0, 3]  # drafts, a pause, a short resume, a long pause, ...


@pytest.mark.parametrize("script", [None, PAUSES], ids=["always", "paused"])
def test_tiny_loops_draft_from_scratch(monkeypatch, script):
    """Single loop and scheduler (2 rows): greedy output equals plain, and every draft equals the
    from-scratch drafter's, with and without scripted pauses."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=5, scale=0.15)
    decoder = _decoder(target, drafter)
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in PROMPTS]
    if script is not None:
        scripted_draft_lengths(monkeypatch, script)
    log = ProposalLog(monkeypatch)
    alone = [decoder.generate(p, params, FIXED) for p in PROMPTS]
    assert [r.token_ids for r in alone] == plain
    assert_drafts_from_scratch(log, drafter, target.model, list(zip(PROMPTS, plain)))
    if script is not None:
        assert all(0 < r.stats.speculative_rounds < r.stats.target_passes for r in alone)
    assert _scheduled(decoder, PROMPTS, params, FIXED, batch=2) == plain
    assert_drafts_from_scratch(log, drafter, target.model, list(zip(PROMPTS, plain)))


def test_lazy_catch_up_gives_the_drafts_of_a_drafter_fed_every_step():
    """A session that only collects features while paused and catches up in one pass proposes
    what a session fed (and drafting) at every step proposes: tokens, and the q rows of a
    sampling request."""
    target = tiny_engine(0)
    drafter = _random_drafter(target, seed=2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    hidden = features(target.model, tokens)
    eager, lazy = drafter.new_session(), drafter.new_session()
    hot = LogitsProcessor(temperature=0.9)
    resume_at = {4, 5, 11}  # then paused for the last 9 steps
    for n in range(2, len(tokens) + 1):
        for session in (eager, lazy):
            session.observe(n - 2, hidden[n - 2: n - 1])  # the feature of the token before the last
        last = n == len(tokens)  # the last step samples (below)
        fed = eager.propose(tokens[:n], 2, hot if last else LogitsProcessor(), torch.Generator().manual_seed(0))
        if n in resume_at:
            caught_up = lazy.propose(tokens[:n], 2, LogitsProcessor(), None)
            assert caught_up.tokens == fed.tokens, n
    # a sampling request after the long pause: the same q, hence the same samples from the same seed
    caught_up = lazy.propose(tokens, 2, hot, torch.Generator().manual_seed(0))
    assert caught_up.tokens == fed.tokens
    assert fed.probs is not None and torch.allclose(caught_up.probs, fed.probs, atol=1e-6)


def test_sampling_with_a_paused_round_matches_target_distribution(monkeypatch):
    """A plain round (drafter paused: features only collected) then a resumed drafting round:
    the next 2 tokens follow the target's exact joint distribution."""
    target = tiny_engine(10, vocab=8)
    decoder = _decoder(target, _random_drafter(target, scale=0.5))
    prompt = [1, 2, 1, 3, 1]
    params = dict(temperature=1.0)
    exact = _exact_joint(target, prompt, 2, LogitsProcessor(**params))
    scripted_draft_lengths(monkeypatch, [0, 1])
    n = 2000
    tv, _, drafted = _sample_pairs(decoder, prompt, params, FIXED, exact, n)
    assert drafted == n  # every request: one plain round, then one resumed round drafting 1 token
    assert tv < 0.07, tv


@pytest.mark.slow
def test_reference_drafter_serving_drafts_equal_offline(reference, reference_prompts, monkeypatch):
    """The committed drafter on the real target: in the single loop and the batch scheduler
    (3 requests in 2 slots), each round's drafts are those of the drafter run from scratch over
    the target's features of the final text (pos-1 acceptance in serving = the drafter's own
    teacher-forced accuracy at those positions), and outputs equal plain decoding."""
    engine, tokenizer = reference
    drafter = EagleDrafter.from_file(str(REFERENCE_DRAFTER), engine)
    decoder = SpeculativeDecoder(engine, tokenizer, drafters={SpeculationMode.EAGLE: drafter})
    prompts = [decoder.encode(p) for p in reference_prompts[:3]]
    params = SamplingParams(max_tokens=24)
    plain = [decoder.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    scripted_draft_lengths(monkeypatch, [3, 3, 0, 0, 0, 3, 1, 0, 3])
    log = ProposalLog(monkeypatch)
    alone = [decoder.generate(p, params, FIXED) for p in prompts]
    assert [r.token_ids for r in alone] == plain
    assert sum(r.stats.accepted_tokens for r in alone) > 0
    assert_drafts_from_scratch(log, drafter, engine.model, list(zip(prompts, plain)))
    assert _scheduled(decoder, prompts, params, FIXED, batch=2) == plain
    assert_drafts_from_scratch(log, drafter, engine.model, list(zip(prompts, plain)))
