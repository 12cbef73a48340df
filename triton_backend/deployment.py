"""A deployment: which target, which drafters, how they run. Builds a SpeculativeDecoder.

This is what the Triton model reads from its repository (as JSON) and what the local
``specbuild run`` builds from flags.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from triton_backend.config import RuntimeConfig, SpeculationConfig, SpeculationMode
from triton_backend.drafters import DraftModelDrafter, NgramDrafter
from triton_backend.drafters.base import Drafter
from triton_backend.engines.trtllm_config import EngineRuntime, TrtllmConfig
from triton_backend.errors import InvalidRequestError
from triton_backend.generation import SpeculativeDecoder
from triton_backend.model_loading import layer_skip_draft, load_engine, load_model, load_tokenizer, make_torch_engine
from triton_backend.reference_model import DEFAULT_REFERENCE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeploymentConfig:
    """``target``/``draft``: a reference model name, a HF directory or a .gguf file.
    ``draft_layers``: instead of a separate draft, a self-speculative draft made of these
    target layers. ``ngram``: offer n-gram lookup. ``medusa``: a Medusa heads file (see
    :mod:`triton_backend.medusa_model`) for the target; ``medusa_choices`` overrides its tree.
    ``eagle``: an EAGLE drafter file or folder (see :mod:`triton_backend.eagle_model`).
    ``engine_runtime``: ``torch`` serves ``target``/``draft`` with torch; ``trtllm`` serves the
    compiled TensorRT-LLM engines named in ``trtllm`` (``target`` then gives the tokenizer)."""

    target: str = DEFAULT_REFERENCE
    draft: str | None = None
    draft_layers: tuple[int, ...] | None = None
    ngram: bool = True
    medusa: str | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    eagle: str | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    engine_runtime: EngineRuntime = EngineRuntime.TORCH
    trtllm: TrtllmConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_runtime", EngineRuntime.parse(self.engine_runtime))
        if self.engine_runtime is EngineRuntime.TRTLLM and self.trtllm is None:
            raise InvalidRequestError("engine_runtime trtllm needs a trtllm section naming the compiled engines")
        if self.draft is not None and self.draft_layers is not None:
            raise InvalidRequestError("give either a draft model or draft_layers, not both")
        if self.draft_layers is not None:
            object.__setattr__(self, "draft_layers", tuple(int(i) for i in self.draft_layers))
        if self.medusa_choices is not None:
            from triton_backend.tree import normalise_choices

            try:
                object.__setattr__(self, "medusa_choices", normalise_choices(self.medusa_choices))
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"bad medusa_choices: {exc}") from None

    def to_json(self) -> str:
        data = asdict(self)
        data["speculation"]["mode"] = self.speculation.mode.value
        data["speculation"]["tree_acceptance"] = self.speculation.tree_acceptance.value
        data["engine_runtime"] = self.engine_runtime.value
        data["trtllm"] = self.trtllm.to_dict() if self.trtllm is not None else None
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeploymentConfig":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"a deployment is a JSON object, got {type(data).__name__}")
        data = dict(data)
        _check_fields("deployment", data, cls)
        runtime = RuntimeConfig(**_check_fields("runtime", data.pop("runtime", {}), RuntimeConfig))
        speculation = SpeculationConfig(**_check_fields("speculation", data.pop("speculation", {}), SpeculationConfig))
        layers = data.pop("draft_layers", None)
        if layers is not None and not (isinstance(layers, (list, tuple)) and all(_is_index(i) for i in layers)):
            raise InvalidRequestError(f"draft_layers must be a list of layer indices, got {layers!r}")
        for name in ("target", "draft", "medusa", "eagle"):
            if name in data and not isinstance(data[name], str) and not (name != "target" and data[name] is None):
                raise InvalidRequestError(f"{name} must be a model name or path, got {data[name]!r}")
        trtllm = data.pop("trtllm", None)
        return cls(runtime=runtime, speculation=speculation,
                   draft_layers=tuple(layers) if layers is not None else None,
                   trtllm=TrtllmConfig.from_dict(trtllm) if trtllm is not None else None, **data)

    @classmethod
    def load(cls, path: str | Path) -> "DeploymentConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"cannot read deployment file {path}: {exc}") from None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(what: str, data: Any, cls: type) -> dict[str, Any]:
    """``data`` as a dict of ``cls``'s fields, or a typed error naming what is wrong."""
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {data!r}")
    unknown = set(data) - set(cls.__dataclass_fields__)
    if unknown:
        raise InvalidRequestError(f"unknown {what} fields: {sorted(map(str, unknown))}")
    return data


def build_decoder(config: DeploymentConfig) -> SpeculativeDecoder:
    if config.engine_runtime is EngineRuntime.TRTLLM:
        from triton_backend.trtllm_deployment import build_trtllm_decoder

        return build_trtllm_decoder(config)
    target, tokenizer = load_engine(config.target, config.runtime, name=Path(config.target).name)
    from triton_backend.pass_cost_measure import install_measured_cost_model, install_measured_draft_costs

    install_measured_cost_model(target, repr(config.runtime))  # the gain rule decides from this machine's pass costs
    drafters: dict[SpeculationMode, Drafter] = {}
    if config.draft is not None:
        draft_tokenizer = load_tokenizer(config.draft)
        draft_engine = make_torch_engine(load_model(config.draft, config.runtime), name=Path(config.draft).name,
                                         runtime=config.runtime, eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(draft_engine, target=target, target_tokenizer=tokenizer,
                                                            draft_tokenizer=draft_tokenizer)
    elif config.draft_layers is not None:
        layers = config.draft_layers
        draft_engine = make_torch_engine(layer_skip_draft(target.model, layers), name=f"{target.name}[{len(layers)} layers]",
                                         runtime=config.runtime, eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(
            draft_engine, target=target, relative_cost=len(layers) / target.model.config.num_hidden_layers)
    if config.medusa is not None:
        from triton_backend.drafters.medusa import MedusaDrafter

        drafters[SpeculationMode.MEDUSA] = MedusaDrafter.from_file(config.medusa, target, config.medusa_choices)
    if config.eagle is not None:
        from triton_backend.drafters.eagle import EagleDrafter

        drafters[SpeculationMode.EAGLE] = EagleDrafter.from_file(config.eagle, target)
    if config.ngram:
        drafters[SpeculationMode.NGRAM] = NgramDrafter(config.speculation.ngram_min, config.speculation.ngram_max)
    install_measured_draft_costs(target, drafters, repr(config.runtime))  # EAGLE: its measured cost per drafted token
    logger.info("deployment ready: target %s, drafters: %s", target.name, ", ".join(d.name for d in drafters.values()) or "none")
    return SpeculativeDecoder(target, tokenizer, drafters=drafters, speculation=config.speculation)
