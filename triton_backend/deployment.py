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
from triton_backend.engines.torch_engine import TorchEngine
from triton_backend.errors import InvalidRequestError
from triton_backend.generation import SpeculativeDecoder
from triton_backend.model_loading import layer_skip_draft, load_engine, load_model, load_tokenizer
from triton_backend.reference_model import DEFAULT_REFERENCE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeploymentConfig:
    """``target``/``draft``: a reference model name, a HF directory or a .gguf file.
    ``draft_layers``: instead of a separate draft, a self-speculative draft made of these
    target layers. ``ngram``: offer n-gram lookup. ``medusa``: a Medusa heads file (see
    :mod:`triton_backend.medusa_model`) for the target; ``medusa_choices`` overrides its tree."""

    target: str = DEFAULT_REFERENCE
    draft: str | None = None
    draft_layers: tuple[int, ...] | None = None
    ngram: bool = True
    medusa: str | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
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
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeploymentConfig":
        data = dict(data)
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise InvalidRequestError(f"unknown deployment fields: {sorted(unknown)}")
        runtime = RuntimeConfig(**data.pop("runtime", {}))
        speculation = SpeculationConfig(**data.pop("speculation", {}))
        layers = data.pop("draft_layers", None)
        return cls(runtime=runtime, speculation=speculation,
                   draft_layers=tuple(layers) if layers is not None else None, **data)

    @classmethod
    def load(cls, path: str | Path) -> "DeploymentConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


def build_decoder(config: DeploymentConfig) -> SpeculativeDecoder:
    target, tokenizer = load_engine(config.target, config.runtime, name=Path(config.target).name)
    drafters: dict[SpeculationMode, Drafter] = {}
    if config.draft is not None:
        draft_tokenizer = load_tokenizer(config.draft)
        draft_engine = TorchEngine(load_model(config.draft, config.runtime), name=Path(config.draft).name,
                                   runtime=config.runtime, eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(draft_engine, target=target, target_tokenizer=tokenizer,
                                                            draft_tokenizer=draft_tokenizer)
    elif config.draft_layers is not None:
        layers = config.draft_layers
        draft_engine = TorchEngine(layer_skip_draft(target.model, layers), name=f"{target.name}[{len(layers)} layers]",
                                   runtime=config.runtime, eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(
            draft_engine, target=target, relative_cost=len(layers) / target.model.config.num_hidden_layers)
    if config.medusa is not None:
        from triton_backend.drafters.medusa import MedusaDrafter

        drafters[SpeculationMode.MEDUSA] = MedusaDrafter.from_file(config.medusa, target, config.medusa_choices)
    if config.ngram:
        drafters[SpeculationMode.NGRAM] = NgramDrafter(config.speculation.ngram_min, config.speculation.ngram_max)
    logger.info("deployment ready: target %s, drafters: %s", target.name, ", ".join(d.name for d in drafters.values()) or "none")
    return SpeculativeDecoder(target, tokenizer, drafters=drafters, speculation=config.speculation)
