"""Engine compile: the exact ``trtllm-build`` command line of each role.

* target (draft model or n-gram drafting): ``--speculative_decoding_mode draft_tokens_external
  --max_draft_len K`` so the engine verifies K external draft tokens per step;
* target with Medusa heads: ``--speculative_decoding_mode medusa`` (the tree size comes from
  the checkpoint's ``max_draft_len``);
* draft: a normal engine.

Every engine gets paged context FMHA (KV-cache reuse between draft rounds), the spec's batch
and length limits, and ``--gather_generation_logits`` (exact rejection sampling needs the
logits of both models). The commands always go into ``build_engines.sh`` in the output; they
run when ``trtllm-build`` is on PATH, and an engine is "compiled" only when the tool exited 0
and every rank's engine file exists.
"""

from __future__ import annotations

import enum
import logging
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.plan.types import Plan
from builder.plan.spec import BuildSpec

logger = logging.getLogger(__name__)

TRTLLM_BUILD = "trtllm-build"
SCRIPT_NAME = "build_engines.sh"


class CompileMode(str, enum.Enum):
    AUTO = "auto"  # run trtllm-build when it is on PATH, else write the script only
    SCRIPT = "script"  # write the script only


class EngineStatus(str, enum.Enum):
    COMPILED = "compiled"
    NOT_COMPILED = "not compiled"
    FAILED = "failed"


@dataclass(frozen=True)
class EngineBuild:
    """One ``trtllm-build`` invocation; paths are relative to the build's output folder."""

    role: str
    checkpoint_dir: str
    engine_dir: str
    ranks: int
    args: tuple[str, ...]

    @property
    def argv(self) -> list[str]:
        return [TRTLLM_BUILD, "--checkpoint_dir", self.checkpoint_dir, "--output_dir", self.engine_dir, *self.args]

    def shell(self) -> str:
        parts = [shlex.quote(a) for a in self.argv]
        lines, i = [parts[0]], 1
        while i < len(parts):
            take = 2 if i + 1 < len(parts) and not parts[i + 1].startswith("--") else 1
            lines.append(" ".join(parts[i:i + take]))
            i += take
        return " \\\n    ".join(lines)


@dataclass(frozen=True)
class EngineResult:
    role: str
    status: EngineStatus
    engine_dir: str
    command: list[str]
    detail: str
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "engine_dir": self.engine_dir, "command": self.command,
                "detail": self.detail, "seconds": round(self.seconds, 2)}


def _common_args(spec: BuildSpec, plan: Plan) -> list[str]:
    lim = spec.limits
    # With external draft tokens every round is a new request whose input is the whole context so
    # far, so the input may grow into the output budget: such engines take inputs up to
    # max_seq_len - 1. A Medusa engine drafts inside one request and keeps the spec's input limit.
    input_len = lim.max_input_len if spec.medusa is not None else lim.max_seq_len - 1
    args = ["--gemm_plugin", "auto", "--max_batch_size", str(lim.max_batch_size), "--max_input_len",
            str(input_len), "--max_seq_len", str(lim.max_seq_len), "--max_num_tokens", str(lim.max_num_tokens),
            "--use_paged_context_fmha", "enable", "--gather_generation_logits"]
    if plan.tp * plan.pp > 1:
        args += ["--workers", str(plan.tp * plan.pp)]
    return args


def engine_builds(spec: BuildSpec, plan: Plan) -> list[EngineBuild]:
    """The ``trtllm-build`` invocations this plan needs, target first."""
    ranks = plan.tp * plan.pp
    common = _common_args(spec, plan)
    if spec.medusa is not None:
        speculative = ["--speculative_decoding_mode", "medusa"]
    else:
        speculative = ["--speculative_decoding_mode", "draft_tokens_external",
                       "--max_draft_len", str(spec.limits.max_draft_len)]
    builds = [EngineBuild("target", "checkpoints/target", "engines/target", ranks, tuple(common + speculative))]
    if spec.draft is not None:
        builds.append(EngineBuild("draft", "checkpoints/draft", "engines/draft", ranks, tuple(common)))
    return builds


def write_script(builds: list[EngineBuild], out_dir: Path, plan: Plan) -> Path:
    header = [
        "#!/usr/bin/env bash",
        "# Compile this build's TensorRT-LLM engines (written by `specbuild build`).",
        f"# Needs TensorRT-LLM's trtllm-build on a machine with {plan.tp * plan.pp} x {plan.gpu.name}.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        "",
    ]
    groups = {m.role: m.int4_group_size for m in plan.models if m.int4_group_size}
    body = [(f"# {b.role}: INT4-AWQ in groups of {groups[b.role]} input channels (the checkpoint's "
             f"quantization.group_size)\n" if b.role in groups else "") + b.shell() + "\n" for b in builds]
    path = out_dir / SCRIPT_NAME
    path.write_text("\n".join(header) + "\n".join(body))
    path.chmod(0o755)
    return path


def trtllm_build_available() -> str | None:
    return shutil.which(TRTLLM_BUILD)


def compile_engines(builds: list[EngineBuild], out_dir: Path, plan: Plan,
                    mode: CompileMode = CompileMode.AUTO) -> list[EngineResult]:
    """Write the script, then run each build when ``trtllm-build`` is available."""
    script = write_script(builds, out_dir, plan)
    tool = trtllm_build_available() if mode is CompileMode.AUTO else None
    if tool is None:
        why = (f"{TRTLLM_BUILD} is not on PATH (TensorRT-LLM is not installed here)" if mode is CompileMode.AUTO
               else "compile was not asked for")
        detail = f"{why}; run {script.name} on a machine with TensorRT-LLM and the planned GPUs"
        logger.warning("engines NOT compiled: %s", detail)
        return [EngineResult(b.role, EngineStatus.NOT_COMPILED, b.engine_dir, b.argv, detail) for b in builds]
    return [_run_build(b, out_dir) for b in builds]


def _run_build(build: EngineBuild, out_dir: Path) -> EngineResult:
    engine_dir = out_dir / build.engine_dir
    engine_dir.mkdir(parents=True, exist_ok=True)
    log_path = engine_dir / "trtllm-build.log"
    logger.info("compiling the %s engine: %s", build.role, " ".join(build.argv))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(build.argv, cwd=out_dir, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    engines = [engine_dir / f"rank{r}.engine" for r in range(build.ranks)]
    missing = [e.name for e in engines if not e.is_file()]
    if proc.returncode == 0 and not missing and (engine_dir / "config.json").is_file():
        return EngineResult(build.role, EngineStatus.COMPILED, build.engine_dir, build.argv,
                            f"{len(engines)} engine file(s)", seconds)
    tail = log_path.read_text(errors="replace")[-800:]
    detail = (f"{TRTLLM_BUILD} exited {proc.returncode}" if proc.returncode else f"engine files missing: {missing}")
    logger.error("the %s engine failed to compile: %s", build.role, detail)
    return EngineResult(build.role, EngineStatus.FAILED, build.engine_dir, build.argv,
                        f"{detail}; log {build.engine_dir}/trtllm-build.log ends: {tail}", seconds)
