"""An EAGLE drafter (Li et al. 2024) and its file format.

The drafter predicts the target's next *feature* (last hidden state, after the final norm)
from the feature at a position and the token that follows it:

    x_j   = fc(concat(embed(token_{j+1}), feature_j))          # [.., 2H] -> [.., H]
    f'_j  = decoder_layer(x_j)                                   # one Llama layer, causal over j
    token_{j+2} ~ lm_head(f'_j)                                  # the target's LM head

The layer has no input norm and there is no final norm (TensorRT-LLM's EAGLE-1 net:
``fc_after_embed``, no input layernorm in the first layer, no last layernorm). The embedding
and LM head are the target's own (frozen, not stored). ``candidate_vocab`` (optional, int64
token ids) restricts the LM head to the tokens the target writes most: the draft's ``q``
is then a distribution over those tokens only, which keeps exact sampling exact and makes a
draft step cheap.

The attention's KV cache (:class:`EagleKV`) is batched over rows, each with its own
committed length: :meth:`EagleNet.forward` runs ragged rows (``starts`` = what each row has
cached), so one call serves many sequences.

File: one ``.safetensors`` with the layer in Hugging Face Llama names (``fc.*``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.post_attention_layernorm.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``), optional ``eagle_candidate_vocab``, and
:class:`EagleInfo` as string metadata (``format = specbuild-eagle``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from triton_backend.speculation.drafters.drafter_file import read_drafter_file
from triton_backend.engines.torch.llama_forward import rotate
from triton_backend.engines.torch.row_gemm import RowGemm
from triton_backend.core.errors import ModelLoadError

FORMAT = "specbuild-eagle"
CANDIDATE_VOCAB = "eagle_candidate_vocab"


@dataclass(frozen=True)
class EagleInfo:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target: str = ""
    acceptance_pos1: float | None = None  # held-out teacher-forced top-1, when measured

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_target_config(cls, config: Any, target: str = "") -> "EagleInfo":
        """One layer shaped like the target's (a Hugging Face Llama-family config)."""
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(hidden_size=int(config.hidden_size), num_heads=heads,
                   num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                   intermediate_size=int(config.intermediate_size), vocab_size=int(config.vocab_size),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                   rope_theta=float(theta or getattr(config, "rope_theta", 10000.0)), target=target)

    def metadata(self) -> dict[str, str]:
        return {"format": FORMAT, **{k: json.dumps(v) for k, v in asdict(self).items()}}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "EagleInfo":
        if meta.get("format") != FORMAT:
            raise ModelLoadError(f"not a {FORMAT} file (format {meta.get('format')!r})")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: json.loads(v) for k, v in meta.items() if k in known})


@dataclass
class EagleKV:
    """The drafter layer's KV cache for ``B`` rows: ``k``/``v`` ``[B, kv_heads, capacity, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, info: EagleInfo, rows: int, capacity: int, dtype: torch.dtype, device: Any = "cpu") -> "EagleKV":
        shape = (rows, info.num_kv_heads, max(1, capacity), info.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def reserve(self, length: int) -> None:
        """Grow (doubling) so positions ``< length`` fit; cached entries are kept."""
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        pad = (0, 0, 0, size - self.capacity)
        self.k, self.v = F.pad(self.k, pad), F.pad(self.v, pad)


@dataclass(frozen=True)
class TreeStep:
    """Where a drafter step's inputs sit when they are draft-tree nodes rather than a causal
    chain: ``positions`` ``[B, T]`` (rotary positions: the committed length + depth - 1),
    ``index`` ``[B, T]`` (the cache entries written, distinct per node, after the committed
    ones), ``visible`` bool ``[B, T, end]`` (the committed entries, the node's ancestors and
    itself) over the cache's first ``end`` entries."""

    positions: torch.Tensor
    index: torch.Tensor
    visible: torch.Tensor

    @property
    def end(self) -> int:
        return int(self.visible.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x.float() * scale).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, info: EagleInfo) -> None:
        super().__init__()
        h, d = info.hidden_size, info.head_dim
        self.info = info
        self.q_proj = nn.Linear(h, info.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, info.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, info.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(info.num_heads * d, h, bias=False)
        inv = 1.0 / (info.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, starts: torch.Tensor, kv: EagleKV, slots: torch.Tensor,
                tree: TreeStep | None = None) -> torch.Tensor:
        info = self.info  # x [B, T, H]; row b lives in cache row slots[b]
        b, t, _ = x.shape
        if tree is None:
            positions = starts[:, None] + torch.arange(t, device=x.device)  # [B, T]
            index, end = positions, int(starts.max()) + t
        else:
            positions, index, end = tree.positions, tree.index, tree.end
        angles = positions[..., None].float() * self.inv_freq  # [B, T, d/2]
        cos = torch.cat((angles, angles), -1).cos()[:, None].to(x.dtype)
        sin = torch.cat((angles, angles), -1).sin()[:, None].to(x.dtype)
        q = rotate(self.q_proj(x).view(b, t, info.num_heads, info.head_dim).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, info.num_kv_heads, info.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, info.num_kv_heads, info.head_dim).transpose(1, 2)
        kv.reserve(end)
        rows = slots[:, None]
        kv.k[rows, :, index] = k.transpose(1, 2).to(kv.k.dtype)  # write each row at its own cache entries
        kv.v[rows, :, index] = v.transpose(1, 2).to(kv.v.dtype)
        keys, values = kv.k[slots, :, :end], kv.v[slots, :, :end]  # [B, kv_heads, end, d]: the kernel groups the heads
        if tree is None:
            visible = torch.arange(end, device=x.device)[None, None, :] <= positions[..., None]  # [B, T, end]
        else:
            visible = tree.visible
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible[:, None],
                                             enable_gqa=info.num_heads != info.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, info.num_heads * info.head_dim))


