"""The generation loop every runtime shares: rounds in, chunks out.

A round strategy plays rounds; each :class:`RoundOutcome` says what the round verified (the
block to commit) and what it cost (drafted and accepted positions, draft and verify time).
:func:`record_round` is the one place a round is recorded (statistics and the speculation
controller); :func:`generation_loop` records each round, commits its block
(:class:`~triton_backend.speculation.commit.Commit`) and yields the chunks until the request ends.

Strategies: chain, tree (Medusa) and EAGLE rounds on the torch runtime
(:mod:`triton_backend.speculation.torch_decoder`, :mod:`triton_backend.speculation.tree_round`,
:mod:`triton_backend.speculation.eagle_round`); engine-verified rounds on the TensorRT-LLM runtime
(:mod:`triton_backend.speculation.trtllm_loop`). The batch scheduler records and commits its rows
through the same two calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

from triton_backend.speculation.commit import Commit, GenerationChunk
from triton_backend.speculation.controller import SpeculationController
from triton_backend.speculation.tree_plan import TreeRecord


@dataclass(frozen=True)
class RoundOutcome:
    """One round: ``block`` (accepted drafts + the target's own token) to commit; ``drafted``
    positions proposed (a tree: its depth) and ``accepted`` of them; ``passes``: target passes
    the outcome stands for (a streamed response of ``n`` plain tokens: ``n``);
    ``controller``: whether the controller decided this round and learns from it."""

    block: list[int]
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    passes: int = 1
    controller: bool = True
    tree: TreeRecord | None = None  # an EAGLE tree round: what the controller learns from it


class Round(Protocol):
    """A strategy that plays one round at a time (the torch runtime's chain, tree and EAGLE rounds)."""

    def __call__(self) -> RoundOutcome: ...


class RoundStrategy(Protocol):
    """A strategy that plays a request's rounds until it is told to stop (the loop stops
    asking once the request ends)."""

    def rounds(self) -> Iterator[RoundOutcome]: ...


def repeat(round_: Round) -> Iterator[RoundOutcome]:
    """Play ``round_`` for as long as the loop asks."""
    while True:
        yield round_()


def cap_draft_length(commit: Commit, controller: SpeculationController, k: int) -> int:
    """``k`` cut so the round never drafts past what may still be generated (it adds
    ``k + 1`` tokens at most); records a fallback the controller has decided."""
    if controller.fallen_back:  # counts when the adaptive controller decided it (break-even)
        commit.stats.record_fallback(len(commit.generated))
    return max(0, min(k, commit.remaining - 1))


def record_round(commit: Commit, controller: SpeculationController, outcome: RoundOutcome) -> None:
    """Statistics and (when it decided the round) the controller, before the block is
    committed; a fallback is recorded where it triggers."""
    stats = commit.stats
    stats.draft_time_s += outcome.draft_s
    stats.verify_time_s += outcome.verify_s
    for _ in range(outcome.passes):
        stats.record_round(outcome.drafted, outcome.accepted)
    if outcome.controller and controller.record(outcome.drafted, outcome.accepted, outcome.tree):
        stats.record_fallback(len(commit.generated) + outcome.accepted + 1)


def generation_loop(commit: Commit, controller: SpeculationController,
                    outcomes: Iterator[RoundOutcome]) -> Iterator[GenerationChunk]:
    """Record and commit each round; yield what it adds. The last chunk is finished and
    carries the stats; returns without one only when ``outcomes`` runs out. An outcome
    without tokens (a streamed response that carried none) only adds its time."""
    for outcome in outcomes:
        record_round(commit, controller, outcome)
        if not outcome.block:
            continue
        chunk = commit.commit(outcome.block)
        if chunk is not None:
            yield chunk
            if chunk.finished:
                return


__all__ = ["Round", "RoundOutcome", "RoundStrategy", "cap_draft_length", "generation_loop", "record_round", "repeat"]
