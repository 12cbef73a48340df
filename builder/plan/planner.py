"""Fit-to-GPU planning: pick each model's precision, the KV-cache dtype and the TP size.

Preference, most important first: the target's weight precision (it decides the output),
then the KV-cache dtype (it feeds the target's attention), then the draft's precision (it
only moves the acceptance rate), then the smallest TP size. Quality order per format:
16-bit > fp8 > int8_sq > int4_awq; KV: 16-bit > fp8 > int8. The plan is the best-ranked
combination that fits; its ``reasons`` say what every better-ranked option would need.
Memory arithmetic: :mod:`builder.plan.memory`.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace

from builder.plan.architecture import ModelArchitecture, is_config_only, load_architecture
from builder.errors import DoesNotFitError, PlanError, PrecisionError
from builder.plan.gpus import GIB, GpuSpec, get_gpu
from builder.plan.memory import (INT4_GROUP_SIZES, Footprint, int4_group_size, decode_step_ms, eagle_footprint, eagle_params,
                            medusa_footprint, medusa_params, model_footprint,
                            row_kernel_packed_bytes, tokens_per_sequence, torch_checkpoint_linear_bytes, torch_float_bytes,
                            torch_weight_precision,
                            torch_runtime_bytes)
from builder.plan.types import Choice, ModelPlan, Plan
from builder.plan.spec import BuildSpec, KVCacheDtype, ModelSpec, Precision

logger = logging.getLogger(__name__)

_QUANTIZED_ORDER = (Precision.FP8, Precision.INT8_SQ, Precision.INT4_AWQ)
_KV_ORDER = (KVCacheDtype.FP16, KVCacheDtype.FP8, KVCacheDtype.INT8)


@dataclass(frozen=True)
class ResolvedModels:
    target: ModelArchitecture
    draft: ModelArchitecture | None


def int4_problems(arch: ModelArchitecture, tp: int, *, medusa_heads: bool = False) -> list[str]:
    """Why INT4-AWQ cannot pack this model at this TP size (empty: it can). Every linear's
    input size per GPU must split into groups of 64 (128 where all split into 128: the group size
    is then 128, :func:`~builder.plan.memory.int4_group_size`) and every output size must be even
    (two int4 values per byte)."""
    linears = [lin.shard(tp) for lin in arch.layer_linears()]
    smallest = INT4_GROUP_SIZES[-1]
    problems = []
    for lin in linears:
        if lin.in_features % smallest:
            problems.append(f"{lin.name} input size {lin.in_features} is not divisible by {smallest}")
        if lin.out_features % 2:
            problems.append(f"{lin.name} output size {lin.out_features} is odd")
    if medusa_heads and arch.hidden_size % smallest:
        problems.append(f"Medusa head input size {arch.hidden_size} is not divisible by {smallest}")
    return problems


def tp_problems(arch: ModelArchitecture, tp: int) -> list[str]:
    problems = []
    if arch.num_heads % tp:
        problems.append(f"{arch.num_heads} attention heads do not split over TP {tp}")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads do not split over (or replicate across) TP {tp}")
    if arch.intermediate_size % tp:
        problems.append(f"intermediate size {arch.intermediate_size} does not split over TP {tp}")
    return problems


def precision_options(model: ModelSpec, arch: ModelArchitecture, gpu: GpuSpec, tp: int, role: str,
                      notes: list[str], *, medusa_heads: bool = False) -> list[Precision]:
    """The precisions this role may take at this TP size, best first. An explicit precision
    the GPU or the shapes cannot run raises :class:`PrecisionError`."""
    float_precision = Precision(arch.float_precision)
    wanted = [float_precision, *_QUANTIZED_ORDER] if model.precision is Precision.AUTO else [model.precision]
    options = []
    for precision in wanted:
        why = _refusal(precision, arch, gpu, tp, medusa_heads)
        if why is None:
            options.append(precision)
        elif model.precision is not Precision.AUTO:
            raise PrecisionError(f"{role} {model.source}: {precision.value} is not possible: {why}")
        else:
            notes.append(f"{role}: {precision.value} skipped: {why}")
    return options


def _refusal(precision: Precision, arch: ModelArchitecture, gpu: GpuSpec, tp: int, medusa_heads: bool) -> str | None:
    if precision is Precision.FP8 and not gpu.supports_fp8:
        return f"{gpu.name} (compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}) has no FP8 tensor cores"
    if precision is Precision.INT4_AWQ:
        problems = int4_problems(arch, tp, medusa_heads=medusa_heads)
        if problems:
            return f"INT4-AWQ block size at TP {tp}: " + "; ".join(problems)
    return None


def kv_options(spec: BuildSpec, gpu: GpuSpec) -> list[KVCacheDtype]:
    if spec.kv_cache_dtype is not KVCacheDtype.AUTO:
        if spec.kv_cache_dtype is KVCacheDtype.FP8 and not gpu.supports_fp8:
            raise PrecisionError(f"an FP8 KV cache needs FP8 support; {gpu.name} has none (use int8 or fp16)")
        return [spec.kv_cache_dtype]
    return [kv for kv in _KV_ORDER if kv is not KVCacheDtype.FP8 or gpu.supports_fp8]


def tp_options(spec: BuildSpec, models: ResolvedModels) -> list[int]:
    available = spec.gpu.count // spec.parallel.pp_size
    if spec.parallel.tp_size is not None:
        tp = spec.parallel.tp_size
        if tp * spec.parallel.pp_size > spec.gpu.count:
            raise PlanError(f"TP {tp} x PP {spec.parallel.pp_size} needs {tp * spec.parallel.pp_size} GPUs; "
                            f"the spec has {spec.gpu.count}")
        problems = tp_problems(models.target, tp) + (tp_problems(models.draft, tp) if models.draft else [])
        if problems:
            raise PlanError(f"tensor parallel size {tp} is not possible: " + "; ".join(problems))
        return [tp]
    if available < 1:
        raise PlanError(f"PP {spec.parallel.pp_size} needs more GPUs than the spec's {spec.gpu.count}")
    sizes = [1 << i for i in range(8) if (1 << i) <= available]
    ok = [tp for tp in sizes if not tp_problems(models.target, tp) and not (models.draft and tp_problems(models.draft, tp))]
    if not ok:
        raise PlanError("no tensor parallel size splits the models' heads evenly")
    return ok


def check_layers(spec: BuildSpec, models: ResolvedModels) -> None:
    pp = spec.parallel.pp_size
    for role, arch in (("target", models.target), ("draft", models.draft)):
        if arch is None:
            continue
        if arch.num_layers % pp:
            raise PlanError(f"{role}: {arch.num_layers} layers do not split over PP {pp}")
        needed = spec.limits.max_seq_len + spec.limits.max_draft_len
        if arch.max_position_embeddings and needed > arch.max_position_embeddings:
            raise PlanError(f"{role}: max_input_len + max_output_len + max_draft_len = {needed} exceeds the model's "
                            f"context of {arch.max_position_embeddings} tokens")


def check_vocabularies(spec: BuildSpec, models: ResolvedModels, notes: list[str]) -> None:
    """The draft must share the target's tokenizer: same vocabulary size, and when both
    models come with a tokenizer, the same token -> id map."""
    from triton_backend.speculation.drafters.draft_model import check_vocab_compatible

    if spec.draft is None or models.draft is None:
        return
    if spec.draft.is_self:
        notes.append("draft: the target itself (self draft): same tokenizer by construction")
        return
    check_vocab_compatible(None, None, models.target.vocab_size, models.draft.vocab_size)  # sizes first: cheap
    target_tok = _tokenizer_or_none(spec.target.source)
    draft_tok = _tokenizer_or_none(spec.draft.source)
    if target_tok is None or draft_tok is None:
        notes.append("tokenizers: not both available; compared vocabulary sizes only")
    check_vocab_compatible(target_tok if draft_tok is not None else None, draft_tok,
                           models.target.vocab_size, models.draft.vocab_size)


def _tokenizer_or_none(source: str):
    from triton_backend.core.errors import ModelLoadError
    from triton_backend.engines.torch.model_loading import load_tokenizer

    if is_config_only(source):
        return None
    try:
        return load_tokenizer(source)
    except ModelLoadError as exc:
        logger.info("no tokenizer for %s: %s", source, exc)
        return None


def evaluate(spec: BuildSpec, models: ResolvedModels, gpu: GpuSpec, choice: Choice) -> tuple[ModelPlan, ...]:
    """Per-GPU footprints of every model for one combination."""
    limits, pp = spec.limits, spec.parallel.pp_size
    heads = spec.medusa is not None
    plans = [_model_plan("target", spec.target, models.target,
                         model_footprint(models.target, choice.target, choice.kv, limits, choice.tp, pp),
                         models.target.total_params, choice.target, gpu,
                         _group(models.target, choice.target, choice.tp, heads),
                         float_head=heads or spec.eagle is not None)]
    if spec.draft is not None and models.draft is not None and choice.draft is not None:
        plans.append(_model_plan("draft", spec.draft, models.draft,
                                 model_footprint(models.draft, choice.draft, choice.kv, limits, choice.tp, pp),
                                 models.draft.total_params, choice.draft, gpu, _group(models.draft, choice.draft, choice.tp)))
    if spec.medusa is not None:
        fp = medusa_footprint(models.target, spec.medusa, choice.target, limits, choice.tp, pp)
        plans.append(_model_plan("medusa", ModelSpec(spec.medusa.source or "(untrained heads)", spec.target.precision),
                                 models.target, fp, medusa_params(models.target, spec.medusa), choice.target, gpu,
                                 _group(models.target, choice.target, choice.tp, heads)))
    if spec.eagle is not None:  # the EagleNets stay 16-bit whatever the target's precision
        fp = eagle_footprint(models.target, spec.eagle, choice.kv, limits, choice.tp, pp)
        plans.append(_model_plan("eagle", ModelSpec(spec.eagle.source or "(untrained drafter)", Precision.FP16),
                                 models.target, fp, eagle_params(models.target, spec.eagle), Precision.FP16, gpu))
    return tuple(plans)


def _group(arch: ModelArchitecture, precision: Precision, tp: int, medusa_heads: bool = False) -> int | None:
    return int4_group_size(arch, tp, medusa_heads=medusa_heads) if precision is Precision.INT4_AWQ else None


def _model_plan(role: str, model: ModelSpec, arch: ModelArchitecture, footprint: Footprint, params: int,
                precision: Precision, gpu: GpuSpec, group: int | None = None, *, float_head: bool = False) -> ModelPlan:
    """``float_head``: a drafter reads the model's float LM head (Medusa, EAGLE), so the torch runtime keeps it."""
    from triton_backend.core.runtime_config import WeightPrecision

    served = role in ("target", "draft")
    torch_bytes = torch_checkpoint_linear_bytes(arch, precision, group) if served else 0
    compact = torch_weight_precision(precision) is not WeightPrecision.FLOAT32
    float_bytes = torch_float_bytes(arch, compact=compact, float_head=float_head) if served else 0
    return ModelPlan(role=role, source=model.source, params=params, precision=precision, requested=model.precision,
                     footprint=footprint, decode_step_ms=decode_step_ms(footprint.weights, gpu.bandwidth_gbps),
                     int4_group_size=group, torch_linear_bytes=torch_bytes, torch_float_bytes=float_bytes)


