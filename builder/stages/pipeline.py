"""``specbuild build``: plan -> torch runtime weights -> quantize + export TensorRT-LLM
checkpoints -> compile engines (or write the script) -> quality (each quantized model against
float32, :mod:`builder.stages.quality`) -> render the Triton model repository -> manifest.json.

Output folder layout::

    plan.json                    the plan (also inside the manifest)
    weights/<role>/              HF weights + tokenizer the torch runtime serves
    checkpoints/<role>/          TensorRT-LLM checkpoint: config.json + rank<N>.safetensors
    engines/<role>/              compiled engines (only when trtllm-build ran and succeeded)
    build_engines.sh             the exact trtllm-build command lines
    model_repo/                  Triton model repository, ready for ``specbuild serve``
    manifest.json                written last: spec, plan, precisions, hashes, engine status, versions

Every plan-time check (vocabularies, INT4 block sizes, GPU, fit) runs before any model is
loaded or calibrated.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from builder.plan.architecture import ModelArchitecture, is_config_only
from builder.stages.compile import CompileMode, EngineResult, EngineStatus, compile_engines, engine_builds
from builder.errors import BuildSpecError
from builder.stages.manifest import MANIFEST_NAME, write_manifest
from builder.plan.types import Plan
from builder.plan.planner import ResolvedModels, plan_deployment, resolve_models
from builder.plan.spec import BuildSpec, ModelSpec
from builder.stages.torch_weights import TorchServing, relative_to_file, save_torch_weights, torch_serving

if TYPE_CHECKING:
    from triton_backend.core.runtime_config import WeightPrecision
    from triton_backend.engines.trtllm.trtllm_config import TrtllmConfig

logger = logging.getLogger(__name__)

_OWNED = ("plan.json", "weights", "checkpoints", "engines", "build_engines.sh", "model_repo", MANIFEST_NAME)


@dataclass(frozen=True)
class BuildOptions:
    output_dir: Path
    compile: CompileMode = CompileMode.AUTO
    torch_only: bool = False  # skip quantization, checkpoints and engines
    force: bool = False  # replace a previous build in output_dir
    progress: bool = True
    device: str = "cpu"  # where calibration runs
    threads: int = 1
    skip_quality: bool = False  # no quality stage (also the spec's quality.enabled: false)


@dataclass
class BuildContext:
    spec: BuildSpec
    options: BuildOptions
    out: Path
    models: ResolvedModels | None = None
    plan: Plan | None = None
    serving: TorchServing | None = None
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines: list[EngineResult] = field(default_factory=list)
    repository: dict[str, str] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    medusa_heads: Path | None = None  # the torch runtime's copy of trained Medusa heads
    quality: dict[str, dict[str, Any]] = field(default_factory=dict)  # per role: the quality stage's record

    def roles(self) -> list[tuple[str, ModelSpec, ModelArchitecture]]:
        assert self.models is not None
        out = [("target", self.spec.target, self.models.target)]
        draft = self.spec.draft
        if draft is not None and self.models.draft is not None:
            # a self draft: the target's weights, exported once more at the draft's precision
            out.append(("draft", ModelSpec(self.spec.target.source, draft.precision) if draft.is_self else draft,
                        self.models.draft))
        return out

    def weight_roles(self) -> list[str]:
        """The roles with a folder of torch weights (a self draft serves the target's)."""
        return [role for role, _, _ in self.roles() if not (role == "draft" and self.spec.draft is not None
                                                              and self.spec.draft.is_self)]


@dataclass(frozen=True)
class BuildResult:
    output_dir: Path
    manifest_path: Path
    plan: Plan
    engines: list[EngineResult]
    notices: list[str]
    quality: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def engines_compiled(self) -> bool:
        return bool(self.engines) and all(e.status is EngineStatus.COMPILED for e in self.engines)


def prepare_output(options: BuildOptions) -> Path:
    out = Path(options.output_dir)
    if out.exists() and not out.is_dir():
        raise BuildSpecError(f"output {out} exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if entries and not options.force:
        raise BuildSpecError(f"output folder {out} is not empty; pass --force to replace a previous build there")
    foreign = [e for e in entries if e not in _OWNED]
    if foreign:
        raise BuildSpecError(f"output folder {out} holds files a build did not make ({foreign[:5]}); choose another")
    for name in entries:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def _stage_plan(ctx: BuildContext) -> None:
    draft = ctx.spec.draft
    if draft is not None and draft.is_self and draft.layers is not None and not ctx.options.torch_only:
        raise BuildSpecError("a self draft of fewer layers runs on the torch runtime only: build it with --torch-only, "
                             "or give the TensorRT-LLM self draft all the target's layers")
    for model in (ctx.spec.target, None if draft is None or draft.is_self else draft):
        if model is not None and is_config_only(model.source):
            raise BuildSpecError(f"{model.source} is an architecture-only config (no weights): it can be planned "
                                 "with `specbuild plan`, not built")
    ctx.models = resolve_models(ctx.spec)
    ctx.plan = plan_deployment(ctx.spec, ctx.models)
    ctx.serving = torch_serving(ctx.spec, ctx.plan)
    (ctx.out / "plan.json").write_text(json.dumps(ctx.plan.to_dict(), indent=2) + "\n")


def _stage_torch_weights(ctx: BuildContext) -> None:
    assert ctx.serving is not None
    for role, model, _ in ctx.roles():
        if role in ctx.weight_roles():
            save_torch_weights(model.source, ctx.out / "weights" / role, ctx.serving.dtype)
    medusa = ctx.spec.medusa
    if medusa is not None and medusa.source is not None:
        from builder.stages.medusa_heads import copy_runtime_heads

        ctx.medusa_heads = copy_runtime_heads(Path(medusa.source), ctx.out / "weights" / "medusa")


def _stage_checkpoint(role: str) -> Callable[[BuildContext], None]:
    def run(ctx: BuildContext) -> None:
        from builder.stages.checkpoint import build_checkpoint

        assert ctx.plan is not None
        _, model, arch = next(r for r in ctx.roles() if r[0] == role)
        ctx.checkpoints[role] = build_checkpoint(ctx.spec, ctx.plan, role, model, arch, ctx.out, ctx.options.device)

    return run


def _stage_compile(ctx: BuildContext) -> None:
    assert ctx.plan is not None
    ctx.engines = compile_engines(engine_builds(ctx.spec, ctx.plan), ctx.out, ctx.plan, ctx.options.compile)


def _stage_quality(ctx: BuildContext) -> None:
    from builder.stages.quality import QualityTarget, quality_target, run_quality

    assert ctx.plan is not None
    targets: list[QualityTarget | tuple[str, str]] = []
    for role, model, arch in ctx.roles():
        record = ctx.checkpoints.get(role)
        served = record is not None and ctx.plan.tp * ctx.plan.pp == 1  # as _torch_weights_sources serves it
        planned = ctx.plan.model(role)
        assert planned is not None
        target = quality_target(role, model.source, arch, planned,
                                ctx.out / record["dir"] if served else None, record["dir"] if served else None)
        targets.append((role, target) if isinstance(target, str) else target)
    ctx.quality, notices = run_quality(targets, ctx.spec.quality, ctx.options.threads)
    ctx.notices += notices


def _stage_repository(ctx: BuildContext) -> None:
    from builder.stages.model_repository import VERSION, render_model_repository
    from triton_backend.core.config import DraftLengthConfig, SpeculationConfig
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.engines.trtllm.trtllm_config import EngineRuntime
    from triton_backend.serving.interface import ServingConfig

    assert ctx.serving is not None
    serving = ServingConfig(max_batch_size=ctx.spec.limits.max_batch_size)
    repo = ctx.out / "model_repo"
    file_dir = repo / serving.model_name / VERSION
    file_dir.mkdir(parents=True, exist_ok=True)
    weights = {role: relative_to_file(ctx.out / "weights" / role, file_dir) for role in ctx.weight_roles()}
    medusa = relative_to_file(ctx.medusa_heads, file_dir) if ctx.medusa_heads is not None else None
    engines = _compiled_engines(ctx, file_dir)
    # a Medusa engine takes its tree at run time: the one its checkpoint's max_draft_len was sized for
    choices = ctx.checkpoints.get("target", {}).get("medusa", {}).get("medusa_choices") if engines else None
    checkpoints, load_weights = _torch_weights_sources(ctx, file_dir)
    deployment = DeploymentConfig(
        target=weights["target"], draft=weights.get("draft"), self_draft=None if engines is not None else _self_draft(ctx),
        medusa=medusa, medusa_choices=choices,
        target_checkpoint=checkpoints.get("target"), draft_checkpoint=checkpoints.get("draft"),
        runtime=RuntimeConfig(device=ctx.serving.device, dtype=ctx.serving.dtype, weights=load_weights,
                              int4_group_size=_int4_group(ctx), quantize_lm_head=False),  # the head 16-bit, as exported
        speculation=SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=ctx.spec.limits.max_draft_len)),
        engine_runtime=EngineRuntime.TRTLLM if engines is not None else EngineRuntime.TORCH, trtllm=engines)
    render_model_repository(deployment, repo, serving)
    ctx.repository = {"dir": "model_repo", "model": serving.model_name,
                      "deployment": (file_dir / serving.deployment_file).relative_to(ctx.out).as_posix(),
                      "torch_linear_weights": _linear_sources(ctx, checkpoints, load_weights)}
    if engines is not None:
        ctx.notices.append("the model repository serves the compiled TensorRT-LLM engines (engine_runtime trtllm); "
                           "loading it needs TensorRT-LLM (the GPU image)")
    elif ctx.spec.medusa is not None and ctx.medusa_heads is None:
        ctx.notices.append("Medusa heads are in the TensorRT-LLM target checkpoint; the torch runtime's repository "
                           "serves the target with n-gram drafting (its heads file has no specbuild metadata)")


