"""Drafting with Medusa heads: a token tree from the target's own last hidden state.

After each verification round the tree round hands the session the target's hidden state
at the last accepted position (:meth:`MedusaSession.observe`): the target's LM head turned
it into the token just committed, and head ``i`` ranks candidates for ``i + 1`` positions
after that token. The proposal is the tree of ``medusa_choices`` cut to depth ``k``: node
``(r_0, ..., r_d)`` holds head ``d``'s rank-``r_d`` candidate. ``DraftProposal.parents``
carries the tree; ``probs`` is None (deterministic proposals, ``q`` one-hot).
"""

from __future__ import annotations

from typing import Sequence

import torch

from triton_backend.speculation.drafters.protocol import DraftProposal
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.core.errors import ModelLoadError
from triton_backend.speculation.drafters.medusa_model import MedusaCheckpoint, load_medusa
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.core.tree import Choices, choices_to_parents, normalise_choices

EMPTY_TREE = DraftProposal(tokens=[], parents=[])


class MedusaSession:
    def __init__(self, drafter: "MedusaDrafter") -> None:
        self._drafter = drafter
        self._hidden: torch.Tensor | None = None  # [H]
        self._length = -1  # committed length the hidden state is valid for

    def observe(self, committed_length: int, hidden: torch.Tensor) -> None:
        """The target's last hidden state [H] that produced the token at ``committed_length - 1``."""
        self._hidden = hidden
        self._length = committed_length

    def propose(self, tokens: Sequence[int], k: int, processor: LogitsProcessor,
                generator: torch.Generator | None) -> DraftProposal:
        if k <= 0 or self._hidden is None or self._length != len(tokens):
            return EMPTY_TREE
        return self._drafter.tree(self._hidden, k)

    def release(self) -> None:
        self._hidden = None


class MedusaDrafter:
    """Medusa heads on a torch target. Tree verification runs in the target's session."""

    name = "medusa"

    def __init__(self, checkpoint: MedusaCheckpoint, target: TorchEngine, choices: Choices | None = None) -> None:
        info = checkpoint.info
        config = target.model.config
        if info.hidden_size != int(config.hidden_size) or info.vocab_size != target.vocab_size:
            raise ModelLoadError(f"Medusa heads (hidden {info.hidden_size}, vocab {info.vocab_size}) do not fit the "
                                 f"target (hidden {config.hidden_size}, vocab {target.vocab_size})")
        self.choices = normalise_choices(choices if choices is not None else info.medusa_choices)
        deepest = max(len(c) for c in self.choices)
        if deepest > info.num_heads:
            raise ModelLoadError(f"medusa_choices go {deepest} levels deep but the file has {info.num_heads} heads")
        self.parents, self.slots = choices_to_parents(self.choices)
        self.depths = [head + 1 for head, _ in self.slots]
        self.top = [1 + max((rank for head, rank in self.slots if head == h), default=0) for h in range(info.num_heads)]
        dtype, device = target.model.dtype, target.device
        self.heads = checkpoint.heads.to(device=device, dtype=dtype).eval()
        self.vocab = checkpoint.candidate_vocab.to(device) if checkpoint.candidate_vocab is not None else None
        weight = target.model.get_output_embeddings().weight.detach()
        self.shared_weight = weight[self.vocab] if (info.shared_lm_head and self.vocab is not None) else weight
        head_cost = info.num_layers * info.hidden_size ** 2 + self.shared_weight.shape[0] * info.hidden_size
        self.relative_cost = info.num_heads * head_cost / max(1, target.num_parameters())
        # the shared LM head on the target's row kernel (its threads), all heads in one product
        kernel = getattr(getattr(target, "forward_impl", None), "kernel", None)
        self._project = None
        if info.shared_lm_head and kernel is not None and dtype == torch.float32 and device.type == "cpu":
            self._project = kernel.bind(self.shared_weight.float().contiguous())

    @classmethod
    def from_file(cls, path: str, target: TorchEngine, choices: Choices | None = None) -> "MedusaDrafter":
        return cls(load_medusa(path), target, choices)

    def tree(self, hidden: torch.Tensor, depth: int) -> DraftProposal:
        """The tree of choices up to ``depth`` levels, filled with each head's ranked candidates."""
        count = sum(1 for d in self.depths if d <= depth)  # choices are sorted by depth: a prefix
        used = max(self.depths[:count], default=0)
        with torch.inference_mode():
            logits = self.heads.logits(hidden, self.shared_weight, used, self._project)  # [used heads, V']
            ranked = [logits[h].topk(self.top[h]).indices for h in range(used)]
        if self.vocab is not None:
            ranked = [self.vocab[r] for r in ranked]
        tokens = [int(ranked[head][rank]) for head, rank in self.slots[:count]]
        return DraftProposal(tokens=tokens, parents=list(self.parents[:count]))

    def new_session(self) -> MedusaSession:
        return MedusaSession(self)
