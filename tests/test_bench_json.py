"""``specbuild bench json`` (builder/bench/guided_json.py, guided_json_report.py): the prompt file,
the rows, the token-for-token and schema checks, the headline figures and where they are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.bench.guided_json import (DEFAULT_JSON_PROMPTS, JsonBenchConfig, JsonBenchRun, JsonPrompt, JsonSample,
                                       load_json_prompts, rows_for)
from builder.bench.guided_json_report import is_valid, json_markdown, summarize_json, write_json_report
from builder.bench.writer import ReportTarget
from builder.cli.main import main as cli_main
from builder.headline import HEADLINE_PATH
from triton_backend.serving.front.openai.tools import parse_tools
from triton_backend.core.errors import ConfigError

FLAG = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
ANSWER = {"type": "function", "function": {"name": "answer", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["colour"],
    "properties": {"colour": {"enum": ["red", "green", "blue"]}}}}}
TINY = {"prompts": [
    {"name": "flag", "kind": "extraction", "text": "Is the sky blue? Answer as JSON with the key ok.", "schema": FLAG},
    {"name": "colour", "kind": "tool_call", "text": "Which colour is grass?", "tools": [ANSWER],
     "tool_choice": {"type": "function", "function": {"name": "answer"}}}]}
KEYS = {"guided_json_x_plain", "guided_plain_x_unconstrained", "guided_valid_share"}


def test_the_committed_prompt_file_has_varied_prompts_whose_schemas_compile() -> None:
    prompts = load_json_prompts(DEFAULT_JSON_PROMPTS)
    assert len(prompts) >= 8 and {p.kind for p in prompts} == {"extraction", "tool_call"}
    raw = {e["name"]: e for e in json.loads(DEFAULT_JSON_PROMPTS.read_text())["prompts"]}
    for prompt in prompts:
        if prompt.kind == "tool_call":  # shown and decoded as the OpenAI front does a forced call
            plan = parse_tools(raw[prompt.name])
            system, user = prompt.messages
            assert system == {"role": "system", "content": plan.instructions()} and prompt.schema == plan.schema()
            assert user["content"] == raw[prompt.name]["text"]
    assert any(parse_tools(e).named is None for e in raw.values() if e["kind"] == "tool_call")  # required, several


@pytest.mark.parametrize("entry, match", [
    ({"name": "x", "kind": "extraction", "text": "t"}, "needs a 'schema'"),
    ({"name": "x", "kind": "poem", "text": "t"}, "needs 'kind'"),
    ({"name": "x", "kind": "extraction", "text": "t", "schema": {"type": "nonsense"}}, "nonsense"),
    ({"name": "x", "kind": "tool_call", "text": "t", "tools": [ANSWER], "tool_choice": "auto"}, "auto"),
    ({"name": "x", "kind": "tool_call", "text": "t", "tools": [ANSWER], "tool_choice": "none"}, "forces a call"),
])
def test_a_bad_prompt_file_is_refused(tmp_path: Path, entry: dict, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"prompts": [entry]}))
    with pytest.raises(ConfigError, match=match):
        load_json_prompts(path)


def test_validity_is_checked_against_the_schema_not_only_parsed() -> None:
    assert is_valid('{"ok": true}', FLAG)
    assert not is_valid('{"ok": "yes"}', FLAG) and not is_valid('{"ok": tr', FLAG) and not is_valid("", FLAG)


def _run(tmp_path: Path, speed: dict[str, float], *, texts: dict[str, str] | None = None,
         tokens: dict[str, list[int]] | None = None) -> JsonBenchRun:
    """Two prompts x two repeats; a row's requests take 1/speed s for 10 tokens (decode: 9 in 0.9/speed)."""
    config = JsonBenchConfig(prompts_file=DEFAULT_JSON_PROMPTS, repeats=2, out_dir=tmp_path)
    prompts = [JsonPrompt("a", "extraction", ({"role": "user", "content": "a"},), FLAG),
               JsonPrompt("b", "extraction", ({"role": "user", "content": "b"},), FLAG)]
    run = JsonBenchRun(config, prompts, rows_for(config))
    for row in run.rows:
        for prompt in prompts:
            for repeat in range(2):
                text = (texts or {}).get(row.name, '{"ok": true}' if row.constrained else "Yes, it is.")
                ids = (tokens or {}).get(row.name, list(range(10)))
                run.samples.append(JsonSample(row.name, prompt.name, repeat, ids, text, 1 / speed[row.name],
                                              0.9 / speed[row.name], 5, "eos"))
    return run


