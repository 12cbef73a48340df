"""``specbuild bench ngram-replay``: n-gram speculation replayed over recorded greedy outputs
in pass-cost units, with the real n-gram session and controller (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.bench.ngram_replay import ReplayConfig, cost_model, prompt_sets, replay, replay_table
from builder.cli.main import main as cli_main
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SpeculationConfig
from triton_backend.core.errors import ConfigError

FLAT = "1:1,2:1,3:1,4:1,5:1,6:1,7:1,8:1,9:1"  # verifying k+1 tokens costs one step: drafting always pays
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def _spec(k: int) -> SpeculationConfig:
    return SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=FallbackConfig(enabled=False))


def test_a_copied_output_is_accepted_and_cheaper_than_plain() -> None:
    trace: list[str] = []
    done = replay(PROMPT, PROMPT[2:] + [1], _spec(4), cost_model(FLAT), 64, trace)
    assert done.accepted > 0 and done.accepted <= done.drafted
    assert done.passes < len(PROMPT) - 1  # fewer passes than tokens
    assert done.tokens / done.cost > 1.5  # cost units: plain pays one step a token
    assert len(trace) == done.passes and any(t != "-" and t.split("/")[1] != "0" for t in trace)


def test_an_output_that_never_matches_gains_nothing() -> None:
    done = replay(PROMPT, list(range(100, 120)), _spec(4), cost_model(FLAT), 64)
    assert done.accepted == 0 and done.passes == 20 and done.tokens == 19
    assert done.tokens / done.cost == pytest.approx(1.0)


def test_cli_prints_the_table_and_refuses_bad_input(tmp_path: Path, capsys) -> None:
    records = tmp_path / "records.json"
    records.write_text(json.dumps([{"set": "bench", "workload": "copy", "prompt": PROMPT, "output": PROMPT[2:]},
                                   {"set": "tune", "workload": "chat", "prompt": PROMPT, "output": [99] * 4}]))
    assert cli_main(["bench", "ngram-replay", str(records), "--ngram-k", "4", "--costs", FLAT,
                     "--trace", "copy"]) == 0
    out = capsys.readouterr().out
    assert "| copy | 4 |" in out and "| all | 4 |" in out and "| chat |" not in out  # set bench only
    assert "k=4 bench/copy:" in out
    assert cli_main(["bench", "ngram-replay", str(tmp_path / "none.json")]) == 2
    assert cli_main(["bench", "ngram-replay", str(records), "--set", "nope"]) == 2
    assert cli_main(["bench", "ngram-replay", str(records), "--costs", "2:1"]) == 2
    with pytest.raises(ConfigError):
        replay_table(ReplayConfig(records=records, k=()))


def test_prompt_sets_hold_the_bench_prompts_and_two_held_out_sets() -> None:
    sets = prompt_sets()
    assert set(sets) == {"bench", "tune", "check"}
    assert all(len(texts) == 5 for texts in sets["bench"].values())
    assert set(sets["tune"]["copy"]).isdisjoint(sets["check"]["copy"])
