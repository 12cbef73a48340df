"""Drafters propose tokens for the target to verify."""

from triton_backend.drafters.base import DraftProposal, Drafter, DrafterSession
from triton_backend.drafters.draft_model import DraftModelDrafter, check_vocab_compatible
from triton_backend.drafters.ngram import NgramDrafter, find_ngram_continuation

__all__ = [
    "DraftModelDrafter",
    "DraftProposal",
    "Drafter",
    "DrafterSession",
    "NgramDrafter",
    "check_vocab_compatible",
    "find_ngram_continuation",
]
