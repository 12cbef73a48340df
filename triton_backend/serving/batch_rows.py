"""A batched request to a tensorrtllm_backend front model (``tensorrt_llm_bls`` and ``ensemble``
declare ``max_batch_size`` 8, so a client may send ``text_input`` ``[8, 1]``) as one request per
row, and the rows' answers as one batched answer. The serving model takes one prompt per request;
its rows run side by side in its in-flight batch. Numpy only: the front model
(:mod:`triton_backend.serving.triton.forward_model`) does the Triton side.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from triton_backend.core.errors import InvalidRequestError


def batch_size(arrays: Mapping[str, np.ndarray]) -> int:
    """The request's batch: every input's first dimension (Triton checked that they agree)."""
    sizes = {np.asarray(a).shape[0] for a in arrays.values() if np.asarray(a).ndim > 0}
    if len(sizes) > 1:
        raise InvalidRequestError(f"the inputs' batch sizes differ: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def split_rows(arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One ``{input: [1, ...] array}`` per row of the batch."""
    n = batch_size(arrays)
    return [{name: np.asarray(a)[i:i + 1] for name, a in arrays.items()} for i in range(n)]


def stack_rows(rows: list[Mapping[str, np.ndarray]], flat: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The rows' outputs as one batch: each output concatenated along the first axis, shorter
    rows padded at the end of every other axis (zeros; empty strings for BYTES). ``flat``: outputs
    sent flattened (``text_output``: one string per row and beam)."""
    names = [name for name in rows[0] if all(name in row for row in rows)]
    out: dict[str, np.ndarray] = {}
    for name in names:
        parts = [np.asarray(row[name]) for row in rows]
        if name in flat:
            out[name] = np.concatenate([p.reshape(-1) for p in parts])
            continue
        parts = [p.reshape((1,) + p.shape) if p.ndim == 0 else p for p in parts]
        rank = max(p.ndim for p in parts)
        parts = [p.reshape(p.shape + (1,) * (rank - p.ndim)) for p in parts]
        widest = tuple(max(p.shape[axis] for p in parts) for axis in range(1, rank))
        padded = []
        for p in parts:
            pad = [(0, 0)] + [(0, w - s) for w, s in zip(widest, p.shape[1:])]
            fill = b"" if p.dtype == np.object_ else 0
            padded.append(np.pad(p, pad, constant_values=fill) if any(after for _, after in pad) else p)
        out[name] = np.concatenate(padded, axis=0)
    return out


__all__ = ["batch_size", "split_rows", "stack_rows"]