def per_gpu_total(spec: BuildSpec, plans: tuple[ModelPlan, ...]) -> int:
    return sum(p.footprint.total for p in plans) + int(spec.workspace_gib * GIB)


def torch_runtime_note(spec: BuildSpec, models: ResolvedModels, plans: tuple[ModelPlan, ...] = ()) -> str:
    """Memory of the torch runtime (the embedded default): weights + the slot engine's static KV
    cache, ``limits.max_batch_size`` slots x ``input + output + draft`` positions per model, and on
    CPU in float32 the linears as its CPU kernels hold them (float32 panels, or the plan's precision)."""
    dtype = spec.torch_runtime.dtype.value
    if dtype == "auto":
        dtype = "float32" if spec.torch_runtime.device == "cpu" else "16-bit"
    width = 4 if dtype == "float32" else 2
    slots, length = spec.limits.max_batch_size, tokens_per_sequence(spec.limits)
    parts = []
    for role, arch in (("target", models.target), ("draft", models.draft)):
        if arch is not None:
            weights, kv = torch_runtime_bytes(arch, width, slots, length)
            part = f"{role} {weights / GIB:.2f} GiB weights + {kv / GIB:.2f} GiB KV cache"
            planned = next((p for p in plans if p.role == role), None)
            if spec.torch_runtime.device == "cpu" and dtype == "float32" and planned is not None:
                served = torch_weight_precision(planned.precision).value
                if served != "float32":  # the float linears are released once the compact copies exist
                    head = ", LM head" if planned.torch_float_bytes > torch_float_bytes(arch, compact=True) else ""
                    part = (f"{role} {planned.torch_float_bytes / GIB:.2f} GiB float32 weights (embedding, norms{head}) "
                            f"+ {kv / GIB:.2f} GiB KV cache")
                part += f" + {planned.torch_linear_bytes / GIB:.2f} GiB of {served} linear weights for the CPU kernels"
            elif spec.torch_runtime.device == "cpu" and dtype == "float32":
                part += f" + {row_kernel_packed_bytes(arch) / GIB:.2f} GiB packed copy for the row kernel"
            parts.append(part)
    return (f"torch runtime ({spec.torch_runtime.device}, {dtype}): " + "; ".join(parts)
            + f" ({slots} slots x {length} positions; runtime.max_batch_size / max_seq_len in the deployment)")


