"""A compact Llama-family forward pass over ragged rows, written for the slot engine.

Covers Llama, SmolLM2 and Qwen2 (q/k/v biases), tied or untied embeddings, grouped-query
attention and RoPE with the scalings a config asks for (linear, llama3, yarn, longrope via
``transformers``' RoPE tables; dynamic NTK is refused: its frequencies change with the
sequence). :func:`unsupported_reason` says why a config is not covered; the engine factory
then keeps the Hugging Face path.

One pass: every row's new tokens are concatenated into one ``[T, hidden]`` matrix, so each
linear layer is ONE matrix product for the whole batch; attention runs per row against its
slot of the :class:`~triton_backend.engines.torch.kv_cache.SlotKVCache` (positions ``[0, start)``
plus the row's own tokens, causally or by a tree mask).

Numerics: on CPU float32 with one thread, every linear layer and the attention run the
row-invariant kernels of :mod:`~triton_backend.engines.torch.row_gemm` (each output computed the same
way whatever the pass holds): a row's result is bit-identical alone or in any batch, a position's
logits are the same bits in a decode step and in a verify or tree pass, and a pass over 2-8 rows
costs little more than a one-row step. Without it (other devices/dtypes, several
threads, no compiler) torch's kernels run: MKL's float32 GEMM computes every row the same way
for any M >= 4 (and the packed 8-row kernel agrees bit for bit), while M = 1 takes a GEMV and
M = 2, 3 other kernels, so a pass pads 2-3 rows to 4 and ``invariant`` pads single rows too.
On torch's kernels attention is per row (the same ops alone or batched) except for all-decode
batches when ``batched_decode`` is asked (one padded product: faster, not bit-identical).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engines.torch.kv_cache import SlotKVCache
from triton_backend.engines.torch.packed_linear import MAX_CHUNKS, packed_matmul, packed_weight, packing_available
from triton_backend.engines.torch.compact_weights import HEAD, CompactLinear
from triton_backend.engines.torch.fused_linear import FusedLinear, fuse
from triton_backend.engines.torch.row_gemm import BoundGemm, RowGemm
from triton_backend.engines.torch.weight_gemm import BoundWeightGemm, WeightGemm, dequantize

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "specbuild_subset_llama")
INVARIANT_ROWS = 4  # MKL's sgemm is row-invariant from this many rows on (measured)


def _rope_settings(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    merged.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def unsupported_reason(config: Any) -> str | None:
    """Why the compact forward cannot run ``config`` (``None``: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the compact forward implements silu)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if _rope_settings(config)["rope_type"] == "dynamic":
        return "dynamic NTK RoPE (frequencies depend on the sequence length)"
    return None


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float

    @classmethod
    def from_config(cls, config: Any) -> "LlamaShape":
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(int(config.vocab_size), int(config.hidden_size), int(config.num_hidden_layers), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim), float(config.rms_norm_eps))


