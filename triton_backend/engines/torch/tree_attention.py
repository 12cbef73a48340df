"""A tree pass on the Hugging Face engines: its attention mask and position ids, and the KV
compaction to the accepted path afterwards (tree topology itself is :mod:`triton_backend.core.tree`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from triton_backend.core.tree import ancestor_mask, node_depths


def tree_attention_inputs(parents: Sequence[int], past: int, num_new: int, dtype: torch.dtype,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Additive attention mask ``[1, 1, q, past + q]`` and position ids ``[1, q]`` for one pass
    over ``num_new`` committed tokens (after ``past`` cached ones) followed by the tree's nodes
    (``q = num_new + len(parents)``). Committed rows are causal; node rows see everything
    committed plus their ancestors."""
    if num_new < 1:
        raise ValueError("the pass needs at least the last committed token")
    n = len(parents)
    q, kv = num_new + n, past + num_new + n
    allowed = torch.zeros(q, kv, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:num_new, past:past + num_new] = torch.ones(num_new, num_new, dtype=torch.bool).tril()
    allowed[num_new:, past:past + num_new] = True
    if n:
        allowed[num_new:, past + num_new:] = ancestor_mask(parents)
    mask = torch.zeros(q, kv, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    root = past + num_new - 1
    positions = list(range(past, past + num_new)) + [root + d for d in node_depths(parents)]
    return mask[None, None].to(device), torch.tensor([positions], dtype=torch.long, device=device)


def compact_cache(cache: Any, keep: int, nodes: Sequence[int]) -> None:
    """KV compaction after tree verification: keep the first ``keep`` cached positions
    followed by the tree nodes ``nodes`` (indices after ``keep``, root-to-leaf order);
    everything else (rejected branches) is dropped. Works on every layer of a DynamicCache."""
    index = torch.cat([torch.arange(keep), keep + torch.as_tensor(list(nodes), dtype=torch.long)])
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


__all__ = ["compact_cache", "tree_attention_inputs"]
