"""A deployment's typed configuration: which target, which drafters, how they run.

This is what the Triton model reads from its repository (``deployment.json``), what the
builder renders and what the local ``specbuild run`` builds from flags. Plain data, no torch:
:func:`triton_backend.deployment.torch_deployment.build_decoder` turns it into a decoder. A bad file or field
raises :class:`~triton_backend.core.errors.ConfigError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton_backend.core.config import SpeculationConfig, SpeculationMode
from triton_backend.core.runtime_config import DraftContext, RuntimeConfig, WeightPrecision
from triton_backend.core.config_io import read_config, to_plain
from triton_backend.core.drafter_format import EagleFormat, detect_eagle_format
from triton_backend.engines.trtllm.trtllm_config import EngineRuntime, TrtllmConfig
from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import DEFAULT_REFERENCE


@dataclass(frozen=True)
class SelfDraftConfig:
    """The target as its own draft: the target's already-loaded model served a second time with
    its linear weights (and LM head) in ``precision`` (quantized at load, round to nearest), and
    optionally only ``layers`` of its decoder layers (layer 0 among them). Same tokenizer by
    construction, no second model to load; the draft shares the embedding and norms.

    ``precision`` int8 (the default) agrees with float32's greedy token ~97 % of the time on the
    reference model at ~2.3x the speed of a float32 step; int4 is faster but agrees far less.

    ``context``: where the draft's keys and values of the committed tokens come from
    (:class:`DraftContext`; the default ``committed`` copies the prompt's from the target's
    prefill instead of prefilling it through the draft, then each round the verified positions the
    draft lacks; a layer-skip draft takes each kept layer's from that target layer). ``stop_below``: a round stops drafting after a token the draft itself gave a top-1
    probability below this (0: always draft the round's length), so doubtful positions cost no
    draft step. Neither changes the output (every draft token is verified)."""

    precision: WeightPrecision = WeightPrecision.INT8
    layers: tuple[int, ...] | None = None
    context: DraftContext = DraftContext.COMMITTED
    stop_below: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "precision", WeightPrecision(self.precision))
        except ValueError:
            raise ConfigError(f"self_draft precision must be one of {[w.value for w in WeightPrecision]}, "
                              f"got {self.precision!r}") from None
        if self.layers is not None:
            if not (isinstance(self.layers, (list, tuple)) and self.layers and all(_is_index(i) for i in self.layers)):
                raise ConfigError(f"self_draft layers must be a non-empty list of layer indices, got {self.layers!r}")
            layers = tuple(sorted(set(self.layers)))
            if layers[0] != 0:
                raise ConfigError(f"self_draft layers must include layer 0, got {list(layers)}")
            object.__setattr__(self, "layers", layers)
        try:
            object.__setattr__(self, "context", DraftContext(self.context))
        except ValueError:
            raise ConfigError(f"self_draft context must be one of {[c.value for c in DraftContext]}, "
                              f"got {self.context!r}") from None
        stop = self.stop_below
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0.0 <= stop < 1.0:
            raise ConfigError(f"self_draft stop_below must be a probability in [0, 1), got {stop!r}")
        object.__setattr__(self, "stop_below", float(stop))

    def label(self) -> str:
        """A short name: ``self-int8`` or ``self-int8[10 layers]``."""
        return f"self-{self.precision.value}" + ("" if self.layers is None else f"[{len(self.layers)} layers]")


@dataclass(frozen=True)
class DeploymentConfig:
    """``target``/``draft``: a reference model name, a HF directory or a .gguf file.
    ``draft_layers``: instead of a separate draft, a self-speculative draft made of these
    target layers (float, as the target's). ``self_draft``: the target as its own draft at another
    weight precision (:class:`SelfDraftConfig`); one of ``draft``, ``draft_layers``, ``self_draft``. ``ngram``: offer n-gram lookup. ``medusa``: a Medusa heads file (see
    :mod:`triton_backend.speculation.drafters.medusa_model`) for the target; ``medusa_choices`` overrides its tree.
    ``eagle``: an EAGLE drafter: an EAGLE-1 file or folder (see
    :mod:`triton_backend.speculation.drafters.eagle_model`) or an EAGLE-3 folder (see
    :mod:`triton_backend.speculation.drafters.eagle3_model`); ``eagle_format`` says which
    (None: read from the drafter's files, :func:`~triton_backend.core.drafter_format.detect_eagle_format`).
    ``engine_runtime``: ``torch`` serves ``target``/``draft`` with torch; ``trtllm`` serves the
    compiled TensorRT-LLM engines named in ``trtllm`` (``target`` then gives the tokenizer).
    ``target_checkpoint``/``draft_checkpoint``: a TensorRT-LLM checkpoint folder (any TP, PP = 1) whose
    linear weights the torch runtime serves as exported (int4, int8, fp8, 16-bit; see
    ``engines/torch/trtllm_weights.py``); ``target``/``draft`` still give config, tokenizer and the
    float tensors. Without one, ``runtime.weights`` quantizes the float weights at load."""

    target: str = DEFAULT_REFERENCE
    draft: str | None = None
    draft_layers: tuple[int, ...] | None = None
    self_draft: SelfDraftConfig | None = None
    ngram: bool = True
    medusa: str | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    eagle: str | None = None
    eagle_format: EagleFormat | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    engine_runtime: EngineRuntime = EngineRuntime.TORCH
    trtllm: TrtllmConfig | None = None
    target_checkpoint: str | None = None
    draft_checkpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_runtime", EngineRuntime.parse(self.engine_runtime))
        if self.eagle_format is not None:
            object.__setattr__(self, "eagle_format", EagleFormat.parse(self.eagle_format))
        if self.engine_runtime is EngineRuntime.TRTLLM and self.trtllm is None:
            raise ConfigError("engine_runtime trtllm needs a trtllm section naming the compiled engines")
        if self.draft is not None and self.draft_layers is not None:
            raise ConfigError("give either a draft model or draft_layers, not both")
        if self.self_draft is not None:
            if not isinstance(self.self_draft, SelfDraftConfig):
                raise ConfigError("self_draft must be a SelfDraftConfig")
            if self.draft is not None or self.draft_layers is not None:
                raise ConfigError("give one draft: a draft model, draft_layers or self_draft")
            if self.engine_runtime is EngineRuntime.TRTLLM:
                raise ConfigError("self_draft runs on the torch runtime; a trtllm deployment names its draft engine "
                                  "in the trtllm section")
            if self.self_draft.layers is None and self.self_draft.precision is self.runtime.weights:
                raise ConfigError(f"self_draft at the target's own precision ({self.runtime.weights.value}) with all "
                                  "its layers is the target itself: pick a cheaper precision or fewer layers")
        if self.draft_checkpoint is not None and self.draft is None:
            raise ConfigError("draft_checkpoint needs the draft model it belongs to (draft)")
        if self.draft_layers is not None:
            object.__setattr__(self, "draft_layers", tuple(int(i) for i in self.draft_layers))
        if self.medusa_choices is not None:
            from triton_backend.core.tree import normalise_choices

            try:
                object.__setattr__(self, "medusa_choices", normalise_choices(self.medusa_choices))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"bad medusa_choices: {exc}") from None

        preferred = self.speculation.auto_drafter if isinstance(self.speculation, SpeculationConfig) else None
        if preferred is not None and self.engine_runtime is EngineRuntime.TORCH and preferred not in self.model_drafters():
            deployed = ", ".join(m.value for m in self.model_drafters()) or "none"
            raise ConfigError(f"speculation auto_drafter {preferred.value!r} is not deployed (model drafters: {deployed})")

    def model_drafters(self) -> list[SpeculationMode]:
        """The model drafters a torch deployment serves (``auto``'s choices beside n-gram lookup)."""
        have = [(SpeculationMode.EAGLE, self.eagle), (SpeculationMode.MEDUSA, self.medusa),
                (SpeculationMode.DRAFT, self.draft or self.draft_layers or self.self_draft)]
        return [mode for mode, given in have if given]

    def resolved_eagle_format(self) -> EagleFormat | None:
        """The EAGLE drafter's format: the field, else read from its files; None without one."""
        if self.eagle is None:
            return None
        return self.eagle_format or detect_eagle_format(self.eagle)

    def to_json(self) -> str:
        return json.dumps(to_plain(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> "DeploymentConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a deployment is a JSON object, got {type(data).__name__}")
        data = dict(data)
        if "speculation" in data:
            data["speculation"] = SpeculationConfig.from_dict(data["speculation"])
        layers = data.get("draft_layers")
        if layers is not None and not (isinstance(layers, (list, tuple)) and all(_is_index(i) for i in layers)):
            raise ConfigError(f"draft_layers must be a list of layer indices, got {layers!r}")
        for name in ("target", "draft", "medusa", "eagle", "target_checkpoint", "draft_checkpoint"):
            if name in data and not isinstance(data[name], str) and not (name != "target" and data[name] is None):
                raise ConfigError(f"{name} must be a model name or path, got {data[name]!r}")
        return read_config(cls, data, "deployment")

    @classmethod
    def load(cls, path: str | Path) -> "DeploymentConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read deployment file {path}: {exc}") from None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = ["DeploymentConfig", "SelfDraftConfig"]
