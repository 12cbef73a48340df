"""One request's generation on the torch runtime, whatever runs its target passes (the
single-request loop of :mod:`triton_backend.speculation.torch_decoder`, or a row of the batch scheduler):
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
from triton_backend.speculation.cost_model import PassCostModel, current_cost_model
from triton_backend.speculation.drafters.protocol import EMPTY_PROPOSAL, DraftProposal, Drafter
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter, DraftModelSession
from triton_backend.speculation.drafters.ngram import NgramSession
from triton_backend.engines.base import CausalLMEngine
from triton_backend.core.eos import min_tokens_end_ids
from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.grammar import GuideMatcher
from triton_backend.core.guide_cache import GUIDES, CompiledGuide
from triton_backend.speculation.drafters.eagle_tree import TreeShape
from triton_backend.speculation.merged_tree import merge_lookup
from triton_backend.speculation.round_plan import DraftSource
from triton_backend.speculation.rounds import RoundOutcome, cap_draft_length, record_round
from triton_backend.speculation.tree_plan import TreeRecord
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
    tree: TreeRecord | None = None  # an EAGLE tree round: what the controller learns from it

    def outcome(self, draft_s: float, verify_s: float, *, forced: bool = False) -> RoundOutcome:
        """The round's outcome; ``forced``: its draft was the grammar's forced tokens, not the
        controller's decision (the controller neither decided nor learns from it)."""
        return RoundOutcome(self.block, self.drafted, self.accepted, draft_s, verify_s, controller=not forced,
                            tree=self.tree)