def _torch_weights_sources(ctx: BuildContext, file_dir: Path) -> tuple[dict[str, str], WeightPrecision]:
    """Where the torch runtime's compact linears come from: per role, the exported checkpoint (its
    own tensors; any TP, its ranks merged at load; PP = 1) and, for roles without one, the precision the float weights
    are quantized to at load (one ``runtime.weights`` for both models: float32 where they differ)."""
    from triton_backend.core.runtime_config import WeightPrecision

    assert ctx.serving is not None and ctx.plan is not None
    checkpoints: dict[str, str] = {}
    at_load: set[WeightPrecision] = set()
    for role, served in ctx.serving.weights.items():
        if role not in ctx.weight_roles():
            continue  # a self draft quantizes the target's loaded weights itself
        if served is WeightPrecision.FLOAT32:
            at_load.add(served)
        elif role in ctx.checkpoints and ctx.plan.pp == 1:
            checkpoints[role] = relative_to_file(ctx.out / ctx.checkpoints[role]["dir"], file_dir)
        else:
            at_load.add(served)
    if len(at_load) > 1:
        ctx.notices.append("torch runtime: the models quantized at load plan different precisions "
                           f"({', '.join(sorted(w.value for w in at_load))}); both are served in float32")
    return checkpoints, at_load.pop() if len(at_load) == 1 else WeightPrecision.FLOAT32


