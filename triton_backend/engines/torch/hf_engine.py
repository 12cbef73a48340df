"""The torch runtime: a Hugging Face causal LM on CPU or CUDA with rollback-by-crop KV sessions."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.torch.packed_linear import pack_linear_layers
from triton_backend.core.eos import eos_token_ids as model_eos
from triton_backend.core.errors import ContextLengthError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def configure_threads(num_threads: int) -> None:
    """Set torch's intra-op threads (process-wide). One thread is the measured-fastest default here."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
        logger.info("torch intra-op threads set to %d", num_threads)


class TorchSession:
    """One sequence's KV cache. ``cached`` mirrors the tokens the cache holds."""

    def __init__(self, engine: "TorchEngine") -> None:
        self._engine = engine
        self._cache = DynamicCache(config=engine.model.config)
        self._cached: list[int] = []
        self._tree: list[int] = []  # tree nodes in the cache after tree_hidden, until keep_tree_path
        self.forward_calls = 0
        self.pass_time_s = 0.0  # in the model's passes and LM-head products

    @property
    def cached_length(self) -> int:
        return len(self._cached)

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (bookkeeping: a crop, no recompute)."""
        if length >= len(self._cached):
            return
        if length == 0:
            self.release()  # DynamicCache.crop(0) keeps everything
            return
        self._cache.crop(length)
        del self._cached[length:]

    def logits(self, tokens: Sequence[int], num_last: int) -> torch.Tensor:
        n = len(tokens)
        if not 1 <= num_last <= n:
            raise ValueError(f"num_last must be in [1, {n}], got {num_last}")
        if n > self._engine.max_context:
            raise ContextLengthError(f"sequence of {n} tokens exceeds the model context of {self._engine.max_context}")
        self.keep_tree_path([])
        keep = min(common_prefix_length(self._cached, tokens), n - num_last)
        self.rollback(keep)
        new = list(tokens[keep:])
        input_ids = torch.tensor([new], dtype=torch.long, device=self._engine.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self._engine.model(
                input_ids=input_ids,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=num_last,
            )
        self.pass_time_s += time.perf_counter() - started
        self._cached.extend(new)
        self.forward_calls += 1
        return out.logits[0, -num_last:].float()

    def tree_hidden(self, tokens: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """One pass over the committed ``tokens`` and a draft tree (tree attention, see
        :mod:`triton_backend.core.tree`): last hidden states ``[1 + n, hidden]`` for the last
        committed token then each node (:meth:`head_logits` turns rows into logits, so a
        verifier pays the LM head only for the rows it visits). The nodes stay in the cache
        until :meth:`keep_tree_path` keeps the accepted ones."""
        from triton_backend.engines.torch.tree_attention import tree_attention_inputs

        n = len(tokens) + len(tree_tokens)
        if n > self._engine.max_context:
            raise ContextLengthError(f"sequence of {n} tokens exceeds the model context of {self._engine.max_context}")
        self.keep_tree_path([])
        keep = min(common_prefix_length(self._cached, tokens), len(tokens) - 1)
        self.rollback(keep)
        new = list(tokens[keep:])
        mask, positions = tree_attention_inputs(parents, keep, len(new), self._engine.model.dtype, self._engine.device)
        input_ids = torch.tensor([new + list(tree_tokens)], dtype=torch.long, device=self._engine.device)
        started = time.perf_counter()
        with torch.inference_mode():
            hidden = self._engine.model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                                   past_key_values=self._cache, use_cache=True).last_hidden_state
        self.pass_time_s += time.perf_counter() - started
        self._cached.extend(new)
        self._tree = list(tree_tokens)
        self.forward_calls += 1
        return hidden[0, len(new) - 1:]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits (float32, ``[r, vocab]``) for last hidden states ``[r, hidden]``."""
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self._engine.model.get_output_embeddings()(hidden).float()
        self.pass_time_s += time.perf_counter() - started
        return logits

    def tree_logits(self, tokens: Sequence[int], tree_tokens: Sequence[int],
                    parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`tree_hidden` with every row's logits: ``([1 + n, vocab], [1 + n, hidden])``."""
        hidden = self.tree_hidden(tokens, tree_tokens, parents)
        return self.head_logits(hidden), hidden

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """KV compaction, the one place the cache is rearranged: after :meth:`tree_hidden`,
        keep the committed tokens plus the tree nodes ``path`` (root-to-leaf); drop the rest."""
        from triton_backend.engines.torch.tree_attention import compact_cache

        if not self._tree:
            if path:
                raise ValueError("no draft tree in the cache")
            return
        compact_cache(self._cache, len(self._cached), path)
        self._cached.extend(self._tree[i] for i in path)
        self._tree = []

    def release(self) -> None:
        self._cache = DynamicCache(config=self._engine.model.config)
        self._cached = []
        self._tree = []


class TorchEngine:
    """A Hugging Face causal LM served by the torch runtime."""

    def __init__(self, model: PreTrainedModel, *, name: str = "model", runtime: RuntimeConfig | None = None,
                 eos_token_ids: Sequence[int] | None = None, max_context: int | None = None) -> None:
        runtime = runtime or RuntimeConfig()
        configure_threads(runtime.num_threads)
        self.runtime = runtime
        self.device = torch.device(runtime.device)
        self.model = model.to(device=self.device, dtype=_DTYPES[runtime.dtype]).eval()
        if runtime.packed_gemm_rows and self.device.type == "cpu" and runtime.dtype == "float32":
            pack_linear_layers(self.model, runtime.packed_gemm_rows)
        self.name = name
        config = model.config
        head = model.get_output_embeddings()  # a reduced-vocabulary draft head still emits full-width logits
        self.vocab_size = int(getattr(head, "full_vocab_size", None) or head.weight.shape[0])
        self.max_context = int(max_context or getattr(config, "max_position_embeddings", 2048))
        self.eos_token_ids = model_eos(config) if eos_token_ids is None else frozenset(int(t) for t in eos_token_ids)

    def new_session(self) -> TorchSession:
        return TorchSession(self)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def __repr__(self) -> str:
        return f"TorchEngine({self.name!r}, vocab={self.vocab_size}, context={self.max_context}, device={self.device})"
