"""A GGUF file's quantized blocks as the slot engine's compact linears, without requantizing.

A GGUF model's float32 weights (what transformers' GGUF loader, and so the project's reference model,
computes) are its blocks dequantized: Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, Q8_0 ``d * q``, with
``d`` and ``m`` float16 and 32 weights a block. The compact-weight kernel holds those blocks as they are
(:mod:`~triton_backend.engines.torch.weight_gemm`): Q4_0 as int4 with a scale per group of 32, Q4_1 as
int4 with a scale and a minimum per group of 32, Q8_0 as int8 with a scale per group of 32. Each
decodes, in registers, to the very float32 value the dequantized model holds (a float16 scale times a
small integer is exact in float32; Q4_1's minimum is then added, one rounding, as the dequantization
does), so a GGUF target served in 4 bits computes float32's weights, not a requantization of them
(round to nearest in the planner's groups agreed with float32's greedy token ~60 % of the time).

Rows: llama.cpp stores ``attn_q`` / ``attn_k`` with each head's rotary halves interleaved; the
Hugging Face layout (and transformers' GGUF loader) puts them in halves. Rows are whole blocks, so the
reorder is a row permutation of the blocks (:func:`rotary_rows`).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triton_backend.core.runtime_config import WeightPrecision
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.compact_weights import HEAD, CompactLinear
from triton_backend.engines.torch.weight_gemm import pack_int4, pack_int8

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
# the block types imported, and the precision each serves
BLOCK_PRECISION = {"Q4_0": WeightPrecision.INT4, "Q4_1": WeightPrecision.INT4, "Q8_0": WeightPrecision.INT8}


@dataclass(frozen=True)
class BlockTensor:
    """One quantized weight ``[n, k]``: its GGUF type name and its raw blocks, uint8 ``[n, bytes per row]``."""

    kind: str
    n: int
    k: int
    blocks: np.ndarray


def rotary_rows(n: int, heads: int) -> torch.Tensor:
    """Row ``i`` of the Hugging Face ``q_proj`` / ``k_proj`` weight is row ``rotary_rows(n, heads)[i]`` of
    the GGUF tensor: within each head, GGUF rows ``2j`` and ``2j + 1`` are Hugging Face rows ``j`` and
    ``j + head_dim / 2``."""
    half = n // heads // 2
    return torch.arange(n).reshape(heads, half, 2).transpose(1, 2).reshape(n)


def _halves(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``[n, k / 32, 16]`` packed nibble bytes -> element ``i`` of a block is byte ``i``'s low nibble for
    ``i < 16``, byte ``i - 16``'s high nibble after: the values ``[n, k]`` (0 .. 15)."""
    qs = blocks.reshape(n, k // BLOCK, 16)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)


def decode_blocks(t: BlockTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q int8 [n, k], scales float16 [n, k / 32], mins float16 or None)`` of a Q4_0 / Q4_1 / Q8_0 tensor,
    as :func:`~triton_backend.engines.torch.weight_gemm.pack_int4` / ``pack_int8`` take them (Q4_0: ``q - 8``)."""
    n, k, groups = t.n, t.k, t.k // BLOCK
    raw = t.blocks.reshape(n, groups, -1)

    def f16(at: int) -> torch.Tensor:  # kept in float16: the kernel holds them so (half the bytes, exact)
        return torch.from_numpy(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].copy())

    if t.kind == "Q4_0":
        q = _halves(np.ascontiguousarray(raw[..., 2:]), n, k).astype(np.int8) - 8
        return torch.from_numpy(q), f16(0), None
    if t.kind == "Q4_1":
        q = _halves(np.ascontiguousarray(raw[..., 4:]), n, k).astype(np.int8)
        return torch.from_numpy(q), f16(0), f16(2)
    if t.kind == "Q8_0":
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k)
        return torch.from_numpy(q.copy()), f16(0), None
    raise ModelLoadError(f"GGUF block type {t.kind} is not imported (Q4_0, Q4_1, Q8_0 are)")


def compact_from_blocks(t: BlockTensor, rows: torch.Tensor | None = None) -> CompactLinear:
    """``t`` as a compact linear (``rows``: a row permutation applied first)."""
    q, scales, mins = decode_blocks(t)
    if rows is not None:
        q, scales = q[rows].contiguous(), scales[rows].contiguous()
        mins = None if mins is None else mins[rows].contiguous()
    if t.kind == "Q8_0":
        return CompactLinear(pack_int8(q, scales, BLOCK))
    return CompactLinear(pack_int4(q, scales, BLOCK, mins))


# GGUF metadata value types (the file format's numbering) -> their size in bytes; 8 is a string, 9 an array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# GGML tensor type numbers of the block types read here, and each block's bytes
_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
_OTHER_TYPES = {0: "F32", 1: "F16", 6: "Q5_0", 7: "Q5_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
                15: "Q8_K", 30: "BF16"}  # for messages


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # contiguous (input) dimension first
    type_id: int
    offset: int  # from the start of the data section

    @property
    def kind(self) -> str:
        if self.type_id in _TYPES:
            return _TYPES[self.type_id][0]
        return _OTHER_TYPES.get(self.type_id, f"type {self.type_id}")


class GGUFBlocks:
    """The tensor table of a GGUF file (version 2 or 3), and the raw blocks of its quantized tensors,
    read from a memory map. Metadata values are skipped, not parsed (a tokenizer's vocabulary is most of
    them): only ``general.alignment`` is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
            self.tensors = self._read_table()
        except (OSError, ValueError, IndexError, struct.error) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc

    def _read_table(self) -> dict[str, _TensorInfo]:
        buf = memoryview(self._map)
        at = 0

        def take(fmt: str) -> Any:
            nonlocal at
            values = struct.unpack_from("<" + fmt, buf, at)
            at += struct.calcsize("<" + fmt)
            return values[0] if len(values) == 1 else values

        def string() -> str:
            nonlocal at
            length = take("Q")
            text = bytes(buf[at:at + length]).decode("utf-8", errors="replace")
            at += length
            return text

        def skip(kind: int) -> None:
            nonlocal at
            if kind == _STRING:
                length = take("Q")  # read first: "at += take(...)" would add to the offset before the read
                at += length
            elif kind == _ARRAY:
                inner, count = take("I"), take("Q")
                if inner in _SCALAR_BYTES:
                    at += _SCALAR_BYTES[inner] * count
                else:
                    for _ in range(count):
                        skip(inner)
            elif kind in _SCALAR_BYTES:
                at += _SCALAR_BYTES[kind]
            else:
                raise ValueError(f"unknown metadata value type {kind} at byte {at}")

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        at = 4
        version = take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        count, kvs = take("Q"), take("Q")
        alignment = 32
        for _ in range(kvs):
            key, kind = string(), take("I")
            if key == "general.alignment" and kind == _UINT32:
                alignment = take("I")
            else:
                skip(kind)
        infos = []
        for _ in range(count):
            name = string()
            dims = tuple(take("Q") for _ in range(take("I")))
            infos.append(_TensorInfo(name, dims, take("I"), take("Q")))
        self._data = -(-at // alignment) * alignment
        return {t.name: t for t in infos}

    def tensor(self, name: str) -> BlockTensor:
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}")
        if info.type_id not in _TYPES or len(info.dims) != 2:
            raise ModelLoadError(f"{self.path.name}: {name} is {info.kind} {list(info.dims)}; blocks are imported from "
                                 "2-D Q4_0, Q4_1 and Q8_0 tensors only")
        k, n = info.dims
        if k % BLOCK:
            raise ModelLoadError(f"{self.path.name}: {name} has {k} input channels, not a multiple of {BLOCK}")
        row = k // BLOCK * _TYPES[info.type_id][1]
        start = self._data + info.offset
        if start + n * row > self._map.size:
            raise ModelLoadError(f"{self.path.name}: {name} runs past the end of the file (truncated?)")
        return BlockTensor(info.kind, n, k, np.asarray(self._map[start:start + n * row]).reshape(n, row))

    def kinds(self, names: list[str]) -> set[str]:
        return {self.tensors[n].kind for n in names if n in self.tensors}


def gguf_tensor_names(num_layers: int, *, tied: bool) -> dict[str, str]:
    """Each decoder linear's Hugging Face name (without ``.weight``) -> its GGUF tensor, then the head's."""
    names = {f"model.layers.{i}.{hf}": f"blk.{i}.{g}.weight" for i in range(num_layers) for hf, g in _PARTS.items()}
    names[HEAD] = "token_embd.weight" if tied else "output.weight"
    return names


def gguf_precision(path: Path, config: Any) -> WeightPrecision | None:
    """The precision every decoder linear of ``path`` is served in from its own blocks (Q4_0 / Q4_1:
    int4; Q8_0: int8), ``None`` where they are of other or mixed types."""
    blocks = GGUFBlocks(path)
    decoder = [g for hf, g in gguf_tensor_names(int(config.num_hidden_layers), tied=True).items() if hf != HEAD]
    kinds = blocks.kinds(decoder)
    precisions = {BLOCK_PRECISION.get(kind) for kind in kinds}
    if len(precisions) != 1 or None in precisions or len(kinds) == 0:
        return None
    return precisions.pop()


def gguf_compact_linears(path: Path, config: Any, *, head: bool = True) -> dict[str, CompactLinear]:
    """Every decoder linear of the GGUF file ``path`` (a Llama-family model described by ``config``,
    the Hugging Face config) from its blocks, and with ``head`` the LM head's (``output.weight``, or the
    tied ``token_embd.weight``) where it is of an imported type (else left out: the caller serves it)."""
    blocks = GGUFBlocks(path)
    tied = bool(getattr(config, "tie_word_embeddings", False)) or "output.weight" not in blocks.tensors
    heads, kv_heads = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", None)
                                                            or config.num_attention_heads)
    out: dict[str, CompactLinear] = {}
    for hf, name in gguf_tensor_names(int(config.num_hidden_layers), tied=tied).items():
        if hf == HEAD:
            if head and name in blocks.tensors and blocks.tensors[name].kind in BLOCK_PRECISION:
                out[HEAD] = compact_from_blocks(blocks.tensor(name))
            continue
        t = blocks.tensor(name)
        rows = None
        if hf.endswith("q_proj"):
            rows = rotary_rows(t.n, heads)
        elif hf.endswith("k_proj"):
            rows = rotary_rows(t.n, kv_heads)
        out[hf] = compact_from_blocks(t, rows)
    total = sum(c.nbytes() for c in out.values())
    logger.info("%s: %d linear layers from the file's own blocks (%s): %.1f MiB", path.name, len(out),
                ", ".join(sorted(blocks.kinds(list(gguf_tensor_names(int(config.num_hidden_layers), tied=tied).values())))),
                total / 2**20)
    return out


__all__ = ["BLOCK", "BLOCK_PRECISION", "BlockTensor", "GGUFBlocks", "compact_from_blocks", "decode_blocks",
           "gguf_compact_linears", "gguf_precision", "gguf_tensor_names", "rotary_rows"]