def resolve_models(spec: BuildSpec) -> ResolvedModels:
    target = load_architecture(spec.target.source)
    draft = None
    if spec.draft is not None and spec.draft.is_self:
        draft = self_draft_architecture(target, spec.draft.layers)
    elif spec.draft is not None:
        draft = load_architecture(spec.draft.source)
    return ResolvedModels(target, draft)


def self_draft_architecture(target: ModelArchitecture, layers: int | None) -> ModelArchitecture:
    """A self draft's architecture: the target's, with ``layers`` of its layers when given."""
    if layers is None:
        return target
    if layers >= target.num_layers:
        raise PlanError(f"draft: a self draft of {layers} layers needs fewer than the target's {target.num_layers}")
    return replace(target, num_layers=layers)


def self_draft_layers(num_layers: int, keep: int) -> tuple[int, ...]:
    """The ``keep`` layers a self draft of a ``num_layers``-layer target runs: evenly spaced from layer 0."""
    return tuple(sorted({i * num_layers // keep for i in range(keep)}))


def plan_deployment(spec: BuildSpec, models: ResolvedModels | None = None) -> Plan:
    """Validate the spec against the models and GPUs, and pick the best combination that fits."""
    gpu = get_gpu(spec.gpu.kind)
    models = models or resolve_models(spec)
    notes: list[str] = []
    check_layers(spec, models)
    check_vocabularies(spec, models, notes)
    if spec.medusa is not None and spec.medusa.num_heads > spec.limits.max_draft_len:
        notes.append(f"medusa: {spec.medusa.num_heads} heads propose up to max_draft_len = {spec.limits.max_draft_len} tokens")
    choices = _candidates(spec, models, gpu, notes)
    scored = [(c, evaluate(spec, models, gpu, c)) for c in choices]
    fitting = [(c, p) for c, p in scored if per_gpu_total(spec, p) <= gpu.memory_bytes]
    if not fitting:
        raise _no_fit(spec, gpu, scored)
    choice, plans = min(fitting, key=lambda cp: cp[0].rank)
    notes.append(torch_runtime_note(spec, models, plans))
    reasons = _reasons(spec, gpu, choice, scored)
    return Plan(gpu=gpu, gpu_count=spec.gpu.count, tp=choice.tp, pp=spec.parallel.pp_size, kv_cache_dtype=choice.kv,
                workspace_bytes=int(spec.workspace_gib * GIB), models=plans, reasons=tuple(reasons),
                notes=tuple(dict.fromkeys(notes)), limits=spec.limits)


def _candidates(spec: BuildSpec, models: ResolvedModels, gpu: GpuSpec, notes: list[str]) -> list[Choice]:
    choices = []
    kvs = kv_options(spec, gpu)
    tps = tp_options(spec, models)
    for tp in tps:
        targets = precision_options(spec.target, models.target, gpu, tp, "target", notes, medusa_heads=spec.medusa is not None)
        drafts: list[Precision | None] = [None]
        if spec.draft is not None and models.draft is not None:
            drafts = list(precision_options(spec.draft, models.draft, gpu, tp, "draft", notes))
        for target, kv, draft in itertools.product(targets, kvs, drafts):
            if _pointless_self_draft(spec, target, draft):
                continue
            choices.append(Choice(target=target, kv=kv, draft=draft, tp=tp))
    if not choices and spec.draft is not None and spec.draft.is_self:
        raise PrecisionError("draft: a self draft at the target's precision with all its layers is the target "
                             "itself; give the draft a cheaper precision or fewer layers")
    return choices


def _pointless_self_draft(spec: BuildSpec, target: Precision, draft: Precision | None) -> bool:
    """A self draft over all layers must be cheaper than the target: ``auto`` takes only quantized
    precisions other than the target's; any draft precision equal to the target's is left out."""
    if spec.draft is None or not spec.draft.is_self or spec.draft.layers is not None or draft is None:
        return False
    return draft is target or (spec.draft.precision is Precision.AUTO and not draft.is_quantized)


def _no_fit(spec: BuildSpec, gpu: GpuSpec, scored: list[tuple[Choice, tuple[ModelPlan, ...]]]) -> DoesNotFitError:
    choice, plans = min(scored, key=lambda cp: per_gpu_total(spec, cp[1]))
    need = per_gpu_total(spec, plans) / GIB
    return DoesNotFitError(
        f"does not fit at any allowed precision: the smallest combination ({choice.describe()}) needs "
        f"{need:.1f} GiB per GPU and each {gpu.name} has {gpu.memory_gib:.1f} GiB; use more GPUs, lower "
        f"max_batch_size / max_input_len / max_output_len, or a smaller model")


def _reasons(spec: BuildSpec, gpu: GpuSpec, chosen: Choice, scored: list[tuple[Choice, tuple[ModelPlan, ...]]]) -> list[str]:
    """For each preference dimension, what the better-ranked options would need per GPU
    (at their cheapest setting of the dimensions ranked below)."""
    reasons = []
    cap = gpu.memory_gib
    roles = {0: "target", 2: "draft"}
    for dim, label in enumerate(("target", "KV cache", "draft", "TP")):
        prefix = chosen.rank[:dim]
        better: dict[str, tuple[float, float]] = {}
        for c, plans in scored:
            if c.rank[:dim] != prefix or c.rank[dim] >= chosen.rank[dim]:
                continue
            need = per_gpu_total(spec, plans) / GIB
            role_plan = next((p for p in plans if p.role == roles.get(dim)), None)
            weights = role_plan.footprint.weights / GIB if role_plan is not None else 0.0
            key = c.value_of(dim)
            if key not in better or need < better[key][0]:
                better[key] = (need, weights)
        for key, (need, weights) in better.items():
            detail = f" (its weights alone: {weights:.1f} GiB per GPU)" if dim in roles else ""
            reasons.append(f"{label} {key} would need {need:.1f} GiB per GPU > {cap:.1f} GiB{detail}")
    total = per_gpu_total(spec, next(p for c, p in scored if c == chosen)) / GIB
    reasons.append(f"chosen: {chosen.describe()}: {total:.1f} GiB per GPU of {cap:.1f} GiB")
    return reasons
