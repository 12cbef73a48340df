"""The static KV cache of a slot engine: ``num_slots`` x ``max_seq_len`` positions, allocated once.

Keys and values live in two tensors ``[layers, slots, kv_heads, max_seq_len, head_dim]``.
A sequence owns a slot; a pass writes its new tokens' keys/values at their positions and
attends to ``[0, start + n)`` of its slot. Rollback is the caller starting its next row
earlier (nothing here moves); the one compaction, after a tree pass, is
:meth:`SlotKVCache.move_positions`. On CPU the tensors are mapped lazily, so the memory a
cache really holds grows with the positions written, up to :meth:`SlotKVCache.nbytes`.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from triton_backend.engines.batch import SlotsExhaustedError

logger = logging.getLogger(__name__)


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_seq_len: int,
                   dtype_bytes: int) -> int:
    """Bytes of keys + values for every slot and position (the planner uses this too)."""
    return 2 * num_layers * num_slots * num_kv_heads * max_seq_len * head_dim * dtype_bytes


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"a KV cache needs >= 1 slot and position, got {num_slots} x {max_seq_len}")
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # CPU: torch.empty of this size is a fresh anonymous mapping (zero pages, committed only
        # when written), so memory grows with use; every value read is finite (zero or written).
        make = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.keys = make(shape, dtype=dtype, device=device)
        self.values = make(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._taken: set[int] = set()
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise SlotsExhaustedError(
                    f"all {self.num_slots} KV-cache slots are in use; release a sequence or raise the deployment's "
                    "runtime.max_batch_size")
            slot = self._free.pop()
            self._taken.add(slot)
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._taken:
                self._taken.remove(slot)
                self._free.append(slot)

    def check_taken(self, slot: int) -> None:
        if slot not in self._taken:
            raise ValueError(f"KV-cache slot {slot} is not allocated")

    @property
    def slots_in_use(self) -> int:
        return len(self._taken)

    def write(self, layer: int, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[kv_heads, n, head_dim]`` keys/values at positions ``start .. start + n - 1``."""
        n = keys.shape[1]
        self.keys[layer, slot, :, start:start + n] = keys
        self.values[layer, slot, :, start:start + n] = values

    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        """One batched write for a static-shape pass: token ``(r, t)``'s keys/values
        ``[R, T, kv_heads, head_dim]`` at position ``positions[r, t]`` of slot ``slots[r, t]``
        (both ``[R, T]`` device tensors: no host sync, one kernel per tensor)."""
        self.keys[layer][slots, :, positions] = keys
        self.values[layer][slots, :, positions] = values

    def gather_rows(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, kv_heads, length, head_dim]`` of positions ``0 .. length - 1`` of
        each slot in ``slots`` ``[R]`` (a static ``length``: the pass's context bucket)."""
        return (self.keys[layer, :, :, :length].index_select(0, slots),
                self.values[layer, :, :, :length].index_select(0, slots))

    def view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, length, head_dim]`` of positions ``0 .. length - 1``."""
        return self.keys[layer, slot, :, :length], self.values[layer, slot, :, :length]

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Every layer: positions ``0 .. length - 1`` of slot ``source`` into slot ``destination``."""
        for cache in (self.keys, self.values):
            cache[:, destination, :, :length] = cache[:, source, :, :length]

    def copy_from(self, source: "SlotKVCache", source_slot: int, slot: int, start: int, end: int,
                  layers: Sequence[int] | None = None) -> None:
        """Positions ``start .. end - 1`` of ``source``'s slot ``source_slot`` into this cache's
        ``slot``: this cache's layer ``i`` from ``source``'s layer ``layers[i]`` (None: the same
        layers). Another engine's cache of the same model (a draft sharing the target's context)."""
        if layers is None:
            for cache, other in ((self.keys, source.keys), (self.values, source.values)):
                cache[:, slot, :, start:end] = other[:, source_slot, :, start:end]
            return
        for i, layer in enumerate(layers):
            for cache, other in ((self.keys, source.keys), (self.values, source.values)):
                cache[i, slot, :, start:end] = other[layer, source_slot, :, start:end]

    def move_positions(self, slot: int, sources: Sequence[int], destination: int) -> None:
        """Every layer: positions ``sources`` (ascending) to ``destination, destination + 1, ...``."""
        if not sources:
            return
        src = torch.as_tensor(list(sources), dtype=torch.long, device=self.keys.device)
        dst = torch.arange(destination, destination + len(sources), device=self.keys.device)
        for cache in (self.keys, self.values):
            cache[:, slot, :, dst] = cache[:, slot, :, src]  # advanced indexing reads a copy first


__all__ = ["SlotKVCache", "kv_cache_bytes"]
