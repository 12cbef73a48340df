"""Building a deployment's :class:`SpeculativeDecoder` (the torch runtime here; the ``trtllm``
runtime in :mod:`triton_backend.deployment.trtllm_deployment`) from its
:class:`~triton_backend.deployment.deployment_config.DeploymentConfig`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from triton_backend.core.config import SpeculationMode
from triton_backend.core.drafter_format import EagleFormat
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.drafters.suffix_index import cross_request_index
from triton_backend.speculation.drafters.protocol import Drafter
from triton_backend.engines.trtllm.trtllm_config import EngineRuntime
from triton_backend.speculation.decoding import Decoder
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.model_loading import (
    eos_ids, layer_skip_draft, load_engine, load_model, load_tokenizer, make_torch_engine,
)
from triton_backend.deployment.self_draft import self_draft_engine, self_drafter
from triton_backend.deployment.trtllm_deployment import build_trtllm_decoder

logger = logging.getLogger(__name__)


def build_decoder(config: DeploymentConfig) -> Decoder:
    if config.engine_runtime is EngineRuntime.TRTLLM:
        return build_trtllm_decoder(config)
    # the float weights of compact linears are released unless a drafter reads them: a layer-skip
    # draft shares the target's layers, Medusa and EAGLE its float LM head
    keep_float_head = config.medusa is not None or config.eagle is not None
    self_engine = None
    if config.self_draft is None:
        target, tokenizer = load_engine(config.target, config.runtime, name=Path(config.target).name,
                                        checkpoint=config.target_checkpoint, keep_float=config.draft_layers is not None,
                                        keep_float_head=keep_float_head)
    else:
        target, tokenizer, self_engine = _load_with_self_draft(config, keep_float_head=keep_float_head)
    from triton_backend.speculation.pass_cost import (install_measured_cost_model, install_measured_draft_costs,
                                                      runtime_settings)

    settings = runtime_settings(config.runtime)
    install_measured_cost_model(target, settings)  # the gain rule decides from this machine's pass costs
    drafters: dict[SpeculationMode, Drafter] = {}
    if self_engine is not None:
        assert config.self_draft is not None
        drafters[SpeculationMode.DRAFT] = self_drafter(self_engine, target, config.self_draft,
                                                       settings=settings)
    elif config.draft is not None:
        # its model is its own: only the compact linears stay (streamed where the folder allows)
        draft_engine, draft_tokenizer = load_engine(config.draft, config.runtime, name=Path(config.draft).name,
                                                    checkpoint=config.draft_checkpoint,
                                                    eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(draft_engine, target=target, target_tokenizer=tokenizer,
                                                            draft_tokenizer=draft_tokenizer)
    elif config.draft_layers is not None:
        layers = config.draft_layers
        draft_engine = make_torch_engine(layer_skip_draft(target.model, layers), name=f"{target.name}[{len(layers)} layers]",
                                         runtime=config.runtime, eos_token_ids=sorted(target.eos_token_ids))
        drafters[SpeculationMode.DRAFT] = DraftModelDrafter(
            draft_engine, target=target, relative_cost=len(layers) / target.model.config.num_hidden_layers)
    if config.medusa is not None:
        from triton_backend.speculation.drafters.medusa import MedusaDrafter

        drafters[SpeculationMode.MEDUSA] = MedusaDrafter.from_file(config.medusa, target, config.medusa_choices)
    if config.eagle is not None:
        drafters[SpeculationMode.EAGLE] = _eagle_drafter(config, target)
    if config.ngram:
        drafters[SpeculationMode.NGRAM] = NgramDrafter(config.speculation.ngram.min_n, config.speculation.ngram.max_n,
                                                       cross_request_index(config.speculation.ngram.cross_request))
    install_measured_draft_costs(target, drafters, settings)  # EAGLE: its measured cost per drafted token
    logger.info("deployment ready: target %s, drafters: %s", target.name, ", ".join(d.name for d in drafters.values()) or "none")
    return SpeculativeDecoder(target, tokenizer, drafters=drafters, speculation=config.speculation)


def _load_with_self_draft(config: DeploymentConfig, *, keep_float_head: bool) -> tuple[Any, Any, Any]:
    """(target engine, tokenizer, self-draft engine) over one loaded model: the draft's engine is
    built first, from the float weights; a quantized target's engine then releases them (its
    compact copies and the draft's are all that is read; a float32 target keeps them)."""
    assert config.self_draft is not None
    name = Path(config.target).name
    tokenizer = load_tokenizer(config.target)
    model = load_model(config.target, config.runtime)
    eos = eos_ids(model, tokenizer)
    draft = self_draft_engine(model, config.runtime, config.self_draft, name=name, eos_token_ids=eos)
    target = make_torch_engine(model, name=name, runtime=config.runtime, eos_token_ids=eos,
                               checkpoint=config.target_checkpoint)
    if isinstance(target, LlamaEngine):
        target.release_float_linears(keep_head=keep_float_head)
    logger.info("loaded %r with its self draft %r", target, draft)
    return target, tokenizer, draft


def _eagle_drafter(config: DeploymentConfig, target: Any) -> Drafter:
    """The deployment's EAGLE drafter, EAGLE-1 or EAGLE-3 as its files (or ``eagle_format``) say."""
    assert config.eagle is not None
    if config.resolved_eagle_format() is EagleFormat.EAGLE3:
        from triton_backend.speculation.drafters.eagle3 import Eagle3Drafter

        logger.info("EAGLE-3 drafter %s", config.eagle)
        return Eagle3Drafter.from_folder(config.eagle, target, config.runtime.drafter_weights)
    from triton_backend.speculation.drafters.eagle import EagleDrafter

    return EagleDrafter.from_file(config.eagle, target)