def _self_draft(ctx: BuildContext) -> Any:
    """The torch runtime's :class:`SelfDraftConfig` for a self-draft spec (None otherwise): the
    draft's planned precision as the CPU kernels serve it (int8 where that is the target's own
    over all layers), its layers evenly spaced from layer 0."""
    from triton_backend.core.runtime_config import WeightPrecision
    from triton_backend.deployment.deployment_config import SelfDraftConfig
    from builder.plan.planner import self_draft_layers

    draft = ctx.spec.draft
    if draft is None or not draft.is_self:
        return None
    assert ctx.serving is not None and ctx.models is not None
    precision = ctx.serving.weights.get("draft", WeightPrecision.INT8)
    target_weights = ctx.serving.weights.get("target", WeightPrecision.FLOAT32)  # its checkpoint's or at load
    layers = None if draft.layers is None else self_draft_layers(ctx.models.target.num_layers, draft.layers)
    if layers is None and precision is target_weights:
        ctx.notices.append(f"torch runtime, draft: the self draft's planned precision serves as the target's "
                           f"({precision.value}) here; it drafts in int8")
        precision = WeightPrecision.INT8 if target_weights is not WeightPrecision.INT8 else WeightPrecision.INT4
    return SelfDraftConfig(precision=precision, layers=layers)


def _linear_sources(ctx: BuildContext, checkpoints: dict[str, str], load_weights: WeightPrecision) -> dict[str, str]:
    """What the manifest says each model's torch-runtime linears are, and where they come from."""
    assert ctx.serving is not None
    out = {}
    for role, served in ctx.serving.weights.items():
        if role not in ctx.weight_roles():
            out[role] = "the target's weights, quantized at load (self draft)"
        elif role in checkpoints:
            out[role] = f"{served.value} from {ctx.checkpoints[role]['dir']}"
        elif served is load_weights and served.value != "float32":
            out[role] = f"{served.value}, quantized at load"
        else:
            out[role] = "float32"
    return out


