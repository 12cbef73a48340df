"""Model shapes from a model's config alone (no weights), and the sources the planner reads.

Sources are what the core loads (a reference model name, a HF directory, a .gguf file) plus
the builder's architecture-only configs (``llama-3-70b``, ``llama-3-8b``, ``llama-3.2-1b``):
config.json files written for this project from the public architecture numbers, so a 70B
deployment can be planned on a machine that could never hold its weights. They have no
weights and no tokenizer: plan only.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from builder.errors import UnsupportedModelError
from triton_backend.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

CONFIG_ONLY_DIR = Path(__file__).parents[1] / "model_configs"
CONFIG_ONLY_MODELS: dict[str, Path] = {
    "llama-3-70b": CONFIG_ONLY_DIR / "llama-3-70b",
    "llama-3-8b": CONFIG_ONLY_DIR / "llama-3-8b",
    "llama-3.2-1b": CONFIG_ONLY_DIR / "llama-3.2-1b",
}


class DecoderType(str, enum.Enum):
    """The ``decoder_type`` modelopt's TensorRT-LLM export takes, per HF ``model_type``."""

    LLAMA = "llama"
    QWEN = "qwen"


_DECODER_TYPES: dict[str, DecoderType] = {
    "llama": DecoderType.LLAMA,
    "mistral": DecoderType.LLAMA,
    "qwen2": DecoderType.QWEN,
}


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder block: ``in_features -> out_features``.
    ``row_parallel``: split along its input under tensor parallelism (else its output)."""

    name: str
    in_features: int
    out_features: int
    row_parallel: bool

    @property
    def params(self) -> int:
        return self.in_features * self.out_features

    def shard(self, tp: int) -> "Linear":
        if self.row_parallel:
            return Linear(self.name, self.in_features // tp, self.out_features, True)
        return Linear(self.name, self.in_features, self.out_features // tp, False)


@dataclass(frozen=True)
class ModelArchitecture:
    """The numbers that size a decoder-only transformer."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    dtype: str = "float16"

    @property
    def decoder_type(self) -> DecoderType:
        return _DECODER_TYPES[self.model_type]

    @property
    def float_precision(self) -> str:
        """The 16-bit float format the model is served in: bf16 for bf16 models, else fp16."""
        return "bf16" if self.dtype == "bfloat16" else "fp16"

    def layer_linears(self) -> tuple[Linear, ...]:
        """The linears of one decoder block as TensorRT-LLM fuses them (qkv, gate+up)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * hd
        return (
            Linear("attention.qkv", h, qkv_out, False),
            Linear("attention.dense", self.num_heads * hd, h, True),
            Linear("mlp.gate_up", h, 2 * i, False),
            Linear("mlp.proj", i, h, True),
        )

    # ---- parameter counts (whole model) --------------------------------------------------
    @property
    def linear_params(self) -> int:
        """Weights of every decoder-block linear (what INT4/INT8/FP8 quantize)."""
        return self.num_layers * sum(lin.params for lin in self.layer_linears())

    @property
    def linear_out_channels(self) -> int:
        """Output channels summed over every decoder-block linear (per-channel scales)."""
        return self.num_layers * sum(lin.out_features for lin in self.layer_linears())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Counted even when the HF model ties it to the embedding: the TensorRT-LLM
        checkpoint stores the LM head as its own tensor (modelopt writes
        ``share_embedding_table: false``), so the engine holds both."""
        return self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def bias_params(self) -> int:
        return self.num_layers * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0

    @property
    def unquantized_params(self) -> int:
        """Kept in 16-bit at every precision: embedding, LM head, norms, biases."""
        return self.embedding_params + self.lm_head_params + self.norm_params + self.bias_params

    @property
    def total_params(self) -> int:
        return self.linear_params + self.unquantized_params

    @property
    def hf_params(self) -> int:
        """Parameters as the HF model counts them (a tied LM head once)."""
        return self.total_params - (self.lm_head_params if self.tie_word_embeddings else 0)

    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(total_params=self.total_params, linear_params=self.linear_params)
        return data

    @classmethod
    def from_config(cls, config: Any) -> "ModelArchitecture":
        model_type = str(getattr(config, "model_type", ""))
        if model_type not in _DECODER_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported by the builder; supported: {sorted(_DECODER_TYPES)}")
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float16"
        return cls(
            model_type=model_type, hidden_size=hidden, num_layers=int(config.num_hidden_layers),
            num_heads=heads, num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim), intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size), tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 0) or 0),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            dtype=str(dtype).replace("torch.", ""),
        )


def is_config_only(source: str) -> bool:
    return source in CONFIG_ONLY_MODELS


def load_source_config(source: str) -> Any:
    """The HF config of a source (config-only names included), without loading weights."""
    from transformers import AutoConfig

    from triton_backend.engines.torch.model_loading import load_config

    if source in CONFIG_ONLY_MODELS:
        return AutoConfig.from_pretrained(CONFIG_ONLY_MODELS[source])
    try:
        return load_config(source)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers raises several types for unreadable configs
        raise ModelLoadError(f"could not read the config of {source!r}: {exc}") from exc


def load_architecture(source: str) -> ModelArchitecture:
    return ModelArchitecture.from_config(load_source_config(source))
