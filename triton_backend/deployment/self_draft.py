"""The target as its own draft (:class:`~triton_backend.deployment.deployment_config.SelfDraftConfig`): a
second slot engine over the target's already-loaded model, its linear weights (and LM head)
quantized at load to the draft precision, optionally over fewer of its layers.

Nothing is loaded twice: the draft engine wraps the same Hugging Face module (embedding, norms,
rotary tables shared) and holds only its compact linears and its own KV cache. Build it before
the target's engine: a quantized target may release the float linears the draft quantizes from.
The drafter is a :class:`DraftModelDrafter` (batched by the scheduler like any draft model); its
``relative_cost`` (what the gain rule prices a drafted token at) is this machine's measured
1-token step of the draft over the target's, else an estimate from the precision's measured
speed (docs/quantized-weights.md).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

from transformers import PreTrainedModel

from triton_backend.core.runtime_config import DraftContext, RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ConfigError
from triton_backend.deployment.deployment_config import SelfDraftConfig
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.model_loading import layer_skip_draft, make_torch_engine
from triton_backend.speculation.drafters.draft_model import DraftModelDrafter, TargetContext

logger = logging.getLogger(__name__)

# a 1-token step's cost at this weight precision, in float32 steps (the reference model's plain
# decoding on one CPU thread, `specbuild bench precision`: int8 2.25x, int4 2.60x; 16-bit ~1.6x
# from the kernel table of docs/quantized-weights.md): the estimate when the machine cannot measure
STEP_COST = {WeightPrecision.FLOAT32: 1.0, WeightPrecision.FLOAT16: 0.62, WeightPrecision.BFLOAT16: 0.62,
             WeightPrecision.INT8: 0.44, WeightPrecision.INT4: 0.38}
# the gain rule's starting acceptance of a self draft over all layers: its precision's teacher-forced
# greedy agreement with float32 on the reference model (`specbuild bench precision`: int8 0.966,
# int4 0.602), rounded down. The draft-model type's prior (0.6) at a self draft's cost (~0.45 of a
# step) never drafts, so never learns that int8 agrees ~97 % of the time. Fewer layers: the type's.
SELF_DRAFT_PRIOR = {WeightPrecision.INT8: 0.9, WeightPrecision.INT4: 0.55, WeightPrecision.FLOAT16: 0.95,
                    WeightPrecision.BFLOAT16: 0.9}


def self_draft_engine(model: PreTrainedModel, runtime: RuntimeConfig, self_draft: SelfDraftConfig, *,
                      name: str, eos_token_ids: Sequence[int]) -> LlamaEngine:
    """The draft's slot engine over the target's ``model`` (its float parameters still loaded):
    ``runtime`` with ``weights = self_draft.precision``; a layer-skip view of ``model`` when
    ``self_draft.layers`` leaves some out. Bad layers raise :class:`ConfigError`."""
    total = int(model.config.num_hidden_layers)
    layers = self_draft.layers
    if layers is not None and layers[-1] >= total:
        raise ConfigError(f"self_draft layers must lie in [0, {total}) for {name}, got {list(layers)}")
    module = model if layers is None or len(layers) == total else layer_skip_draft(model, layers)
    try:
        engine = make_torch_engine(module, name=f"{name}[{self_draft.label()}]",
                                   runtime=replace(runtime, weights=self_draft.precision), eos_token_ids=eos_token_ids)
    except ValueError as exc:  # e.g. no int4 group divides the model's widths
        raise ConfigError(f"self_draft {self_draft.label()} of {name}: {exc}") from None
    if not isinstance(engine, LlamaEngine):  # make_torch_engine refuses compact weights off the slot engine
        raise ConfigError(f"self_draft needs the slot engine, which does not run {name}")
    return engine


def estimated_cost(self_draft: SelfDraftConfig, target_weights: WeightPrecision, num_layers: int) -> float:
    """A drafted token's cost in target steps, from the precisions' step costs and the layers kept."""
    kept = num_layers if self_draft.layers is None else len(self_draft.layers)
    return STEP_COST[self_draft.precision] / STEP_COST[target_weights] * kept / num_layers


def self_drafter(engine: LlamaEngine, target: Any, self_draft: SelfDraftConfig, *, settings: str = "",
                 measure: bool = True) -> DraftModelDrafter:
    """The drafter over ``engine`` (from :func:`self_draft_engine`) for ``target``. The target's
    precision is what its engine holds (a checkpoint's, or quantized at load): a draft at that
    precision over all layers is the target again, refused."""
    target_weights = target.weights if isinstance(target, LlamaEngine) else WeightPrecision.FLOAT32
    if self_draft.layers is None and target_weights is self_draft.precision:
        raise ConfigError(f"self_draft at the target's own precision ({target_weights.value}) with all its layers "
                          "is the target itself: pick a cheaper precision or fewer layers")
    cost = nominal = estimated_cost(self_draft, target_weights, int(target.model.config.num_hidden_layers))
    if measure:
        from triton_backend.speculation.pass_cost import measured_step_cost

        measured = measured_step_cost(engine, target, settings)
        if measured is not None:
            cost = measured
    prior = SELF_DRAFT_PRIOR.get(self_draft.precision) if self_draft.layers is None else None
    context = None
    if self_draft.context is not DraftContext.DRAFT:
        if isinstance(target, LlamaEngine):
            context = TargetContext(self_draft.context, self_draft.layers)
        else:  # only two slot engines' caches can be copied between
            logger.info("self draft %s prefills its own context: the target %s is not on the slot engine",
                        engine.name, target.name)
    logger.info("self draft %s: %.3f target steps per drafted token, starting acceptance %s, context %s, "
                "stops below %.2f", engine.name, cost, "the draft-model default" if prior is None else prior,
                "the draft's" if context is None else f"the target's ({context.scope.value})", self_draft.stop_below)
    drafter = DraftModelDrafter(engine, target=target, relative_cost=cost,
                                prior_acceptance=None if prior is None else (prior, prior), context=context,
                                stop_below=self_draft.stop_below)
    drafter.nominal_cost = nominal  # what seeded sampling requests are priced at (controller_for, reproducible)
    return drafter


__all__ = ["SELF_DRAFT_PRIOR", "STEP_COST", "estimated_cost", "self_draft_engine", "self_drafter"]