def _int4_group(ctx: BuildContext) -> int:
    assert ctx.plan is not None
    groups = {m.int4_group_size for m in ctx.plan.models if m.int4_group_size}
    return groups.pop() if len(groups) == 1 else 0


def _compiled_engines(ctx: BuildContext, file_dir: Path) -> TrtllmConfig | None:
    """The deployment's engines when every engine of the build compiled (the repository then
    serves them with the trtllm runtime), else None (it serves the torch weights)."""
    from triton_backend.engines.trtllm.trtllm_config import TrtllmConfig, TrtllmTargetKind

    if not ctx.engines or any(e.status is not EngineStatus.COMPILED for e in ctx.engines):
        return None
    dirs = {e.role: relative_to_file(ctx.out / e.engine_dir, file_dir) for e in ctx.engines}
    kind = TrtllmTargetKind.MEDUSA if ctx.spec.medusa is not None else TrtllmTargetKind.DRAFT_TOKENS_EXTERNAL
    return TrtllmConfig(target_engine=dirs["target"], target_kind=kind, draft_engine=dirs.get("draft"))


def _stages(ctx: BuildContext) -> list[tuple[str, Callable[[BuildContext], None]]]:
    stages: list[tuple[str, Callable[[BuildContext], None]]] = [("plan", _stage_plan), ("torch weights", _stage_torch_weights)]
    if not ctx.options.torch_only:
        roles = ["target"] + (["draft"] if ctx.spec.draft is not None else [])
        stages += [(f"quantize+export {role}", _stage_checkpoint(role)) for role in roles]
        stages.append(("compile", _stage_compile))
    if ctx.spec.quality.enabled and not ctx.options.skip_quality:
        stages.append(("quality", _stage_quality))
    stages.append(("model repository", _stage_repository))
    return stages


def run_build(spec: BuildSpec, options: BuildOptions) -> BuildResult:
    """Run every stage into ``options.output_dir`` and write the manifest last."""
    import torch
    from tqdm.auto import tqdm

    ctx = BuildContext(spec=spec, options=options, out=prepare_output(options))
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        stages = _stages(ctx)
        with tqdm(total=len(stages), desc="build", unit="stage", disable=not options.progress) as bar:
            for name, stage in stages:
                bar.set_description(name)
                start = time.perf_counter()
                stage(ctx)
                ctx.stages.append({"name": name, "seconds": round(time.perf_counter() - start, 2)})
                bar.update()
    finally:
        torch.set_num_threads(threads)
    return _finish(ctx)


def _finish(ctx: BuildContext) -> BuildResult:
    assert ctx.plan is not None and ctx.serving is not None
    if ctx.options.torch_only:
        ctx.notices.append("torch-only build: no quantization, no TensorRT-LLM checkpoints, no engines")
    for engine in ctx.engines:
        if engine.status is not EngineStatus.COMPILED:
            ctx.notices.append(f"{engine.role} engine {engine.status.value.upper()}: {engine.detail}")
    ctx.notices += [f"torch runtime, {role}: {note}" for role, note in ctx.serving.notes.items()]
    content = {
        "spec": ctx.spec.to_dict(), "plan": ctx.plan.to_dict(),
        "precisions": {m.role: {"weights": m.precision.value, "kv_cache": ctx.plan.kv_cache_dtype.value}
                       for m in ctx.plan.models},
        "checkpoints": ctx.checkpoints,
        "engines": {e.role: e.to_dict() for e in ctx.engines},
        "engines_compiled": bool(ctx.engines) and all(e.status is EngineStatus.COMPILED for e in ctx.engines),
        "build_script": "build_engines.sh" if ctx.engines else None,
        "torch_runtime": {**ctx.serving.to_dict(), "weights": {role: f"weights/{role}" for role in ctx.weight_roles()}},
        "quality": ctx.quality or {"skipped": "quality stage off (--skip-quality or quality.enabled: false)"},
        "model_repo": ctx.repository, "stages": ctx.stages, "notices": ctx.notices,
    }
    hashed = [p for p in ("plan.json", "weights", "checkpoints", "engines", "build_engines.sh", "model_repo")
              if (ctx.out / p).exists()]
    path = write_manifest(ctx.out, content, hashed)
    logger.info("build complete: %s", path)
    return BuildResult(ctx.out, path, ctx.plan, ctx.engines, ctx.notices, ctx.quality)
