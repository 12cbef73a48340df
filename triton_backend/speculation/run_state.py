"""One request's generation on the torch runtime, whatever runs its target passes (the
single-request loop of :mod:`triton_backend.speculation.loop`, or a row of the batch scheduler):
its sampler and seeded RNG, drafter session, speculation controller and committed output
(:class:`~triton_backend.speculation.commit.Commit`), and the steps every round shares: the draft
length, chain verification, log probabilities and recording the round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from triton_backend.speculation.commit import Commit
from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.speculation.controller import controller_for
from triton_backend.speculation.drafters.base import DraftProposal, Drafter
from triton_backend.engines.base import CausalLMEngine
from triton_backend.core.eos import min_tokens_end_ids
from triton_backend.core.errors import InvalidRequestError
from triton_backend.speculation.rounds import RoundOutcome, cap_draft_length, record_round
from triton_backend.core.sampling import LogitsProcessor, RowHistory, make_generator
from triton_backend.speculation.verify import verify_greedy, verify_rejection

if TYPE_CHECKING:
    from triton_backend.speculation.drafters.client import ClientDraft


@dataclass(frozen=True)
class Accepted:
    """What one verification keeps: ``block`` (accepted drafts + the target's token),
    ``drafted`` positions (a tree: its depth), ``accepted`` of them, and ``path``: the
    proposal's nodes kept, root to leaf (a chain: its first ``accepted`` tokens)."""

    block: list[int]
    drafted: int
    accepted: int
    path: list[int]

    def outcome(self, draft_s: float, verify_s: float) -> RoundOutcome:
        return RoundOutcome(self.block, self.drafted, self.accepted, draft_s, verify_s)


class RunState:
    """One request's generation state (see the module docstring). ``drafter_session=False``:
    the caller drafts for this run itself (a batched draft model)."""

    def __init__(self, target: CausalLMEngine, tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode, drafter: Drafter | None, *,
                 started: float | None = None, drafter_session: bool = True) -> None:
        self.params = params
        self.processor = LogitsProcessor.from_params(
            params, prompt_len=len(prompt_ids), end_ids=min_tokens_end_ids(params, target.eos_token_ids),
            bad_words=_tokenize_words(tokenizer, params.bad_words))
        self.rng = make_generator(params.seed)
        self.drafter_session = drafter.new_session() if drafter is not None and drafter_session else None
        self.controller = controller_for(spec, mode, drafter, self.drafter_session)
        self.use_drafter = drafter is not None
        self.commit = Commit(prompt_ids, params, eos_token_ids=target.eos_token_ids, tokenizer=tokenizer,
                             max_context=target.max_context,
                             method=mode.value if drafter else SpeculationMode.OFF.value, started=started)

    def attach_client_draft(self, draft: "ClientDraft") -> None:
        """Verify a client's drafts in the first round (a run made without a drafter: its
        controller decides nothing here); :mod:`triton_backend.speculation.drafters.client`."""
        from triton_backend.speculation.drafters.client import METHOD, ClientDraftSession

        self.drafter_session = ClientDraftSession(draft, self.commit.prompt_len)
        self.use_drafter = True
        self.commit.stats.method = METHOD

    @property
    def client_drafting(self) -> bool:
        """Whether this run verifies a client's drafts (their length is the client's, not planned)."""
        from triton_backend.speculation.drafters.client import ClientDraftSession

        return isinstance(self.drafter_session, ClientDraftSession)

    @property
    def tokens(self) -> list[int]:
        """The prompt and the committed tokens (read only)."""
        return self.commit.tokens

    def draft_length(self) -> int:
        """This round's draft length from the controller (0 without a drafter)."""
        if not self.use_drafter:
            return 0
        if self.client_drafting:
            return self.cap_draft_length(self.drafter_session.pending)
        return self.cap_draft_length(self.controller.next_draft_length())

    def cap_draft_length(self, k: int) -> int:
        """``k`` cut to what may still be generated (:func:`~triton_backend.speculation.rounds.cap_draft_length`)."""
        return cap_draft_length(self.commit, self.controller, k)

    def verify_chain(self, logits: torch.Tensor, proposal: DraftProposal) -> Accepted:
        """Verify a chain proposal against the target's ``[len(proposal) + 1, vocab]`` logits."""
        drafts = torch.tensor(proposal.tokens, dtype=torch.long)
        histories = self.processor.chain_rows(self.tokens, proposal.tokens)  # row j: committed + drafts[:j]
        if self.processor.greedy:
            result = verify_greedy(self.processor.scores(logits, histories), drafts)
        else:
            result = verify_rejection(self.processor.probs(logits, histories), drafts, proposal.probs, self.rng)
        m = result.num_accepted
        block = proposal.tokens[:m] + [result.next_token]
        self.note_log_probs(logits[: m + 1], None if histories is None else histories[: m + 1], block)
        return Accepted(block, len(proposal), m, list(range(m)))

    def note_log_probs(self, logits: torch.Tensor, histories: Sequence[RowHistory] | None, block: list[int]) -> None:
        """Record the log probabilities of a verified block (``logits`` [len(block), vocab]:
        the target's rows that chose it), when the request asks for them."""
        if self.commit.log_probs is not None:
            self.commit.note_log_probs(self.processor.log_probs(logits, histories, block))

    def record(self, outcome: RoundOutcome) -> None:
        record_round(self.commit, self.controller, outcome)


def _tokenize_words(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Bad words as token sequences (as the preprocessing model encodes word lists)."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer; send bad_words_list token ids instead")
    return [list(tokenizer.encode(w, add_special_tokens=False)) for w in words]


__all__ = ["Accepted", "RunState"]
