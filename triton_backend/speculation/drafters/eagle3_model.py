"""An EAGLE-3 drafter (Li et al. 2025) and its files, in the layout published EAGLE-3
checkpoints use.

The target's hidden states after three of its layers (low, mid, high; by default layers
``1, L//2 - 1, L - 4``, the layers TensorRT-LLM captures) are concatenated and fused:

    f_j   = fc(concat(h_low_j, h_mid_j, h_high_j))                     # [.., 3H] -> [.., H]
    x_j   = concat(input_layernorm(embed(token_{j+1})), hidden_norm(f_j))  # [.., 2H]
    g_j   = midlayer(x_j)            # one Llama layer whose attention reads 2H, residual on f_j
    token_{j+2} ~ lm_head(norm(g_j))                                      # the draft vocabulary

From the second draft step on, the drafter's own ``g`` stands in for ``f`` (training-time
test teaches it to). The LM head ranks a reduced draft vocabulary; ``d2t`` maps draft ids to
target ids (``target = draft + d2t[draft]``) and ``t2d`` marks the target ids it holds.

Files: a folder with ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` with ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d``. :func:`load_eagle3` also reads ``pytorch_model.bin`` folders and ``layers.0.``
names, and ignores an ``embed_tokens.weight`` equal in shape to the target's (the drafter
uses the target's embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from triton_backend.core.drafter_format import EAGLE3_ARCHITECTURE
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.llama_forward import rotate
from triton_backend.speculation.drafters.eagle_model import EagleKV, TreeStep, GatedMLP, RMSNorm

ARCHITECTURE = EAGLE3_ARCHITECTURE
WEIGHTS = "model.safetensors"


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, mid and high layers whose outputs are fused (TensorRT-LLM's default set)."""
    if num_layers <= 5:
        raise ValueError(f"EAGLE-3 needs a target with more than 5 layers, got {num_layers}")
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class Eagle3Info:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    capture_layers: tuple[int, ...] = (1, 14, 26)
    target_hidden_size: int = 0  # 0: hidden_size
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target: str = ""
    extra: dict = field(default_factory=dict)  # what the training run wants remembered

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.draft_vocab_size > self.vocab_size or not self.capture_layers:
            raise ValueError("draft_vocab_size must be <= vocab_size and capture_layers non-empty")

    @property
    def feature_size(self) -> int:
        return len(self.capture_layers) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_target_config(cls, config: Any, draft_vocab_size: int, capture_layers: tuple[int, ...] | None = None,
                           target: str = "") -> "Eagle3Info":
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        layers = tuple(capture_layers or default_capture_layers(int(config.num_hidden_layers)))
        return cls(hidden_size=int(config.hidden_size), num_heads=heads,
                   num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                   intermediate_size=int(config.intermediate_size), vocab_size=int(config.vocab_size),
                   draft_vocab_size=int(draft_vocab_size), capture_layers=layers,
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                   rope_theta=float(theta or getattr(config, "rope_theta", 10000.0)),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)), target=target)

    def config_json(self) -> dict[str, Any]:
        """``config.json`` as EAGLE-3 checkpoints ship it (a Llama config plus the draft fields)."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size or self.hidden_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
                "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.capture_layers),
                                 "use_aux_hidden_state": True},
                "specbuild": {"target": self.target, **self.extra}}

    @classmethod
    def from_config_json(cls, cfg: dict[str, Any], num_target_layers: int | None = None) -> "Eagle3Info":
        if ARCHITECTURE not in (cfg.get("architectures") or []) and "draft_vocab_size" not in cfg:
            raise ModelLoadError(f"not an EAGLE-3 config (architectures {cfg.get('architectures')})")
        heads = int(cfg["num_attention_heads"])
        eagle = cfg.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        if not layers:
            if num_target_layers is None:
                raise ModelLoadError("the EAGLE-3 config names no capture layers; give the target's layer count")
            layers = default_capture_layers(num_target_layers)
        own = cfg.get("specbuild") or {}
        return cls(hidden_size=int(cfg["hidden_size"]), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                   draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                   capture_layers=tuple(int(i) for i in layers),
                   target_hidden_size=_target_hidden(cfg),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)), target=str(own.get("target", "")),
                   extra={k: v for k, v in own.items() if k != "target"})


def _target_hidden(cfg: dict[str, Any]) -> int:
    size = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    return 0 if size == int(cfg["hidden_size"]) else size


class _Attention2H(nn.Module):
    """Llama attention whose q/k/v read the ``2H`` concatenation; ``extra_mask`` lets training
    attend across draft steps (training-time test)."""

    def __init__(self, info: Eagle3Info) -> None:
        super().__init__()
        h, d = info.hidden_size, info.head_dim
        self.info = info
        self.q_proj = nn.Linear(2 * h, info.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, info.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, info.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(info.num_heads * d, h, bias=False)
        inv = 1.0 / (info.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq  # [B, T, d/2]
        emb = torch.cat((angles, angles), -1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[B, heads, T, d]``, ``k``/``v`` ``[B, kv_heads, T, d]`` at ``positions`` ``[B, T]``."""
        info = self.info
        b, t, _ = x.shape
        cos, sin = self.rope(positions, x.dtype)
        q = rotate(self.q_proj(x).view(b, t, info.num_heads, info.head_dim).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, info.num_kv_heads, info.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, info.num_kv_heads, info.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``visible`` bool ``[B or 1, T, L]``; returns ``[B, T, H]``."""
        info = self.info
        # grouped-query attention in the kernel: no copy of the keys and values per query head
        # (the same values as repeat_interleave, bit for bit; measured 7x faster at one query row)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible[:, None],
                                             enable_gqa=info.num_heads != info.num_kv_heads)
        b, _, t, _ = q.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, info.num_heads * info.head_dim))


class Eagle3Net(nn.Module):
    stored_dtype: torch.dtype = torch.float32  # what its file stores (load_eagle3); the weights here are float32 or dtype

    def __init__(self, info: Eagle3Info) -> None:
        super().__init__()
        self.info = info
        h = info.hidden_size
        self.fc = nn.Linear(info.feature_size, h, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(h, info.rms_norm_eps)
        self.midlayer.hidden_norm = RMSNorm(h, info.rms_norm_eps)
        self.midlayer.self_attn = _Attention2H(info)
        self.midlayer.post_attention_layernorm = RMSNorm(h, info.rms_norm_eps)
        self.midlayer.mlp = GatedMLP(info)  # type: ignore[arg-type]  # reads hidden/intermediate sizes only
        self.norm = RMSNorm(h, info.rms_norm_eps)
        self.lm_head = nn.Linear(h, info.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(info.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(info.vocab_size, dtype=torch.bool))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``draft_ids`` (ascending target ids) -> ``d2t``/``t2d``."""
        ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        if ids.numel() != self.info.draft_vocab_size or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"need {self.info.draft_vocab_size} ascending distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft: torch.Tensor) -> torch.Tensor:
        return draft + self.d2t[draft]

    def target_to_draft(self, target: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids (``-1`` where the draft vocabulary lacks the token)."""
        index = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d[target], index[target], torch.full_like(target, -1))

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        m = self.midlayer
        return torch.cat((m.input_layernorm(embeds), m.hidden_norm(hidden)), dim=-1)

    def block_out(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's residual stream after attention ``attn`` (residual on ``hidden``)."""
        x = hidden + attn
        return x + self.midlayer.mlp(self.midlayer.post_attention_layernorm(x))

    def logits(self, g: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., draft_vocab]
        return self.lm_head(self.norm(g))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                tree: TreeStep | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Inference: ``hidden`` ``[B, T, H]`` (``fc`` of the target's fused features, or the
        drafter's own ``g``) and the following tokens' embeddings ``[B, T, H]`` at positions
        ``starts[b] + t``; row ``b`` uses cache row ``slots[b]`` (default ``b``), which holds
        positions ``< starts[b]``. Returns ``g`` ``[B, T, H]``.
        ``tree``: the inputs are draft-tree nodes (placed and masked as in the EAGLE-1 net)."""
        attn_mod = self.midlayer.self_attn
        b, t, _ = hidden.shape
        if tree is None:
            positions = starts[:, None] + torch.arange(t, device=hidden.device)
            index, end = positions, int(starts.max()) + t
            visible = torch.arange(end, device=hidden.device)[None, None, :] <= positions[..., None]
        else:
            positions, index, end, visible = tree.positions, tree.index, tree.end, tree.visible
        q, k, v = attn_mod.qkv(self.layer_input(hidden, embeds), positions)
        kv.reserve(end)
        slots = torch.arange(b, device=hidden.device) if slots is None else slots
        rows = slots[:, None]
        kv.k[rows, :, index] = k.transpose(1, 2).to(kv.k.dtype)
        kv.v[rows, :, index] = v.transpose(1, 2).to(kv.v.dtype)
        attn = attn_mod.attend(q, kv.k[slots, :, :end], kv.v[slots, :, :end], visible)
        return self.block_out(hidden, attn)


def save_eagle3(folder: str | Path, net: Eagle3Net, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (the published EAGLE-3 layout)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in net.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(net.info.config_json(), indent=2) + "\n")
    return out


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS).is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(folder / WEIGHTS))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"EAGLE-3 weights {folder / WEIGHTS} are unreadable: {exc}") from exc
    if (folder / "pytorch_model.bin").is_file():
        try:
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle/zip errors of a bad file
            raise ModelLoadError(f"EAGLE-3 weights {folder / 'pytorch_model.bin'} are unreadable: {exc}") from exc
    raise ModelLoadError(f"{folder} has neither {WEIGHTS} nor pytorch_model.bin")


def load_eagle3(folder: str | Path, dtype: torch.dtype = torch.float32, *,
                num_target_layers: int | None = None) -> Eagle3Net:
    """An EAGLE-3 drafter folder (ours or a published one); ModelLoadError on a bad one."""
    root = Path(folder)
    config = root / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"EAGLE-3 drafter {root}: config.json not found")
    try:
        info = Eagle3Info.from_config_json(json.loads(config.read_text()), num_target_layers)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"bad EAGLE-3 config {config}: {exc}") from exc
    tensors = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in _read_tensors(root).items()}
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (info.vocab_size, info.hidden_size):
        raise ModelLoadError(f"{root}: embed_tokens {tuple(embed.shape)} does not match the config")
    net = Eagle3Net(info)
    if "d2t" not in tensors:  # a drafter over the whole vocabulary
        if info.draft_vocab_size != info.vocab_size:
            raise ModelLoadError(f"{root}: a reduced draft vocabulary needs d2t")
        net.set_vocab(torch.arange(info.vocab_size))
        tensors["d2t"], tensors["t2d"] = net.d2t, net.t2d
    ids = torch.arange(info.draft_vocab_size) + tensors["d2t"].long()
    if tensors["d2t"].shape != (info.draft_vocab_size,) or bool((ids < 0).any() | (ids >= info.vocab_size).any()):
        raise ModelLoadError(f"EAGLE-3 drafter {root}: d2t does not describe a vocabulary map into {info.vocab_size} ids")
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(info.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    try:
        net.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"EAGLE-3 drafter {root} does not match its config: {exc}") from exc
    if not bool(net.t2d[ids].all()) or int(net.t2d.sum()) != info.draft_vocab_size:
        raise ModelLoadError(f"EAGLE-3 drafter {root}: d2t/t2d do not describe one vocabulary map")
    net = net.to(dtype).eval()
    stored = {v.dtype for k, v in tensors.items() if v.is_floating_point() and k.endswith(".weight")}
    net.stored_dtype = stored.pop() if len(stored) == 1 else torch.float32  # the file's own precision, if one
    return net


__all__ = ["ARCHITECTURE", "Eagle3Info", "Eagle3Net", "default_capture_layers", "load_eagle3", "save_eagle3"]