def rope_tables(config: Any, head_dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` float32 ``[length, head_dim]`` for positions ``0 .. length - 1``."""
    settings = _rope_settings(config)
    rope_type = settings["rope_type"]
    if rope_type == "default":
        base = float(settings["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scale = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


class RowLinear:
    """``y = x W^T + b`` over ``[M, in]``, every row computed by the same kernel family
    (see the module docstring): the row-invariant kernel when given, else torch's kernels with
    rows padded (optionally on MKL-prepacked weights for ``4 .. rows * MAX_CHUNKS`` rows).
    A ``compact`` weight (16-bit, int8, fp8, int4; :mod:`~triton_backend.engines.torch.compact_weights`)
    runs on ``weight_gemm`` (row-invariant too), or where that is absent on torch's kernels over
    its float32 decoding; its ``input_scale`` multiplies ``x`` first."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, *, pack_rows: int, invariant: bool,
                 row_gemm: RowGemm | None = None, compact: CompactLinear | None = None,
                 weight_gemm: WeightGemm | None = None) -> None:
        self.compact = compact
        self.input_scale = None if compact is None or compact.input_scale is None else compact.input_scale.float().contiguous()
        self.bias = None if bias is None else bias.detach()
        self._run: BoundGemm | BoundWeightGemm | None = None
        if compact is not None and weight_gemm is not None:
            self.weight, self.row_gemm = None, None
            self.bias = None if self.bias is None else self.bias.float().contiguous()
            self._run = weight_gemm.bind(compact.weight, self.bias)
            self.row_invariant, self.min_rows, self.pack_rows, self.packed = True, 1, 0, None
            return
        if compact is not None:  # no compact kernel here: torch's kernels on the decoded weight (same values)
            weight = dequantize(compact.weight)
        assert weight is not None
        self.weight = weight.detach()
        self.row_gemm = row_gemm if (row_gemm is not None and self.weight.device.type == "cpu"
                                     and self.weight.dtype == torch.float32) else None
        if self.row_gemm is not None:
            self.weight = self.weight.contiguous()
            self.bias = None if self.bias is None else self.bias.float().contiguous()
            self._run = self.row_gemm.bind(self.weight, self.bias)
            pack_rows = 0
        self.row_invariant = self._run is not None
        self.min_rows = 1 if not invariant else INVARIANT_ROWS
        self.pack_rows = pack_rows if (pack_rows and self.weight.device.type == "cpu"
                                       and self.weight.dtype == torch.float32 and packing_available()) else 0
        self.packed = packed_weight(self.weight, self.pack_rows) if self.pack_rows else None

    def packed_bytes(self) -> int:
        """Memory of this layer's packed weight copy (row-kernel panels, a compact weight or MKL's packing), if any."""
        if isinstance(self._run, BoundWeightGemm):
            return self.compact.nbytes()
        packed = self._run.packed if self._run is not None else self.packed
        return 0 if packed is None else packed.numel() * packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x * self.input_scale
        if self._run is not None:
            return self._run(x)
        m = x.shape[0]
        rows = m if m == 1 and self.min_rows == 1 else max(m, INVARIANT_ROWS)
        if rows > m:
            x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
        if self.packed is not None and INVARIANT_ROWS <= rows <= MAX_CHUNKS * self.pack_rows:
            out = packed_matmul(x, self.packed, self.weight, self.bias, self.pack_rows)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out[:m] if rows > m else out


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: RowLinear
    k: RowLinear
    v: RowLinear
    o: RowLinear
    mlp_norm: torch.Tensor
    gate: RowLinear
    up: RowLinear
    down: RowLinear
    qkv: FusedLinear | None = None  # q, k, v in one kernel call (the same bits), where they can share one
    gate_up: FusedLinear | None = None


_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and _FUSED_RMS_NORM:  # one op, the same bits (tests/test_row_gemm_engine.py)
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half convention) on ``[..., d]`` with ``cos``/``sin`` broadcastable to it
    (``[T, heads, d]`` with ``[T, 1, d]`` here; the EAGLE layer's ``[B, heads, T, d]`` too)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`rotate_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` in fewer ops, bit for bit (negating a factor is exact): the halves swapped
    by one roll, the sign carried by ``sin_signed`` (:func:`signed_sin`)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class LlamaForward:
    """The weights (shared with the module they came from, never copied) and the math."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor] | None,
                 *, pack_rows: int = 0, invariant: bool = False, row_gemm: RowGemm | None = None,
                 compact: Mapping[str, CompactLinear] | None = None, weight_gemm: WeightGemm | None = None) -> None:
        """``compact``: linears (HF names without ``.weight``; ``lm_head`` for the head) held in a
        compact precision instead of their float ``tensors`` (which may then be absent)."""
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"the compact Llama forward does not cover this model: {reason}")
        self.config = config
        self.shape = shape = LlamaShape.from_config(config)
        self.embed = tensors["model.embed_tokens.weight"].detach()
        self.norm = tensors["model.norm.weight"].detach()

        compact = compact or {}

        def lin(name: str) -> RowLinear:
            return RowLinear(tensors.get(f"{name}.weight"), tensors.get(f"{name}.bias"), pack_rows=pack_rows,
                             invariant=invariant, row_gemm=row_gemm, compact=compact.get(name), weight_gemm=weight_gemm)

        self.layers = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                tensors[p + "input_layernorm.weight"].detach(), lin(p + "self_attn.q_proj"), lin(p + "self_attn.k_proj"),
                lin(p + "self_attn.v_proj"), lin(p + "self_attn.o_proj"), tensors[p + "post_attention_layernorm.weight"].detach(),
                lin(p + "mlp.gate_proj"), lin(p + "mlp.up_proj"), lin(p + "mlp.down_proj")))
        self._head_module = head
        head_weight = tensors.get("lm_head.weight", self.embed if getattr(config, "tie_word_embeddings", False) else None)
        self.head = None if head is not None else RowLinear(head_weight, None, pack_rows=pack_rows, invariant=invariant,
                                                            row_gemm=row_gemm, compact=compact.get(HEAD),
                                                            weight_gemm=weight_gemm)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.scale = shape.head_dim ** -0.5
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        linears = [l for layer in self.layers for l in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)]
        self.row_invariant = row_gemm is not None and bool(linears) and all(l.row_invariant for l in linears)
        self.kernel = row_gemm if self.row_invariant else None  # its attention too: per query, one fixed order
        if self.row_invariant:
            for layer in self.layers:
                layer.qkv, layer.gate_up = fuse((layer.q, layer.k, layer.v)), fuse((layer.gate, layer.up))
        self.linears = linears + ([self.head] if self.head is not None else [])
        extra = self.packed_bytes() / 2**20
        if self.row_invariant and compact:
            logger.info("compact forward: %d linear layers in compact weights (%.0f MB) on the row-invariant CPU kernels",
                        len(compact), extra)
        elif self.row_invariant:
            logger.info("compact forward: linear layers on the row-invariant CPU kernel (weights in panels: +%.0f MB)", extra)
        elif pack_rows and self.layers and self.layers[0].q.packed is not None:
            logger.info("compact forward: linear layers prepacked for %d-row GEMMs (+%.0f MB)", pack_rows, extra)

    def packed_bytes(self) -> int:
        """What the linear layers (and the LM head) hold beside the module's parameters: row-kernel
        panels, compact weights (with their scales) or MKL's packed copies."""
        return sum(l.packed_bytes() for l in self.linears)

    @classmethod
    def from_module(cls, model: nn.Module, *, pack_rows: int = 0, invariant: bool = False,
                    row_gemm: RowGemm | None = None, compact: Mapping[str, CompactLinear] | None = None,
                    weight_gemm: WeightGemm | None = None) -> "LlamaForward":
        """Over a loaded Hugging Face Llama/Qwen2 model's own parameters (shared). A layer-skip
        draft (see ``model_loading.layer_skip_draft``) works too: its layers are renumbered."""
        tensors = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        head = model.get_output_embeddings()
        custom_head = None if isinstance(head, nn.Linear) or head is None else head
        if custom_head is None:
            tensors.pop("lm_head.weight", None) if head is None else tensors.__setitem__("lm_head.weight", head.weight)
        config = model.config
        if len(model.base_model.layers) != config.num_hidden_layers:  # a layer-skip draft shares the config
            config = _with_layers(config, len(model.base_model.layers))
        return cls(config, tensors, custom_head, pack_rows=pack_rows, invariant=invariant, row_gemm=row_gemm,
                   compact=compact, weight_gemm=weight_gemm)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < length:
            self._rope = rope_tables(self.config, self.shape.head_dim, length, self.device)
        return self._rope

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[r, vocab]`` logits for final hidden states ``[r, hidden]``."""
        if self._head_module is not None:
            return self._head_module(hidden).float()
        return self.head(hidden).float()


@dataclass(frozen=True)
class RowPlan:
    """Where one row's tokens sit: ``offset .. offset + n`` of the pass's flat token axis,
    slot positions ``start .. start + n - 1``; ``mask`` additive ``[n, start + n]`` (None: n == 1)."""

    slot: int
    start: int
    offset: int
    n: int
    mask: torch.Tensor | None
    tree: bool = False  # ``mask`` is a tree mask (else causal)


LAYER_CALLS = True  # the row kernel's per-pass call plan (row_gemm.LayerCalls); False: each layer's checked calls


def run_layers(fwd: LlamaForward, cache: SlotKVCache, ids: torch.Tensor, positions: torch.Tensor,
               rows: list[RowPlan], out_index: torch.Tensor, *, batched_decode: bool = True,
               capture: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The decoder stack over ``ids`` ``[T]`` at RoPE ``positions`` ``[T]``; writes every new
    token's keys/values into its slot; returns final-normed hidden states ``[len(out_index), H]``
    and, for each layer ``i`` in ``capture``, its output at ``out_index`` ``[len(out_index), H]``
    (Hugging Face's ``hidden_states[i + 1]``: the residual stream after the layer, final-normed
    for the last layer). Capturing only reads the stream: the hidden states are the same bits.
    ``batched_decode``: attend all-decode batches in one padded batched product (faster; its
    rows may differ from a row alone in the last bits)."""
    shape = fwd.shape
    t = ids.shape[0]
    # every RoPE position is below its row's end (tree nodes: root + depth): sized from the plan, no host sync
    cos, sin = fwd.rope(max(r.start + r.n for r in rows))
    cos, sin = cos[positions][:, None].to(fwd.dtype), sin[positions][:, None].to(fwd.dtype)
    sin = signed_sin(sin)
    x = F.embedding(ids, fwd.embed)
    decode_batch = batched_decode and len(rows) > 1 and all(r.n == 1 for r in rows)
    captured: dict[int, torch.Tensor] = {}
    if fwd.kernel is not None:  # tree rows' visibility, once per pass
        visible = [(r.mask == 0).to(torch.uint8).contiguous() if r.tree else None for r in rows]
        scratch = torch.empty(max(r.start + r.n for r in rows), dtype=torch.float32)
    kernel = fwd.kernel if fwd.kernel is not None and x.dtype == torch.float32 else None
    norm = rms_norm if kernel is None else kernel.rms_norm  # the final norm's (its own tensor)
    layer_norm, calls = norm, None
    if kernel is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
        if LAYER_CALLS and any(layer.qkv is not None for layer in fwd.layers):  # checked once, raw calls per layer
            calls = kernel.layer_calls(cache.keys, cache.values, t, shape.num_heads, cos, sin,
                                       [(r.slot, r.start, r.offset, r.n, seen) for r, seen in zip(rows, visible)],
                                       fwd.scale, scratch)
            layer_norm = calls.rms_norm  # the layers' norms into one buffer (each output read by the next product)
    for li, layer in enumerate(fwd.layers):
        planned = calls is not None and layer.qkv is not None
        h = layer_norm(x, layer.attn_norm, shape.rms_eps)
        if planned:  # rotation and cache stores in one call a row
            q = calls.rope_store(li, layer.qkv(h))
        elif kernel is not None and layer.qkv is not None:
            y = layer.qkv(h)
            q = torch.empty(t, shape.num_heads, shape.head_dim)
            for r in rows:
                kernel.rope_store(y, q, r.offset, r.n, cos, sin, cache.keys[li, r.slot], cache.values[li, r.slot], r.start)
        else:
            q, k, v = layer.q(h), layer.k(h), layer.v(h)
            q, k = q.view(t, shape.num_heads, shape.head_dim), k.view(t, shape.num_kv_heads, shape.head_dim)
            if kernel is None:
                q, k = rotate_signed(q, cos, sin), rotate_signed(k, cos, sin)
            else:  # the kernel's fresh outputs: rotated in place, the same bits
                q, k = kernel.rope_(q, cos, sin), kernel.rope_(k, cos, sin)
            v = v.view(t, shape.num_kv_heads, shape.head_dim)
            for r in rows:
                cache.write(li, r.slot, r.start, k[r.offset:r.offset + r.n].transpose(0, 1),
                            v[r.offset:r.offset + r.n].transpose(0, 1))
        if planned:
            attn = calls.attention(li)
        elif fwd.kernel is not None:
            attn = _kernel_attention(fwd, cache, li, q, rows, visible, scratch)
        elif decode_batch:
            attn = _decode_attention(fwd, cache, li, q, rows)
        else:
            attn = _row_attention(fwd, cache, li, q, rows)
        x.add_(layer.o(attn.reshape(t, shape.num_heads * shape.head_dim)))  # x: this pass's own (captures copy it)
        h = layer_norm(x, layer.mlp_norm, shape.rms_eps)
        if layer.gate_up is not None:
            gate, up = layer.gate_up.split(layer.gate_up(h))
        else:
            gate, up = layer.gate(h), layer.up(h)
        x.add_(layer.down(F.silu(gate).mul_(up)))
        if capture and li in capture and li < len(fwd.layers) - 1:
            captured[li] = x[out_index]
    hidden = norm(x[out_index], fwd.norm, shape.rms_eps)
    if len(fwd.layers) - 1 in capture:
        captured[len(fwd.layers) - 1] = hidden
    return hidden, captured


def _attend(fwd: LlamaForward, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
    """``q`` ``[..., kv_heads, g * n, d]`` against ``keys``/``values`` ``[..., kv_heads, L, d]``;
    ``mask`` additive, broadcastable to ``[..., kv_heads, g * n, L]``."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * fwd.scale
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)


def _row_attention(fwd: LlamaForward, cache: SlotKVCache, layer: int, q: torch.Tensor,
                   rows: list[RowPlan]) -> torch.Tensor:
    """Each row against its own slot: ``[T, heads, d]``."""
    shape = fwd.shape
    kvh, d = shape.num_kv_heads, shape.head_dim
    g = shape.num_heads // kvh
    out = torch.empty_like(q)
    for r in rows:
        keys, values = cache.view(layer, r.slot, r.start + r.n)
        qr = q[r.offset:r.offset + r.n].view(r.n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * r.n, d)
        mask = None if r.mask is None else r.mask.repeat(g, 1)  # [g * n, L], rows ordered (g, n)
        o = _attend(fwd, qr, keys, values, mask)  # [kvh, g * n, d]
        out[r.offset:r.offset + r.n] = o.view(kvh, g, r.n, d).permute(2, 0, 1, 3).reshape(r.n, shape.num_heads, d)
    return out


def _kernel_attention(fwd: LlamaForward, cache: SlotKVCache, layer: int, q: torch.Tensor, rows: list[RowPlan],
                      visible: list[torch.Tensor | None], scratch: torch.Tensor) -> torch.Tensor:
    """Each row against its own slot on the row kernel's attention: every query token gives the
    same bits whatever the pass holds (a decode step equals that position in a verify pass)."""
    out = torch.empty_like(q)
    for r, seen in zip(rows, visible):
        end = r.offset + r.n
        fwd.kernel.attention(q[r.offset:end], cache.keys[layer, r.slot], cache.values[layer, r.slot], r.start, seen,
                             fwd.scale, out[r.offset:end], scratch)
    return out


def _decode_attention(fwd: LlamaForward, cache: SlotKVCache, layer: int, q: torch.Tensor,
                      rows: list[RowPlan]) -> torch.Tensor:
    """One token per row, all rows at once: keys gathered up to the longest row, the rest masked."""
    shape = fwd.shape
    kvh, d = shape.num_kv_heads, shape.head_dim
    g = shape.num_heads // kvh
    lengths = torch.tensor([r.start + 1 for r in rows], device=q.device)
    longest = max(r.start + 1 for r in rows)  # from the plan, not the tensor: no host sync per layer
    slots = torch.tensor([r.slot for r in rows], device=q.device)
    keys = cache.keys[layer].index_select(0, slots)[:, :, :longest]  # [B, kvh, L, d]
    values = cache.values[layer].index_select(0, slots)[:, :, :longest]
    beyond = torch.arange(longest, device=q.device)[None, :] >= lengths[:, None]  # [B, L]
    mask = torch.zeros(beyond.shape, dtype=q.dtype, device=q.device).masked_fill_(beyond, torch.finfo(q.dtype).min)
    o = _attend(fwd, q.view(len(rows), kvh, g, d), keys, values, mask[:, None, None, :])
    return o.reshape(len(rows), shape.num_heads, d)


def _with_layers(config: Any, num_layers: int) -> Any:
    import copy

    out = copy.copy(config)
    out.num_hidden_layers = num_layers
    return out


def load_safetensors_weights(folder: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, tensors)`` straight from a Hugging Face folder (config.json + safetensors),
    the files the loader reads; no ``transformers`` model is built."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    index = folder / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        tensors.update({k: v.to(dtype) for k, v in load_file(str(folder / name)).items()})
    return config, tensors


__all__ = ["LlamaForward", "LlamaShape", "RowLinear", "RowPlan", "run_layers", "load_safetensors_weights", "rms_norm", "rope_tables",
           "rotate", "unsupported_reason"]
