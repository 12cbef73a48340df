"""``specbuild plan`` and ``specbuild build``: flags (and an optional spec file) -> one
:class:`BuildSpec` -> :func:`plan_deployment` / :func:`run_build`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from builder.cli.args import given
from builder.stages.compile import CompileMode
from builder.errors import BuildSpecError
from builder.plan.spec import BuildSpec, GpuTarget, MedusaSpec, ModelSpec, Parallelism, TorchRuntimeSpec
from triton_backend.core.reference_model import DEFAULT_REFERENCE


def _tp(value: str) -> int | str:
    return "auto" if value.strip().lower() == "auto" else int(value)


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None, help="build spec file (.yaml, .toml or .json); flags override it")
    p.add_argument("--target", default=None, help=f"target model (default {DEFAULT_REFERENCE}): reference name, HF "
                   "directory, .gguf file, or an architecture-only config (llama-3-70b, llama-3-8b, llama-3.2-1b)")
    p.add_argument("--draft", default=None, help="draft model sharing the target's tokenizer, or 'self': the target's "
                   "own weights at --draft-precision (default auto: the best quantized precision that fits)")
    p.add_argument("--draft-layers", type=int, default=None, help="with --draft self: the draft's layer count "
                   "(evenly spaced from layer 0; torch runtime only)")
    p.add_argument("--precision", default=None, help="target precision: auto, fp16, bf16, fp8, int8_sq, int4_awq")
    p.add_argument("--draft-precision", default=None, help="draft precision (same choices)")
    p.add_argument("--medusa-heads", type=int, default=None, help="plan/build Medusa heads on the target (count)")
    p.add_argument("--medusa-layers", type=int, default=None, help="residual layers per Medusa head (default 1)")
    p.add_argument("--medusa-source", default=None, help="trained Medusa heads (.safetensors)")
    p.add_argument("--gpu", default=None, help="GPU kind, e.g. h100-80gb, h200-141gb, a100-40gb, a100-80gb, l40s, rtx4090")
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--max-draft-len", type=int, default=None, help="draft length K")
    p.add_argument("--max-num-tokens", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default=None, help="auto, fp16, fp8 or int8")
    p.add_argument("--tp", type=_tp, default=None, help="tensor parallel size or 'auto'")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size")
    p.add_argument("--workspace-gib", type=float, default=None, help="reserve per GPU for CUDA/TensorRT workspaces")


def spec_from_args(a: argparse.Namespace) -> BuildSpec:
    base = BuildSpec.load(a.spec) if a.spec else BuildSpec(target=ModelSpec(a.target or DEFAULT_REFERENCE))
    target = replace(base.target, **given(source=a.target, precision=a.precision))
    draft = base.draft
    if a.draft is not None:
        draft = replace(draft or ModelSpec(a.draft), source=a.draft)
    if a.draft_layers is not None:
        if draft is None:
            raise BuildSpecError("--draft-layers needs --draft self (or the spec's self draft)")
        draft = replace(draft, layers=a.draft_layers)
    if a.draft_precision is not None:
        if draft is None:
            raise BuildSpecError("--draft-precision needs a draft model (--draft or the spec's draft)")
        draft = replace(draft, precision=a.draft_precision)
    medusa = base.medusa
    if a.medusa_heads is not None or a.medusa_layers is not None or a.medusa_source is not None:
        medusa = replace(medusa or MedusaSpec(), **given(num_heads=a.medusa_heads, num_layers=a.medusa_layers,
                                                          source=a.medusa_source))
    limits = replace(base.limits, **given(max_batch_size=a.max_batch_size, max_input_len=a.max_input_len,
                                           max_output_len=a.max_output_len, max_draft_len=a.max_draft_len,
                                           max_num_tokens=a.max_num_tokens))
    parallel = replace(base.parallel, **given(pp_size=a.pp))
    if a.tp is not None:
        parallel = Parallelism(tp_size=a.tp, pp_size=parallel.pp_size)
    gpu = GpuTarget(kind=a.gpu or base.gpu.kind, count=a.gpus or base.gpu.count)
    spec = replace(base, target=target, draft=draft, medusa=medusa, limits=limits, parallel=parallel, gpu=gpu)
    spec = spec.with_overrides(kv_cache_dtype=a.kv_cache_dtype, workspace_gib=a.workspace_gib)
    return _build_overrides(spec, a)


def _build_overrides(spec: BuildSpec, a: argparse.Namespace) -> BuildSpec:
    if not hasattr(a, "output"):
        return spec
    calibration = replace(spec.calibration, **given(text_file=a.calibration_file, num_samples=a.calibration_samples,
                                                     max_length=a.calibration_max_length))
    runtime = TorchRuntimeSpec(device=a.device or spec.torch_runtime.device,
                               dtype=a.torch_dtype or spec.torch_runtime.dtype)
    quality = replace(spec.quality, **given(prompts=a.quality_prompts, max_tokens=a.quality_tokens,
                                            text_tokens=a.quality_text_tokens, min_agreement=a.min_agreement,
                                            max_ppl_ratio=a.max_ppl_ratio))
    return replace(spec, calibration=calibration, torch_runtime=runtime, quality=quality)


def cmd_plan(a: argparse.Namespace) -> int:
    from builder.plan.report import format_plan
    from builder.plan.planner import plan_deployment

    plan = plan_deployment(spec_from_args(a))
    data = json.dumps(plan.to_dict(), indent=2)
    if a.json == "-":
        print(data)
        return 0
    print(format_plan(plan))
    if a.json:
        Path(a.json).write_text(data + "\n")
        print(f"\nplan written to {a.json}")
    return 0


def cmd_build(a: argparse.Namespace) -> int:
    from builder.stages.pipeline import BuildOptions, run_build
    from builder.stages.quality import quality_line
    from builder.plan.report import format_plan

    options = BuildOptions(output_dir=Path(a.output), compile=CompileMode.SCRIPT if a.no_compile else CompileMode.AUTO,
                           torch_only=a.torch_only, force=a.force, progress=not a.no_progress,
                           device=a.calibration_device, threads=a.threads, skip_quality=a.skip_quality)
    result = run_build(spec_from_args(a), options)
    print(format_plan(result.plan))
    print()
    for role, record in result.quality.items():
        print(quality_line(role, record))
    if result.quality:
        print()
    for notice in result.notices:
        print(f"NOTICE: {notice}")
    status = "compiled" if result.engines_compiled else "NOT compiled"
    print(f"\nbuild written to {result.output_dir} (manifest {result.manifest_path.name}); engines: {status}")
    print(f"serve it with: specbuild serve {result.output_dir / 'model_repo'}")
    return 0


def register_build_commands(sub: Any) -> None:
    plan = sub.add_parser("plan", help="plan precisions / TP so the models fit the GPUs (config only, no weights)")
    add_spec_arguments(plan)
    plan.add_argument("--json", default="plan.json", help="write the plan as JSON here ('-': print JSON only; '' : don't)")
    plan.set_defaults(func=cmd_plan)

    build = sub.add_parser("build", help="quantize, export TensorRT-LLM checkpoints, compile engines, render the repository")
    add_spec_arguments(build)
    build.add_argument("-o", "--output", required=True, help="output folder (empty, or a previous build with --force)")
    build.add_argument("--calibration-file", default=None, help="calibration texts separated by blank lines")
    build.add_argument("--calibration-samples", type=int, default=None)
    build.add_argument("--calibration-max-length", type=int, default=None)
    build.add_argument("--no-compile", action="store_true", help="write build_engines.sh only, even if trtllm-build exists")
    build.add_argument("--torch-only", action="store_true", help="only the torch runtime's weights and the repository")
    build.add_argument("--device", default=None, help="torch runtime device of the rendered deployment (cpu, cuda)")
    build.add_argument("--torch-dtype", default=None, help="torch runtime dtype: auto, float32, float16, bfloat16")
    build.add_argument("--force", action="store_true", help="replace a previous build in the output folder")
    build.add_argument("--no-progress", action="store_true")
    build.add_argument("--threads", type=int, default=1, help="torch threads while calibrating")
    build.add_argument("--calibration-device", default="cpu", help="where modelopt calibrates (cpu, cuda)")
    build.add_argument("--skip-quality", action="store_true", help="no quality stage (greedy agreement and perplexity "
                       "of each quantized model against float32)")
    build.add_argument("--quality-prompts", type=int, default=None, help="held-out prompts for the greedy agreement")
    build.add_argument("--quality-tokens", type=int, default=None, help="greedy tokens per prompt")
    build.add_argument("--quality-text-tokens", type=int, default=None, help="held-out text tokens for the perplexity")
    build.add_argument("--min-agreement", type=float, default=None, help="warn below this greedy agreement (0.9)")
    build.add_argument("--max-ppl-ratio", type=float, default=None, help="warn above this perplexity ratio (1.10)")
    build.set_defaults(func=cmd_build)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `specbuild plan` or `specbuild build`")
