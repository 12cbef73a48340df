"""Medusa-1 heads (Cai et al. 2024) and their file format.

Head ``i`` reads the target's last hidden state ``h`` at a position (after the final norm)
and predicts the token ``i + 2`` positions ahead: ``num_layers`` residual blocks
``x + SiLU(W x + b)``, then an LM head. The LM head is the target's own (``shared_lm_head``,
the default: nothing but the blocks to train and store) or the head's own.

One ``.safetensors`` file holds the heads in TensorRT-LLM's names
(``medusa_heads.<i>.medusa_layers.<j>.linear.{weight,bias}``, ``medusa_heads.<i>.lm_head.weight``
when not shared), optionally ``medusa_candidate_vocab`` (int64 token ids: the runtime ranks
each head's candidates over these only, which makes a shared head cheap), and its settings
as string metadata (``format = specbuild-medusa``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from triton_backend.speculation.drafters.drafter_file import read_drafter_file
from triton_backend.core.errors import ModelLoadError
from triton_backend.core.tree import DEFAULT_MEDUSA_CHOICES, Choices, normalise_choices

FORMAT = "specbuild-medusa"
CANDIDATE_VOCAB = "medusa_candidate_vocab"


@dataclass(frozen=True)
class MedusaHeadsInfo:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = True
    medusa_choices: Choices | None = None  # None: the default tree, cut to num_heads levels
    target: str = ""
    head_accuracy: tuple[float, ...] = ()  # held-out top-1 accuracy per head, when measured

    def __post_init__(self) -> None:
        choices = self.medusa_choices
        if choices is None:
            choices = tuple(c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= self.num_heads)
        object.__setattr__(self, "medusa_choices", normalise_choices(choices))
        object.__setattr__(self, "head_accuracy", tuple(float(a) for a in self.head_accuracy))
        deepest = max(len(c) for c in self.medusa_choices)
        if deepest > self.num_heads:
            raise ValueError(f"medusa_choices go {deepest} levels deep but there are {self.num_heads} heads")

    def metadata(self) -> dict[str, str]:
        data = asdict(self)
        return {"format": FORMAT, **{k: json.dumps(v) for k, v in data.items()}}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "MedusaHeadsInfo":
        if meta.get("format") != FORMAT:
            raise ModelLoadError(f"not a {FORMAT} heads file (format {meta.get('format')!r})")
        known = set(cls.__dataclass_fields__)
        values = {k: json.loads(v) for k, v in meta.items() if k in known}
        if values.get("medusa_choices") is not None:
            values["medusa_choices"] = tuple(tuple(c) for c in values["medusa_choices"])
        return cls(**values)


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_layers: int, own_lm_head: bool) -> None:
        super().__init__()
        self.medusa_layers = nn.ModuleList([ResBlock(hidden) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden, vocab, bias=False) if own_lm_head else None

    def features(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        for layer in self.medusa_layers:
            hidden = layer(hidden)
        return hidden


class MedusaHeads(nn.Module):
    def __init__(self, info: MedusaHeadsInfo) -> None:
        super().__init__()
        self.info = info
        self.medusa_heads = nn.ModuleList([
            MedusaHead(info.hidden_size, info.vocab_size, info.num_layers, not info.shared_lm_head)
            for _ in range(info.num_heads)])

    def logits(self, hidden: torch.Tensor, shared_weight: torch.Tensor | None, count: int | None = None,
               project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``hidden`` [..., H] -> ``[count, ..., V']`` from the first ``count`` heads (default all);
        ``shared_weight`` [V', H] is the target's LM head (or a subset of its rows) when the heads share it.
        The heads that share it are multiplied by it in one product (the weight read once for all of
        them), on ``project`` (``[M, H] -> [M, V']`` float32, e.g. the row kernel bound to that weight) where given."""
        heads = list(self.medusa_heads)[:count]
        feats = [head.features(hidden) for head in heads]
        out: list[torch.Tensor | None] = [None if head.lm_head is None else f @ head.lm_head.weight.t()
                                          for head, f in zip(heads, feats)]
        shared = [i for i, head in enumerate(heads) if head.lm_head is None]
        if shared:
            if shared_weight is None and project is None:
                raise ValueError("these heads share the target's LM head: pass its weight")
            stacked = torch.stack([feats[i] for i in shared])  # [n, ..., H]
            flat = stacked.reshape(-1, stacked.shape[-1])
            products = project(flat.float().contiguous()).to(flat.dtype) if project is not None else flat @ shared_weight.t()
            products = products.view(*stacked.shape[:-1], -1)
            for j, i in enumerate(shared):
                out[i] = products[j]
        return torch.stack(out)  # type: ignore[arg-type]  # every entry filled above


@dataclass
class MedusaCheckpoint:
    heads: MedusaHeads
    candidate_vocab: torch.Tensor | None = None  # int64 token ids
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def info(self) -> MedusaHeadsInfo:
        return self.heads.info


def save_medusa(path: str | Path, heads: MedusaHeads, candidate_vocab: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float16) -> Path:
    from safetensors.torch import save_file

    tensors = {f"medusa_heads.{k}": v.detach().to(dtype).contiguous() for k, v in heads.medusa_heads.state_dict().items()}
    if candidate_vocab is not None:
        tensors[CANDIDATE_VOCAB] = candidate_vocab.to(torch.int64).contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=heads.info.metadata())
    return path


def load_medusa(path: str | Path, dtype: torch.dtype = torch.float32) -> MedusaCheckpoint:
    """Heads from a file written by :func:`save_medusa`; raises ModelLoadError on a bad file."""
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"Medusa heads file {file} not found")
    meta, tensors = read_drafter_file(file, "Medusa heads")
    try:
        info = MedusaHeadsInfo.from_metadata(meta)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"bad Medusa heads metadata in {file}: {exc}") from exc
    vocab = tensors.pop(CANDIDATE_VOCAB, None)
    heads = MedusaHeads(info)
    state = {k[len("medusa_heads."):]: v.to(dtype) for k, v in tensors.items()}
    try:
        heads.medusa_heads.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"Medusa heads in {file} do not match their metadata: {exc}") from exc
    return MedusaCheckpoint(heads.eval(), vocab)
