"""Static-shape decode and verify passes for accelerators: rows x tokens buckets, padding masked.

The slot engine's ragged pass (:func:`~triton_backend.engines.torch.llama_forward.run_layers`)
plans every row in Python and loops over rows inside each layer: right for the CPU row kernels,
a launch-bound stream of small kernels on a GPU. Here a pass has a fixed shape, a
:class:`Bucket` of ``rows x tokens`` new tokens attending to ``context`` cached positions, so
one pass is a fixed sequence of kernels that a CUDA graph captures once per bucket and replays
(:mod:`~triton_backend.engines.torch.cuda_graphs`):

- the host pads the batch up to the bucket (:meth:`StaticDecoder.prepare`) and sends it in one
  copy: token ids, RoPE positions, where each token's keys/values go, each row's slot and
  context length, and which new tokens see which (causal or a draft tree);
- the pass (:meth:`StaticDecoder.step`) runs with no host sync: one batched KV write per layer
  (:meth:`SlotKVCache.write_rows`), one gather of the rows' first ``context`` positions, one SDPA
  over them with a boolean mask built on the device from the row lengths, and the LM head over
  every token: logits ``[rows, tokens, vocab]``.

Padding never touches a real sequence: padded tokens write into a scratch slot the decoder keeps
for itself, padded rows read it, and no real token sees a padded one. Numerics: the linear layers
are the forward's own (:class:`~triton_backend.engines.torch.llama_forward.RowLinear`), attention
is SDPA; on CPU in float32 this agrees with the ragged pass to rounding (same greedy tokens,
tests/test_gpu_path.py) but is not the row kernels' bit-identical path, which stays the CPU default.
Precision: :func:`device_dtype` (bfloat16 on CUDA, float32 elsewhere) for weights and the cache.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, fields
from typing import Sequence

import torch
import torch.nn.functional as F

from triton_backend.core.tree import ancestor_mask, node_depths
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch.kv_cache import SlotKVCache
from triton_backend.engines.torch.llama_forward import LlamaForward, rms_norm, rope_tables, rotate_signed, signed_sin

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
CONTEXT_QUANTUM = 256


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def device_dtype(device: torch.device | str, requested: str | None = None) -> torch.dtype:
    """The precision a static pass runs in on ``device`` (weights and KV cache): ``requested``
    (float32, float16, bfloat16: the plan's precision) or by default bfloat16 on CUDA, float32
    elsewhere."""
    if requested is not None:
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {requested!r}")
        return _DTYPES[requested]
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass(frozen=True)
class Bucket:
    rows: int
    tokens: int
    context: int  # cached positions attended per row: a multiple of the quantum, or the whole slot


@dataclass(frozen=True)
class BucketPolicy:
    """The shapes a decoder runs: rows and tokens round up to the next listed size, the attended
    context to the next multiple of ``context_quantum``. Fewer shapes, fewer graphs to capture."""

    rows: tuple[int, ...] = ROW_BUCKETS
    tokens: tuple[int, ...] = TOKEN_BUCKETS
    context_quantum: int = CONTEXT_QUANTUM

    def __post_init__(self) -> None:
        for name in ("rows", "tokens"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"bucket {name} must be distinct ascending sizes >= 1, got {sizes}")
        if self.context_quantum < 1:
            raise ValueError(f"context_quantum must be >= 1, got {self.context_quantum}")

    def bucket(self, rows: int, tokens: int, context: int, max_context: int) -> Bucket:
        """The smallest bucket holding ``rows`` rows of up to ``tokens`` new tokens whose slots end
        by position ``context``."""
        if rows > self.rows[-1] or tokens > self.tokens[-1]:
            raise ValueError(f"a pass of {rows} rows x {tokens} tokens exceeds the largest bucket "
                             f"{self.rows[-1]} x {self.tokens[-1]}")
        r = self.rows[bisect.bisect_left(self.rows, rows)]
        t = self.tokens[bisect.bisect_left(self.tokens, tokens)]
        q = self.context_quantum
        return Bucket(r, t, min(max_context, -(-context // q) * q))


@dataclass
class StaticInputs:
    """One padded pass, every field a device tensor of the bucket's shape (R rows, T tokens)."""

    ids: torch.Tensor  # [R, T] long
    rope_positions: torch.Tensor  # [R, T] long
    write_slots: torch.Tensor  # [R, T] long: where each token's keys/values go (padding: the scratch slot)
    write_positions: torch.Tensor  # [R, T] long
    read_slots: torch.Tensor  # [R] long: the slot each row attends to (padded rows: the scratch slot)
    starts: torch.Tensor  # [R] long: cached positions before the row's new tokens
    attend: torch.Tensor  # [R, T, T] bool: new token t sees new token t' (causal or tree; padding sees itself)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def copy_(self, other: "StaticInputs") -> None:
        """Into these (static) buffers: a graph's inputs refilled before replay."""
        for name, t in self.tensors().items():
            t.copy_(getattr(other, name), non_blocking=True)


class StaticDecoder:
    """Static-shape passes over a :class:`LlamaForward` with its own :class:`SlotKVCache`
    (``num_slots`` sequences of ``max_context`` positions, plus one scratch slot for padding)."""

    def __init__(self, fwd: LlamaForward, num_slots: int, max_context: int, policy: BucketPolicy | None = None) -> None:
        if fwd._head_module is not None:
            raise ValueError("the static decoder runs the forward's own LM head (a custom head module is not covered)")
        self.fwd, self.policy = fwd, policy or BucketPolicy()
        shape = fwd.shape
        self.shape, self.device, self.dtype = shape, fwd.device, fwd.dtype
        self.max_context = int(max_context)
        self.cache = SlotKVCache(shape.num_layers, num_slots + 1, shape.num_kv_heads, self.max_context, shape.head_dim,
                                 self.dtype, self.device)
        for t in (self.cache.keys, self.cache.values):  # attention reads whole context buckets: every value
            t.zero_()  # finite from the start (a masked NaN would still poison the product with the values)
        self.scratch = self.cache.allocate()  # slot 0: padding writes and reads land here
        cos, sin = rope_tables(fwd.config, shape.head_dim, self.max_context, self.device)
        self.cos, self.sin = cos.to(self.dtype), signed_sin(sin).to(self.dtype)
        self.num_heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        # grouped-query attention: SDPA's own (enable_gqa) or keys/values repeated per query head first
        # (a copy, but SDPA's fused kernels then apply where their GQA support is missing); same values
        self.expand_kv = False

    def allocate(self) -> int:
        return self.cache.allocate()

    def release(self, slot: int) -> None:
        if slot == self.scratch:
            raise ValueError("the scratch slot is the decoder's own")
        self.cache.release(slot)

    # -- the host side: pad a batch to its bucket ------------------------------------------------
    def prepare(self, rows: Sequence[BatchRow], bucket: Bucket | None = None) -> tuple[Bucket, StaticInputs]:
        """The bucket of ``rows`` (or the one given, if they fit) and their padded inputs, sent to
        the device in one copy. A row's ``tree_parents`` follow :class:`BatchRow`: parents of its
        last ``len(tree_parents)`` tokens, ``-1`` = the token just before the nodes."""
        if not rows:
            raise ValueError("a pass needs at least one row")
        seen: set[int] = set()
        for row in rows:
            if row.slot in seen or row.slot == self.scratch:
                raise ValueError(f"slot {row.slot} appears twice in one pass or is the scratch slot")
            seen.add(row.slot)
            self.cache.check_taken(row.slot)
            if not row.tokens:
                raise ValueError("a row needs at least one token")
            if row.start < 0 or row.start + len(row.tokens) > self.max_context:
                raise ValueError(f"a row of {len(row.tokens)} tokens at {row.start} exceeds the slot's "
                                 f"{self.max_context} positions")
        tokens, end = max(len(r.tokens) for r in rows), max(r.start + len(r.tokens) for r in rows)
        if bucket is None:
            bucket = self.policy.bucket(len(rows), tokens, end, self.max_context)
        elif len(rows) > bucket.rows or tokens > bucket.tokens or end > bucket.context or bucket.context > self.max_context:
            raise ValueError(f"{len(rows)} rows of up to {tokens} tokens ending by {end} do not fit bucket {bucket} "
                             f"(larger than it, or it is larger than the slot)")
        return bucket, self._pack(rows, bucket)

    def exact_bucket(self, rows: Sequence[BatchRow]) -> Bucket:
        """A bucket of exactly these rows and tokens (a prefill, run eagerly: no graph per shape)."""
        end = max(r.start + len(r.tokens) for r in rows)
        q = self.policy.context_quantum
        return Bucket(len(rows), max(len(r.tokens) for r in rows), min(self.max_context, -(-end // q) * q))

    def _pack(self, rows: Sequence[BatchRow], bucket: Bucket) -> StaticInputs:
        R, T = bucket.rows, bucket.tokens
        ids = torch.zeros(R, T, dtype=torch.long)
        rope = torch.arange(T).repeat(R, 1)
        write_slots = torch.full((R, T), self.scratch, dtype=torch.long)
        write_pos = torch.arange(T).repeat(R, 1)
        read_slots = torch.full((R,), self.scratch, dtype=torch.long)
        starts = torch.zeros(R, dtype=torch.long)
        attend = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)
        for i, row in enumerate(rows):
            n = len(row.tokens)
            ids[i, :n] = torch.as_tensor(list(row.tokens), dtype=torch.long)
            write_slots[i, :n] = row.slot
            write_pos[i, :n] = torch.arange(row.start, row.start + n)
            read_slots[i], starts[i] = row.slot, row.start
            visible, depth = _row_visibility(n, row.tree_parents)
            attend[i, :n, :n] = visible
            rope[i, :n] = row.start + depth
        host = StaticInputs(ids, rope, write_slots, write_pos, read_slots, starts, attend)
        return StaticInputs(**{k: v.to(self.device, non_blocking=True) for k, v in host.tensors().items()})

    # -- the device side: one static pass --------------------------------------------------------
    def step(self, inputs: StaticInputs, context: int) -> torch.Tensor:
        """Logits ``[R, T, vocab]`` (float32) of every token of a padded pass; writes every real
        token's keys/values into its slot. Device ops only, shapes fixed by the inputs and
        ``context``: capturable as one CUDA graph."""
        fwd, shape = self.fwd, self.shape
        R, T = inputs.ids.shape
        n = R * T
        H, kvh, d = self.num_heads, self.kv_heads, self.head_dim
        mask = _context_mask(inputs.starts, inputs.attend, context)[:, None]  # [R, 1, T, L]
        pos = inputs.rope_positions.reshape(n)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [n, 1, d]
        x = F.embedding(inputs.ids.reshape(n), fwd.embed)
        for li, layer in enumerate(fwd.layers):
            h = rms_norm(x, layer.attn_norm, shape.rms_eps)
            q = rotate_signed(layer.q(h).view(n, H, d), cos, sin)
            k = rotate_signed(layer.k(h).view(n, kvh, d), cos, sin)
            v = layer.v(h).view(n, kvh, d)
            self.cache.write_rows(li, inputs.write_slots, inputs.write_positions, k.view(R, T, kvh, d), v.view(R, T, kvh, d))
            keys, values = self.cache.gather_rows(li, inputs.read_slots, context)  # [R, kvh, L, d]
            if self.expand_kv and H != kvh:
                keys, values = keys.repeat_interleave(H // kvh, dim=1), values.repeat_interleave(H // kvh, dim=1)
            attn = F.scaled_dot_product_attention(q.view(R, T, H, d).transpose(1, 2), keys, values, attn_mask=mask,
                                                  scale=fwd.scale, enable_gqa=keys.shape[1] != H)  # [R, H, T, d]
            x = x + layer.o(attn.transpose(1, 2).reshape(n, H * d))
            h = rms_norm(x, layer.mlp_norm, shape.rms_eps)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        hidden = rms_norm(x, fwd.norm, shape.rms_eps)
        return fwd.head(hidden).float().view(R, T, -1)

    def run(self, rows: Sequence[BatchRow]) -> list[torch.Tensor]:
        """Eager, any number of tokens (a prefill): each row's logits ``[len(tokens), vocab]`` (device tensors)."""
        bucket, inputs = self.prepare(rows, self.exact_bucket(rows))
        logits = self.step(inputs, bucket.context)
        return [logits[i, :len(r.tokens)] for i, r in enumerate(rows)]


def _row_visibility(n: int, parents: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, n]`` which of a row's new tokens each sees, and each token's RoPE offset ``[n]``
    (a chain: causal, ``0 .. n - 1``; a tree: the committed tokens causal, nodes see their ancestors
    and sit at the root's position plus their depth)."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if parents is None or all(p == i - 1 for i, p in enumerate(parents)):
        return causal, torch.arange(n)
    nodes = len(parents)
    base = n - nodes
    if base < 1:
        raise ValueError("a tree row needs the last committed token before its nodes")
    visible = causal.clone()
    visible[base:, base:] = ancestor_mask(list(parents))
    visible[base:, :base] = True
    depth = torch.tensor(list(range(base)) + [base - 1 + dd for dd in node_depths(list(parents))])
    return visible, depth


def _context_mask(starts: torch.Tensor, attend: torch.Tensor, context: int) -> torch.Tensor:
    """``[R, T, context]`` bool: position ``j`` of a row's slot is seen by its new token ``t`` when
    ``j`` is cached before the row (``j < start``) or is new token ``j - start`` and ``attend`` says so
    (and position 0 always)."""
    R, T, _ = attend.shape
    rel = torch.arange(context, device=starts.device)[None, :] - starts[:, None]  # [R, L]
    new = (rel >= 0) & (rel < T)
    seen_new = attend.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(R, T, context))
    # position 0 is seen by every real token anyway; with it, a padded token always sees one key (no NaN)
    return ((rel < 0) | (rel == -starts[:, None]))[:, None, :] | (new[:, None, :] & seen_new)


__all__ = ["Bucket", "BucketPolicy", "CONTEXT_QUANTUM", "ROW_BUCKETS", "StaticDecoder", "StaticInputs", "TOKEN_BUCKETS",
           "device_dtype"]
