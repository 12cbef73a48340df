"""A tensor-parallel TensorRT-LLM checkpoint (``rank0.safetensors`` .. ``rank<TP-1>``) merged back into
the single-rank layout :mod:`~triton_backend.engines.torch.trtllm_weights` reads, for Llama-family models.

How TensorRT-LLM splits a Llama checkpoint over TP ranks (its checkpoint docs; what Model Optimizer
writes):

* column-parallel linears, split along the output rows: ``attention.qkv`` (each rank holds its q, k
  and v heads stacked: ``[q_r; k_r; v_r]``), ``mlp.fc``, ``mlp.gate``. Their per-row tensors split the
  same way: int4 ``weight`` (two rows a byte), ``weights_scaling_factor`` ``[out, in / group]`` (AWQ) or
  ``[out]`` (int8); an AWQ / SmoothQuant ``prequant_scaling_factor`` ``[in]`` is the same on every rank.
* row-parallel linears, split along the inputs: ``attention.dense``, ``mlp.proj``: ``weight`` and AWQ's
  group scales along their last dimension, ``prequant_scaling_factor`` along its one; int8 channel
  scales ``[out]`` are the same on every rank.
* FP8's per-tensor ``weights_scaling_factor`` is one value per rank. Equal on every rank (what Model
  Optimizer writes: amax over the whole weight) it stays one value; differing on a column-parallel
  linear it becomes one value per output row (the kernel's channel scale: still exact); differing on
  a row-parallel linear, no one scale per output stands for it: refused.
* ``vocab_embedding`` split along ``embedding_sharding_dim`` when ``use_parallel_embedding``,
  ``lm_head`` along the vocabulary (padded to a multiple of TP: the padding is cut); norms replicated.

``activation_scaling_factor`` (FP8 / SmoothQuant's activation quantization, which the torch runtime
does not do) is kept as the largest over the ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from triton_backend.core.errors import ModelLoadError

_COLUMN = ("attention.qkv", "mlp.fc", "mlp.gate")
_ROW = ("attention.dense", "mlp.proj")


def _same(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
        raise ModelLoadError(f"{name} differs between TP ranks where TensorRT-LLM replicates it")
    return parts[0]


def _rows(parts: list[torch.Tensor], bounds: list[int] | None) -> torch.Tensor:
    """Column-parallel per-row tensors: concatenated along dim 0, or for qkv (``bounds``: a rank's q,
    k, v row counts in this tensor's rows) the q of every rank, then the k, then the v."""
    if bounds is None:
        return torch.cat(parts)
    pieces = [torch.split(p, bounds) for p in parts]
    return torch.cat([piece[i] for i in range(3) for piece in pieces])


class _Layout:
    """The model's q / k / v row counts per rank."""

    def __init__(self, config: dict[str, Any], model_config: Any, tp: int) -> None:
        heads, hidden = int(model_config.num_attention_heads), int(model_config.hidden_size)
        head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
        if heads % tp or kv_heads % tp:
            raise ModelLoadError(f"TP {tp} does not divide the {heads} attention / {kv_heads} KV heads: replicated KV "
                                 "heads are not merged")
        self.qkv = [heads * head_dim // tp, kv_heads * head_dim // tp, kv_heads * head_dim // tp]
        self.tp = tp
        self.vocab = int(model_config.vocab_size)
        self.embedding_dim = int(config.get("embedding_sharding_dim", 0)) if config.get("use_parallel_embedding") else None

    def qkv_bounds(self, rows: int) -> list[int]:
        """The q / k / v split of a rank's ``rows`` (int4 weights hold half the rows)."""
        total = sum(self.qkv)
        if rows == total:
            return self.qkv
        if 2 * rows == total and all(b % 2 == 0 for b in self.qkv):
            return [b // 2 for b in self.qkv]
        raise ModelLoadError(f"a rank's attention.qkv has {rows} rows, not its q, k, v {total}")


def _scale(name: str, parts: list[torch.Tensor], weights: list[torch.Tensor], row_parallel: bool,
           bounds: list[int] | None) -> torch.Tensor:
    """``weights_scaling_factor``: per-tensor (FP8) or per row / per group (int8, AWQ)."""
    if parts[0].numel() == 1:  # FP8: one scale per rank
        if all(torch.equal(p, parts[0]) for p in parts):
            return parts[0]
        if row_parallel:
            raise ModelLoadError(f"{name}: TP ranks of a row-parallel FP8 linear hold different scales; no scale per "
                                 "output channel stands for them (re-export with one scale)")
        rows = [p.float().reshape(()).expand(w.shape[0]).clone() for p, w in zip(parts, weights)]
        return _rows(rows, bounds)
    if row_parallel:
        return torch.cat(parts, dim=1) if parts[0].dim() == 2 else _same(name, parts)
    return _rows(parts, bounds)


def _linear(name: str, suffix: str, parts: list[torch.Tensor], ranks: list[dict[str, torch.Tensor]],
            layout: _Layout) -> torch.Tensor:
    module = name[:-len(suffix) - 1]
    row_parallel = module.endswith(_ROW)
    weights = [r[f"{module}.weight"] for r in ranks]
    bounds = None
    if module.endswith("attention.qkv") and suffix in ("weight", "weights_scaling_factor", "bias"):
        per_row = parts[0] if parts[0].numel() > 1 else weights[0]  # an FP8 scale expanded per row: the weight's rows
        bounds = layout.qkv_bounds(per_row.shape[0])
    if suffix == "weight":
        return torch.cat(parts, dim=1) if row_parallel else _rows(parts, bounds)
    if suffix == "weights_scaling_factor":
        return _scale(name, parts, weights, row_parallel, bounds)
    if suffix == "prequant_scaling_factor":
        return torch.cat(parts, dim=-1) if row_parallel else _same(name, parts)
    if suffix == "activation_scaling_factor":
        return torch.stack([p.float().reshape(-1) for p in parts]).amax(0).reshape(parts[0].shape).to(parts[0].dtype)
    if suffix == "bias":
        return _same(name, parts) if row_parallel else _rows(parts, bounds)
    raise ModelLoadError(f"{name}: no rule merges this tensor over TP ranks")


def merge_ranks(ranks: list[dict[str, torch.Tensor]], config: dict[str, Any], model_config: Any) -> dict[str, torch.Tensor]:
    """The single-rank tensors of a TP = ``len(ranks)`` checkpoint (its ``config``; ``model_config``: the
    Hugging Face config, for the head counts and vocabulary)."""
    layout = _Layout(config, model_config, len(ranks))
    names = set(ranks[0])
    if any(set(r) != names for r in ranks[1:]):
        raise ModelLoadError("the TP ranks of the checkpoint hold different tensor names")
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        parts = [r[name] for r in ranks]
        if name == "lm_head.weight":
            merged[name] = torch.cat(parts)[:layout.vocab]
        elif name == "transformer.vocab_embedding.weight":
            dim = layout.embedding_dim
            merged[name] = _same(name, parts) if dim is None else torch.cat(parts, dim=dim)[:layout.vocab]
        elif ".attention." in name or ".mlp." in name:
            module, _, suffix = name.rpartition(".")
            if not module.endswith(_COLUMN + _ROW):
                if "_cache_scaling_factor" in suffix:  # the KV cache's scales (a quantized KV cache): unused here
                    merged[name] = torch.stack([p.float().reshape(-1) for p in parts]).amax(0).reshape(parts[0].shape)
                    continue
                raise ModelLoadError(f"{name}: no rule merges this tensor over TP ranks")
            merged[name] = _linear(name, suffix, parts, ranks, layout)
        else:
            merged[name] = _same(name, parts)
    return merged


__all__ = ["merge_ranks"]