class RunState:
    """One request's generation state (see the module docstring). ``drafter_session=False``:
    the caller drafts for this run itself (a batched draft model)."""

    def __init__(self, target: CausalLMEngine, tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
                 spec: SpeculationConfig, mode: SpeculationMode, drafter: Drafter | None, *,
                 started: float | None = None, drafter_session: bool = True, ngram: Drafter | None = None,
                 compiled_guide: CompiledGuide | None = None, cost_model: PassCostModel | None = None) -> None:
        self.params = params
        # the pass costs every round of this request is decided from (round_plan.py): given, else
        # what was measured for its target at load, else the default table; taken once, here
        self.cost_model = cost_model or current_cost_model(target)
        self.guide: GuideMatcher | None = None  # structured output: the grammar state of the committed tokens
        if params.guide is not None:  # compiled before (the batch scheduler), else here within the time budget
            compiled = compiled_guide or GUIDES.compile(params.guide, tokenizer, vocab=target.vocab_size,
                                                        eos_token_ids=sorted(target.eos_token_ids))
            self.guide = compiled.matcher(len(prompt_ids))
        self.forced_limit = spec.draft_length.forced_tokens if self.guide is not None else 0
        self.processor = LogitsProcessor.from_params(
            params, prompt_len=len(prompt_ids), end_ids=min_tokens_end_ids(params, target.eos_token_ids),
            bad_words=_tokenize_words(tokenizer, params.bad_words), guide=self.guide)
        self.rng = make_generator(params.seed)
        # a draft over the target's own model taking its context from the target's cache
        self.target_context = drafter.context if isinstance(drafter, DraftModelDrafter) else None
        self.drafter_session = drafter.new_session() if drafter is not None and drafter_session else None
        # greedy and unseeded requests start from the drafter's acceptance measured over the
        # deployment's requests; a seeded sampling request's draft lengths depend on it alone
        learned = self.processor.greedy or params.seed is None
        self.controller = controller_for(spec, mode, drafter, self.drafter_session, self.cost_model,
                                         learned_prior=learned, reproducible=not learned)
        self.use_drafter = drafter is not None
        # auto: the n-gram match beside the model drafter, chosen per round (auto_source.py)
        self.auto = None
        ngram_session = ngram.new_session() if ngram is not None and drafter is not None else self.drafter_session
        if isinstance(ngram_session, NgramSession) and not learned:
            ngram_session.private()  # seeded sampling: drafts from its own text alone, not the cross-request index
        if ngram is not None and drafter is not None and isinstance(ngram_session, NgramSession):
            self.auto = self.controller.attach_auto(ngram_session)
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

    @property
    def context_pending(self) -> bool:
        """The drafter takes the prompt's keys and values from the target's cache, which has not
        run the prompt yet: this round is plain (its pass is the prompt's prefill)."""
        return self.target_context is not None and len(self.tokens) == self.commit.prompt_len

    def take_context(self, target: Any) -> None:
        """Before drafting alone: the drafter session copies what it takes of the committed
        tokens' keys and values from ``target`` (the run's target session). Not in an ``auto``
        round that lookup drafts: the draft model's cache stays where it was (no upkeep) and its
        next round copies every position committed since, in one call."""
        if (self.target_context is not None and self.model_drafts
                and isinstance(self.drafter_session, DraftModelSession)):
            self.drafter_session.take_context(target, self.tokens, self.commit.prompt_len)

    def draft_length(self) -> int:
        """This round's draft length (0 without a drafter): the client's drafts, else ``auto``'s
        source or the controller, each decided in :mod:`~triton_backend.speculation.round_plan`;
        cut to what may still be generated."""
        if not self.use_drafter:
            return 0
        if self.client_drafting:
            return self.cap_draft_length(self.drafter_session.pending)
        if self.auto is None:
            return self.cap_draft_length(self.controller.next_draft_length())
        k = self.cap_draft_length(self.auto.draft_length(self.tokens))
        self.auto.planned(k)
        return k

    def propose(self, k: int, *, tree: bool = False) -> DraftProposal:
        """This round's proposal of ``k`` tokens from its drafter session (under ``auto``: from the
        source chosen for the round; n-gram drafts are chains, with explicit parents for a tree
        round when ``tree``)."""
        if k <= 0:
            return EMPTY_PROPOSAL
        if self.auto is not None:
            proposal = self.auto.propose(self.tokens, k, self.processor, self.rng, tree)
            if proposal is not None:
                return proposal if tree else self.constrain(proposal)
        if self.drafter_session is None:
            return EMPTY_PROPOSAL
        return self.drafter_session.propose(self.tokens, k, self.processor, self.rng)

    def eagle_shape(self, k: int) -> TreeShape | None:
        """The tree an EAGLE drafter drafts this round of ``k`` (a chain: one child per node; the
        gain rule sizes trees), counted as a model round under ``auto``; None when nothing is
        drafted or ``auto``'s n-gram lookup drafts the round (then :meth:`propose`)."""
        if k <= 0 or not self.model_drafts or self.client_drafting:
            return None
        if self.auto is not None:
            self.auto.model_round()
            k = self.auto.model_nodes(k)  # a merged round: the drafter's share of its nodes
        return self.controller.tree_shape(k) or TreeShape.chain(k)

    def with_lookup(self, proposal: DraftProposal) -> DraftProposal:
        """The drafter's tree with ``auto``'s n-gram match merged in as one branch, when the round
        is a merged one (:mod:`~triton_backend.speculation.merged_tree`); else ``proposal``."""
        if self.auto is None:
            return proposal
        chain = self.auto.lookup_chain(self.tokens, self.processor, self.rng)
        return merge_lookup(proposal, chain) if chain else proposal

    @property
    def model_drafts(self) -> bool:
        """Whether this round's proposal comes from the model drafter (not ``auto``'s n-gram lookup
        alone; a merged round's tree is the drafter's, the match merged in after)."""
        return self.auto is None or self.auto.source in (DraftSource.MODEL, DraftSource.MERGED)

    def cap_draft_length(self, k: int) -> int:
        """``k`` cut to what may still be generated (:func:`~triton_backend.speculation.rounds.cap_draft_length`)."""
        return cap_draft_length(self.commit, self.controller, k)

    def forced_draft(self) -> DraftProposal:
        """The tokens the request's grammar forces next (a free draft, verified like any other;
        empty without a guide), cut so the round never passes what may still be generated."""
        if self.forced_limit <= 0 or self.guide is None:
            return EMPTY_PROPOSAL
        self.guide.sync(self.tokens)
        tokens = self.guide.forced(min(self.forced_limit, self.commit.remaining - 1))
        return DraftProposal(tokens) if tokens else EMPTY_PROPOSAL

    def constrain(self, proposal: DraftProposal) -> DraftProposal:
        """A chain proposal cut before its first draft the grammar refuses (the target would
        reject it for certain: its probability is 0 there); unchanged without a guide."""
        if self.guide is None or not proposal.tokens or proposal.parents is not None:
            return proposal
        self.guide.sync(self.tokens)
        n = self.guide.valid_prefix(proposal.tokens)
        if n == len(proposal):
            return proposal
        return DraftProposal(proposal.tokens[:n], None if proposal.probs is None else proposal.probs[:n])

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
            self.commit.note_log_probs(*self.processor.log_probs_and_top(logits, histories, block,
                                                                          self.commit.params.top_log_probs))

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