class GatedMLP(nn.Module):
    def __init__(self, info: EagleInfo) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(info.hidden_size, info.intermediate_size, bias=False)
        self.up_proj = nn.Linear(info.hidden_size, info.intermediate_size, bias=False)
        self.down_proj = nn.Linear(info.intermediate_size, info.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A Llama decoder layer without the input norm (the drafter's first and only layer)."""

    def __init__(self, info: EagleInfo) -> None:
        super().__init__()
        self.self_attn = _Attention(info)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.mlp = GatedMLP(info)

    def forward(self, x: torch.Tensor, starts: torch.Tensor, kv: EagleKV, slots: torch.Tensor,
                tree: TreeStep | None = None) -> torch.Tensor:
        x = x + self.self_attn(x, starts, kv, slots, tree)
        return x + self.mlp(self.post_attention_layernorm(x))


class _KernelLinear(nn.Module):
    """An ``nn.Linear`` run on the target's row kernel, float32 weights in its panels: on one
    thread the kernel's small-row products cost about half of torch's ``F.linear`` (a drafted
    token's cost is mostly these products). It keeps the layer's ``weight`` and ``bias``
    parameters under their names (``state_dict`` unchanged); the kernel holds a packed copy
    made at construction, so later changes to the weights are not seen."""

    def __init__(self, linear: nn.Linear, kernel: RowGemm) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._gemm = kernel.bind(linear.weight.detach().contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        return self._gemm(x.reshape(-1, x.shape[-1])).view(*lead, self._gemm.n)


def use_row_kernel(net: nn.Module, kernel: RowGemm) -> None:
    """Run every ``nn.Linear`` of ``net`` on ``kernel`` (see :class:`_KernelLinear`), in place."""
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, _KernelLinear(child, kernel))


class EagleNet(nn.Module):
    def __init__(self, info: EagleInfo) -> None:
        super().__init__()
        self.info = info
        self.fc = nn.Linear(2 * info.hidden_size, info.hidden_size, bias=True)
        self.layers = nn.ModuleList([_Layer(info)])
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def use_kernel(self, kernel: RowGemm) -> None:
        """Run every linear layer on ``kernel`` (float32 CPU weights; see :class:`_KernelLinear`).
        Draft quality only: the products round differently from torch's, exactness is the verifier's."""
        use_row_kernel(self, kernel)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor,
                kv: EagleKV, slots: torch.Tensor | None = None, tree: TreeStep | None = None) -> torch.Tensor:
        """Predicted next features ``[B, T, H]`` for ``features`` ``[B, T, H]`` (the target's or
        the drafter's own at positions ``starts[b] + t``) and the embeddings ``[B, T, H]`` of the
        tokens that follow them. Row ``b`` uses cache row ``slots[b]`` (default ``b``) and attends
        to its cached positions ``< starts[b]``. ``tree``: the inputs are draft-tree nodes
        (:class:`TreeStep` places and masks them; ``starts`` is then unused)."""
        if slots is None:
            slots = torch.arange(features.shape[0], device=features.device)
        if features.ndim != 3 or features.shape != embeds.shape:
            raise ValueError(f"features {tuple(features.shape)} and embeds {tuple(embeds.shape)} must be [B, T, H]")
        x = self.fc(torch.cat((embeds, features), dim=-1))
        for layer in self.layers:
            x = layer(x, starts, kv, slots, tree)
        return x


@dataclass
class EagleCheckpoint:
    net: EagleNet
    candidate_vocab: torch.Tensor | None = None  # int64 token ids

    @property
    def info(self) -> EagleInfo:
        return self.net.info


def save_eagle(path: str | Path, net: EagleNet, candidate_vocab: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float16) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(dtype).contiguous() for k, v in net.state_dict().items()}
    if candidate_vocab is not None:
        tensors[CANDIDATE_VOCAB] = candidate_vocab.to(torch.int64).contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=net.info.metadata())
    return path


def eagle_file(path: str | Path) -> Path:
    """The drafter file: ``path`` itself or ``path/eagle.safetensors`` for a folder."""
    p = Path(path)
    return p / "eagle.safetensors" if p.is_dir() else p


def load_eagle(path: str | Path, dtype: torch.dtype = torch.float32) -> EagleCheckpoint:
    """A drafter written by :func:`save_eagle`; raises ModelLoadError on a bad file."""
    file = eagle_file(path)
    if not file.is_file():
        raise ModelLoadError(f"EAGLE drafter file {file} not found")
    meta, tensors = read_drafter_file(file, "the EAGLE drafter")
    try:
        info = EagleInfo.from_metadata(meta)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"bad EAGLE drafter metadata in {file}: {exc}") from exc
    vocab = tensors.pop(CANDIDATE_VOCAB, None)
    net = EagleNet(info)
    try:
        net.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"EAGLE drafter in {file} does not match its metadata: {exc}") from exc
    return EagleCheckpoint(net.to(dtype).eval(), vocab)
