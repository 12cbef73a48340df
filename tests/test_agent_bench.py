"""The agent benchmark's parts that need no server (builder/loadtest/agent_bench.py, scripts/agent_bench.py):
the committed conversations are what the OpenAI front accepts, long enough to be an agent's, and the
report writes the headline only when every arm answered as plain decoding did. The run itself starts
four servers and takes many minutes on CPU: `scripts/agent_bench.py` (benchmarks/results/agent-bench-cpu.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from builder.loadtest.agent_bench import (ARMS, CONVERSATIONS, AgentBenchConfig, ArmResult, TurnResult,
                                          load_conversations, summarize, turn_messages, write_report)
from triton_backend.core.errors import ConfigError
from triton_backend.serving.front.openai.openai_request import Capabilities, Endpoint, parse_request

ROOT = Path(__file__).resolve().parents[1]
CAPS = Capabilities(frozenset({"text_input", "max_tokens", "guided_decoding_guide_type", "guided_decoding_guide"}))


def _history(data: dict, conv: dict) -> list[dict]:
    messages = [{"role": "system", "content": data["system"]}]
    for turn in conv["turns"]:
        messages += turn_messages(turn) + [{"role": "assistant", "content": "Done."}]
    return messages


def test_the_committed_conversations_are_valid_tool_loops_sharing_a_long_agent_prompt() -> None:
    from triton_backend.core.reference_model import DEFAULT_REFERENCE
    from triton_backend.engines.torch.model_loading import load_tokenizer

    data = load_conversations(CONVERSATIONS)
    assert len(data["conversations"]) >= 2
    shared = None
    for conv in data["conversations"]:
        assert len(conv["turns"]) >= 3 and all(turn["tool_calls"] for turn in conv["turns"])
        request = parse_request({"model": "m", "messages": _history(data, conv), "tools": data["tools"],
                                 "tool_choice": "auto"}, Endpoint.CHAT, CAPS)  # the front's own checks
        system = request.messages[0]
        assert system.role == "system" and shared in (None, system.content)  # one prefix for every conversation
        shared = system.content
    assert len(load_tokenizer(DEFAULT_REFERENCE).encode(shared)) >= 1500


def test_bad_settings_are_typed_errors_and_the_script_says_so(capsys) -> None:
    for bad in ({"arms": ("plain", "fastest")}, {"arms": ()}, {"turns": 0}, {"max_tokens": -1}):
        with pytest.raises(ConfigError):
            AgentBenchConfig(**bad)
    spec = importlib.util.spec_from_file_location("agent_bench_script", ROOT / "scripts" / "agent_bench.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--arms", "plain,fastest"]) == 2
    assert "arms must be among" in capsys.readouterr().err


def _arm(name: str, wall_s: float, texts: list[str], ttft_s: float) -> ArmResult:
    turns = [TurnResult("c", i, ttft_s, ttft_s + 1, 100, 10, text) for i, text in enumerate(texts)]
    return ArmResult(ARMS[name], wall_s, turns)


def test_the_headline_is_full_over_plain_and_only_when_their_answers_matched(tmp_path: Path) -> None:
    data = load_conversations(CONVERSATIONS)
    config = AgentBenchConfig(out=tmp_path, headline=tmp_path / "headline.json")
    same = summarize([_arm("plain", 40.0, ["a", "b"], 8.0), _arm("full", 10.0, ["a", "b"], 2.0)], config, data)
    assert same["identical"] and same["headline"] == {"agent_bench_x_plain": 4.0, "agent_bench_ttft_x_plain": 0.25}
    paths = write_report(same, config)
    assert json.loads(paths["headline"].read_text())["agent_bench_x_plain"] == 4.0
    assert str(tmp_path) not in paths["json"].read_text()  # repository-relative paths only
    differs = summarize([_arm("plain", 40.0, ["a", "b"], 8.0), _arm("full", 10.0, ["a", "x"], 2.0)], config, data)
    assert not differs["identical"] and differs["headline"] == {}
    failed = _arm("spec", 20.0, ["a"], 4.0)
    failed.errors.append("a conversation failed")  # another arm's failure is reported, the headline's arms stand
    other = summarize([_arm("plain", 40.0, ["a", "b"], 8.0), _arm("full", 10.0, ["a", "b"], 2.0), failed], config, data)
    assert not other["identical"] and other["headline"]["agent_bench_x_plain"] == 4.0