SPEED = {"unconstrained plain": 1.0, "constrained plain": 0.95, "constrained plain + forced": 1.5,
         "constrained ngram k=4 + forced": 2.5}


def test_summary_rows_checks_and_headline_figures(tmp_path: Path) -> None:
    summary = summarize_json(_run(tmp_path, SPEED))
    assert [e["row"] for e in summary["rows"]] == list(SPEED)
    assert summary["headline"] == {"guided_json_x_plain": pytest.approx(2.5 / 0.95),
                                   "guided_plain_x_unconstrained": pytest.approx(0.95),
                                   "guided_valid_share": 1.0}
    rows = {e["row"]: e for e in summary["rows"]}
    assert rows["constrained plain"]["identical_to_constrained_plain"] and rows["unconstrained plain"]["valid"] == 0
    assert "identical_to_constrained_plain" not in rows["unconstrained plain"]
    assert rows["constrained ngram k=4 + forced"]["speculative"] and not rows["constrained plain"]["speculative"]
    assert "| constrained ngram k=4 + forced | 4 | 40 |" in json_markdown(summary)
    broken = summarize_json(_run(tmp_path, SPEED, texts={"constrained plain + forced": '{"ok": 1}'},
                                 tokens={"constrained plain + forced": [1, 2, 3]}))
    assert "guided_json_x_plain" not in broken["headline"]  # an output that differs: no speed figure
    assert broken["headline"]["guided_valid_share"] == pytest.approx(8 / 12)


def test_the_report_writes_its_keys_to_the_given_headline_file_only(tmp_path: Path) -> None:
    before = HEADLINE_PATH.read_bytes()
    summary = summarize_json(_run(tmp_path, SPEED))
    paths = write_json_report(summary, ReportTarget(tmp_path / "out", "t", tmp_path / "h.json"))
    assert set(json.loads((tmp_path / "h.json").read_text())) == KEYS and paths["headline"] == tmp_path / "h.json"
    assert json.loads(paths["json"].read_text())["headline"] == summary["headline"]
    assert "headline" not in write_json_report(summary, ReportTarget(tmp_path / "none", "t"))  # None: nothing written
    assert not (tmp_path / "none" / "headline.json").exists() and HEADLINE_PATH.read_bytes() == before


@pytest.mark.slow
def test_bench_json_runs_every_row_checks_them_and_its_keys_follow_out(tmp_path: Path) -> None:
    prompts = tmp_path / "tiny.json"
    prompts.write_text(json.dumps(TINY))
    before = HEADLINE_PATH.read_bytes()
    common = ["bench", "json", "--prompts", str(prompts), "--max-tokens", "16", "--repeats", "1",
              "--ngram-k", "3", "--label", "t"]
    assert cli_main([*common, "--out", str(tmp_path / "x")]) == 0
    figures = json.loads((tmp_path / "x" / "headline.json").read_text())
    assert set(figures) == KEYS and figures["guided_valid_share"] == 1.0
    summary = json.loads((tmp_path / "x" / "guided-json-t.json").read_text())
    rows = {e["row"]: e for e in summary["rows"]}
    assert list(rows) == ["unconstrained plain", "constrained plain", "constrained plain + forced",
                          "constrained ngram k=3 + forced"]
    assert all(e["identical_to_constrained_plain"] and e["valid"] == 2 for e in rows.values() if e["constrained"])
    assert rows["constrained plain + forced"]["target_passes"] < rows["constrained plain"]["target_passes"]
    assert cli_main([*common, "--out", str(tmp_path / "y"), "--headline", str(tmp_path / "h.json")]) == 0
    assert set(json.loads((tmp_path / "h.json").read_text())) == KEYS
    assert not (tmp_path / "y" / "headline.json").exists() and HEADLINE_PATH.read_bytes() == before
