"""The build spec: what to build, for which GPUs, within which limits.

Read from a YAML or TOML file (:meth:`BuildSpec.load`) or built from CLI flags; every
field is validated at construction and a bad value raises :class:`BuildSpecError`.

Example (YAML)::

    target: {source: smollm2-135m-instruct, precision: auto}
    draft: {source: /models/draft, precision: auto}   # or: draft: self  /  {source: self, precision: int8_sq}
    gpu: {kind: h100-80gb, count: 1}
    limits: {max_batch_size: 8, max_input_len: 2048, max_output_len: 512, max_draft_len: 4}
    kv_cache_dtype: auto
    parallel: {tp_size: auto, pp_size: 1}
    calibration: {num_samples: 32, max_length: 256}
    quality: {min_agreement: 0.9, max_ppl_ratio: 1.1}   # or enabled: false
"""

from __future__ import annotations

import enum
import json
import math
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from builder.errors import BuildSpecError
from triton_backend.core.config_io import read_config, to_plain


class Precision(str, enum.Enum):
    """Weight precision of one model. ``auto``: the planner picks the best that fits."""

    AUTO = "auto"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8_SQ = "int8_sq"
    INT4_AWQ = "int4_awq"

    @property
    def is_float(self) -> bool:
        return self in (Precision.FP16, Precision.BF16)

    @property
    def is_quantized(self) -> bool:
        return self in (Precision.FP8, Precision.INT8_SQ, Precision.INT4_AWQ)


class KVCacheDtype(str, enum.Enum):
    """Element type of the KV cache. ``auto``: 16-bit unless memory asks for 8-bit."""

    AUTO = "auto"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"

    @property
    def bytes(self) -> int:
        if self is KVCacheDtype.AUTO:
            raise ValueError("auto has no size; resolve it first")
        return 2 if self is KVCacheDtype.FP16 else 1


class TorchDtype(str, enum.Enum):
    """What the torch runtime computes in. ``auto``: float32 on CPU (16-bit matmuls are
    slower there), the model's 16-bit precision on CUDA."""

    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


def _enum(cls: type[enum.Enum], value: Any, name: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower())
    except ValueError:
        raise BuildSpecError(f"{name}: unknown value {value!r}; expected one of: "
                             f"{', '.join(m.value for m in cls)}") from None


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildSpecError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BuildSpecError(message)


SELF_DRAFT = "self"  # a draft's source: the target itself at the draft's precision (a folder named so: ./self)


@dataclass(frozen=True)
class ModelSpec:
    """A model: a reference name, a HF directory, a .safetensors file's directory or a .gguf
    file, or one of the builder's architecture-only configs (plan only). A draft's source may be
    ``self``: the target's own weights at the draft's precision (``auto``: the best quantized one
    that fits), ``layers`` of them when given (evenly spaced from layer 0; torch runtime only)."""

    source: str
    precision: Precision = Precision.AUTO
    layers: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.source, str) and self.source.strip() != "", "a model needs a non-empty source")
        object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        if self.layers is not None:
            _positive_int(self.layers, "layers")
            _check(self.is_self, f"layers (a self draft's layer count) needs source {SELF_DRAFT!r}, got {self.source!r}")

    @property
    def is_self(self) -> bool:
        return self.source == SELF_DRAFT


@dataclass(frozen=True)
class MedusaSpec:
    """Medusa heads on the target: ``num_heads`` heads of ``num_layers`` residual blocks,
    each with its own LM head. ``source``: trained heads (a .safetensors file of
    ``medusa_heads.*`` tensors); planning needs none, building does."""

    num_heads: int = 4
    num_layers: int = 1
    source: str | None = None

    def __post_init__(self) -> None:
        _positive_int(self.num_heads, "medusa.num_heads")
        _positive_int(self.num_layers, "medusa.num_layers")


@dataclass(frozen=True)
class EagleSpec:
    """An EAGLE drafter on the target (``specbuild train-eagle``): TensorRT-LLM runs
    ``num_eagle_layers`` EagleNets (one per draft-tree level), each one decoder layer plus a copy
    of the target's embedding and LM head. ``source``: the drafter file; planning needs none."""

    num_eagle_layers: int = 4
    source: str | None = None

    def __post_init__(self) -> None:
        _positive_int(self.num_eagle_layers, "eagle.num_eagle_layers")


@dataclass(frozen=True)
class GpuTarget:
    kind: str = "h100-80gb"
    count: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.kind, str) and self.kind != "", "gpu.kind must be a GPU name")
        _positive_int(self.count, "gpu.count")


@dataclass(frozen=True)
class Limits:
    """Engine limits. Each sequence holds up to max_input_len + max_output_len tokens, plus
    max_draft_len unverified draft tokens while the target verifies them."""

    max_batch_size: int = 8
    max_input_len: int = 2048
    max_output_len: int = 512
    max_draft_len: int = 4
    max_num_tokens: int = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive_int(getattr(self, f.name), f"limits.{f.name}")
        _check(self.max_draft_len <= 64, f"limits.max_draft_len must be <= 64, got {self.max_draft_len}")

    @property
    def max_seq_len(self) -> int:
        return self.max_input_len + self.max_output_len


@dataclass(frozen=True)
class Parallelism:
    """``tp_size``: tensor parallel size, ``None`` = the planner picks (up to the GPU count)."""

    tp_size: int | None = None
    pp_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, str):
            _check(self.tp_size.strip().lower() == "auto", f"parallel.tp_size must be an integer or 'auto', got {self.tp_size!r}")
            object.__setattr__(self, "tp_size", None)
        if self.tp_size is not None:
            _positive_int(self.tp_size, "parallel.tp_size")
            _check(self.tp_size & (self.tp_size - 1) == 0, f"parallel.tp_size must be a power of two, got {self.tp_size}")
        _positive_int(self.pp_size, "parallel.pp_size")


