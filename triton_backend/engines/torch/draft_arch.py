"""A Llama draft with a reduced-vocabulary LM head, loadable as a Hugging Face model.

A draft's LM head over the whole vocabulary can cost more than its layers (for
SmolLM2-135M's 49152 x 576 head, about a fifth of the target). This draft ranks only
``draft_vocab_size`` tokens (``lm_head.token_ids``, usually the target's most frequent
outputs) and emits full-vocabulary logits with ``-inf`` everywhere else: its ``q`` is zero
outside the subset, so the rejection rule stays exact, and greedy drafting takes the argmax
over the subset. Input embeddings cover the whole vocabulary.

Importing this module registers ``model_type = "specbuild_subset_llama"`` with the
``transformers`` Auto classes, so ``triton_backend.engines.torch.model_loading`` loads such a folder like
any other model directory.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "specbuild_subset_llama"


class SubsetLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __init__(self, draft_vocab_size: int = 8192, **kwargs: object) -> None:
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
        self.draft_vocab_size = int(draft_vocab_size)


class SubsetLMHead(nn.Module):
    """``[..., H] -> [..., vocab]`` logits, finite only on ``token_ids``."""

    def __init__(self, hidden: int, vocab: int, draft_vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(draft_vocab, hidden))
        self.register_buffer("token_ids", torch.arange(draft_vocab, dtype=torch.long))
        self.full_vocab_size = vocab  # the logits' width (TorchEngine reads it)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., draft_vocab]
        return hidden @ self.weight.t()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.subset_logits(hidden)
        out = sub.new_full((*sub.shape[:-1], self.full_vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, sub)


class SubsetLlamaForCausalLM(LlamaForCausalLM):
    config_class = SubsetLlamaConfig
    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: SubsetLlamaConfig) -> None:
        super().__init__(config)
        self.lm_head = SubsetLMHead(config.hidden_size, config.vocab_size, config.draft_vocab_size)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, SubsetLMHead):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
            return
        super()._init_weights(module)


AutoConfig.register(MODEL_TYPE, SubsetLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(SubsetLlamaConfig, SubsetLlamaForCausalLM, exist_ok=True)
