"""Synthetic targets: a shipped model architecture with seeded random weights.

``synthetic:llama-3.1-8b`` and ``synthetic:smollm2-135m`` name configs the project ships
(``builder/model_configs/<name>/config.json``, read as a file: the runtime imports nothing of
``builder``). Their weights are drawn from a seeded generator on the device itself, in the
dtype asked for, so an 8B-shaped target appears on a GPU in a second without a byte of weights
travelling. What they serve: cost (a step's time does not depend on the weights' values) and
exactness checks (speculative decoding equals plain decoding for any weights). What they do not:
acceptance rates (random weights are not a language model).

:func:`synthetic_tensors` returns ``(config, tensors)`` with Hugging Face parameter names, the
input of :class:`~triton_backend.engines.torch.llama_forward.LlamaForward`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PREFIX = "synthetic:"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "builder" / "model_configs"
SYNTHETIC_NAMES = ("llama-3.1-8b", "smollm2-135m")


@dataclass(frozen=True)
class SyntheticSpec:
    """Which shipped architecture, and the overrides a CPU check shrinks it with."""

    name: str
    seed: int = 0
    layers: int | None = None  # keep only this many decoder layers
    vocab: int | None = None  # a smaller vocabulary (CPU checks)
    max_positions: int | None = None
    tiny: bool = False  # 64 wide, 4 heads (2 KV heads) of 16: the architecture's code path at CPU-test size


def is_synthetic(target: str) -> bool:
    return str(target).startswith(PREFIX)


def parse_target(target: str, *, seed: int = 0) -> SyntheticSpec:
    """``synthetic:NAME`` -> its spec; anything else is a typed error naming the choices."""
    if not is_synthetic(target):
        raise ValueError(f"not a synthetic target: {target!r} (expected {PREFIX}NAME)")
    name = target[len(PREFIX):]
    if name not in SYNTHETIC_NAMES:
        raise ValueError(f"unknown synthetic target {name!r}: one of {', '.join(SYNTHETIC_NAMES)}")
    return SyntheticSpec(name, seed)


def synthetic_config(spec: SyntheticSpec) -> Any:
    """The shipped config, with the spec's overrides applied."""
    from transformers import AutoConfig

    folder = CONFIG_DIR / spec.name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the config of synthetic target {spec.name!r} is not shipped at {folder}")
    config = AutoConfig.from_pretrained(folder)
    if spec.layers is not None:
        config.num_hidden_layers = int(spec.layers)
    if spec.vocab is not None:
        config.vocab_size = int(spec.vocab)
    if spec.tiny:
        config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
        config.num_attention_heads, config.num_key_value_heads = 4, 2
    if spec.max_positions is not None:
        config.max_position_embeddings = int(spec.max_positions)
    return config


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Llama ``config``."""
    hidden, inter, vocab = int(config.hidden_size), int(config.intermediate_size), int(config.vocab_size)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def synthetic_tensors(spec: SyntheticSpec, device: torch.device | str, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, tensors)``: every tensor drawn on ``device`` in ``dtype`` from one generator seeded
    with ``spec.seed`` (the same weights for the same seed, device and dtype). Linear weights are
    N(0, 1 / fan_in) so activations keep their scale through the layers; norms are ones plus a
    little noise; the embedding is N(0, 1)."""
    config = synthetic_config(spec)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, shape in tensor_shapes(config).items():
            t = torch.empty(shape, device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
            if len(shape) == 1:
                t.normal_(1.0, 0.05, generator=gen)
            elif name == "model.embed_tokens.weight":
                t.normal_(0.0, 1.0, generator=gen)
            else:
                t.normal_(0.0, shape[1] ** -0.5, generator=gen)
            tensors[name] = t.to(dtype)
    logger.info("synthetic target %s: %d tensors, %.2f GB in %s on %s", spec.name, len(tensors),
                sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9, dtype, device)
    return config, tensors


def weight_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes a one-row decode step reads from the weights: every tensor once (the embedding only
    one row of it, unless it is also the tied LM head)."""
    total = sum(t.numel() * t.element_size() for name, t in tensors.items() if name != "model.embed_tokens.weight")
    embed = tensors["model.embed_tokens.weight"]
    tied = "lm_head.weight" not in tensors
    return total + (embed.numel() * embed.element_size() if tied else embed.shape[1] * embed.element_size())


__all__ = ["PREFIX", "SYNTHETIC_NAMES", "SyntheticSpec", "is_synthetic", "parse_target", "synthetic_config",
           "synthetic_tensors", "tensor_shapes", "weight_bytes"]