@dataclass(frozen=True)
class CalibrationSpec:
    """Calibration texts for quantization: ``text_file`` holds samples separated by blank
    lines (``None``: the set shipped with specbuild)."""

    text_file: str | None = None
    num_samples: int = 32
    max_length: int = 256

    def __post_init__(self) -> None:
        _positive_int(self.num_samples, "calibration.num_samples")
        _positive_int(self.max_length, "calibration.max_length")


@dataclass(frozen=True)
class QualitySpec:
    """The build's quality stage (``builder.stages.quality``): each quantized model, served as its
    deployment serves it, against its float32 original -- teacher-forced greedy agreement over
    ``prompts`` held-out prompts x ``max_tokens`` tokens and perplexity on ``text_tokens`` tokens of a
    held-out text (``text_file``; ``None``: the one shipped with specbuild). A model whose agreement
    is below ``min_agreement`` or whose perplexity ratio is above ``max_ppl_ratio`` gets a warning.
    Defaults: 0.9 agreement and +10% perplexity, bounds that near-lossless 8-bit weights pass and a
    noticeably degraded quantization does not."""

    enabled: bool = True
    prompts: int = 8
    max_tokens: int = 32
    text_file: str | None = None
    text_tokens: int = 1024
    window: int = 256
    min_agreement: float = 0.9
    max_ppl_ratio: float = 1.10

    def __post_init__(self) -> None:
        _check(isinstance(self.enabled, bool), f"quality.enabled must be true or false, got {self.enabled!r}")
        for name in ("prompts", "max_tokens", "text_tokens", "window"):
            _positive_int(getattr(self, name), f"quality.{name}")
        _check(self.window >= 2, f"quality.window must be at least 2 tokens, got {self.window}")
        _check(_number(self.min_agreement) and 0 <= self.min_agreement <= 1,
               f"quality.min_agreement must be a number in [0, 1], got {self.min_agreement!r}")
        _check(_number(self.max_ppl_ratio) and self.max_ppl_ratio >= 1,
               f"quality.max_ppl_ratio must be a number >= 1, got {self.max_ppl_ratio!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TorchRuntimeSpec:
    device: str = "cpu"
    dtype: TorchDtype = TorchDtype.AUTO

    def __post_init__(self) -> None:
        _check(self.device == "cpu" or self.device.startswith("cuda"), f"torch_runtime.device must be cpu or cuda[:N], got {self.device!r}")
        object.__setattr__(self, "dtype", _enum(TorchDtype, self.dtype, "torch_runtime.dtype"))


@dataclass(frozen=True)
class BuildSpec:
    target: ModelSpec
    draft: ModelSpec | None = None
    medusa: MedusaSpec | None = None
    eagle: EagleSpec | None = None
    gpu: GpuTarget = field(default_factory=GpuTarget)
    limits: Limits = field(default_factory=Limits)
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    parallel: Parallelism = field(default_factory=Parallelism)
    workspace_gib: float = 2.0
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    torch_runtime: TorchRuntimeSpec = field(default_factory=TorchRuntimeSpec)
    quality: QualitySpec = field(default_factory=QualitySpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", _enum(KVCacheDtype, self.kv_cache_dtype, "kv_cache_dtype"))
        _check(isinstance(self.workspace_gib, (int, float)) and not isinstance(self.workspace_gib, bool)
               and 0 <= self.workspace_gib < 1024, f"workspace_gib must be a number in [0, 1024), got {self.workspace_gib!r}")
        _check(not (self.draft is not None and self.medusa is not None),
               "give a draft model or Medusa heads, not both: TensorRT-LLM builds the target engine for one "
               "speculative decoding mode (draft_tokens_external or medusa)")
        _check(not self.target.is_self, f"the target cannot be {SELF_DRAFT!r} (a draft's source)")
        _check(self.eagle is None or (self.draft is None and self.medusa is None),
               "give an EAGLE drafter alone: TensorRT-LLM builds the target engine for one speculative decoding mode")

    # ---- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BuildSpec":
        """From a mapping of sections (a parsed spec file); ``target``/``draft`` may be just a source."""
        if not isinstance(data, Mapping):
            raise BuildSpecError("a build spec must be a mapping of sections")
        _check("target" in data, "the build spec needs a target")
        data = {key: ModelSpec(source=value) if key in ("target", "draft") and isinstance(value, str) else value
                for key, value in data.items()}
        return read_config(cls, data, "build spec", BuildSpecError)

    @classmethod
    def load(cls, path: str | Path) -> "BuildSpec":
        path = Path(path)
        if not path.is_file():
            raise BuildSpecError(f"build spec {path} not found")
        text = path.read_text()
        suffix = path.suffix.lower()
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif suffix == ".toml":
                data = _toml_loads(text)
            elif suffix == ".json":
                data = json.loads(text)
            else:
                raise BuildSpecError(f"build spec {path.name}: expected a .yaml, .yml, .toml or .json file")
        except BuildSpecError:
            raise
        except Exception as exc:  # the YAML/TOML/JSON parsers raise their own error types
            raise BuildSpecError(f"could not parse {path.name}: {exc}") from None
        return cls.from_dict(data or {})

    def with_overrides(self, **changes: Any) -> "BuildSpec":
        """A copy with top-level fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _toml_loads(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)
