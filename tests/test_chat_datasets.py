"""Users' requests from a ShareGPT-format conversation file (builder/train/chat_datasets.py): a
file cut off part-way through a record gives its complete records; only conversations that start
with the user give a request; non-English, over-long, duplicate and held-out requests are dropped."""

from __future__ import annotations

import json

import pytest

from builder.errors import BuildSpecError
from builder.train.chat_datasets import conversation_prompts, read_sharegpt
from builder.train.prompt_set import heldout_split_file


def _record(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_cut_off_file_and_filters(tmp_path):
    held = json.loads(heldout_split_file().read_text())["workloads"]["chat"][0]
    records = [
        _record(0, ("human", "How do I bake bread at home?"), ("gpt", "Mix flour..."), ("human", "And rye?")),
        _record(1, ("gpt", "continuing an earlier answer"), ("human", "What about the second step?")),
        _record(2, ("human", "Wie backe ich Brot? Schöne Grüße aus München, äöü ßßß"), ("gpt", "...")),
        _record(3, ("human", "How do I bake bread at home?"), ("gpt", "duplicate request")),
        _record(4, ("human", held), ("gpt", "a held-out prompt")),
        _record(5, ("human", "x" * 5000), ("gpt", "too long")),
        _record(6, ("human", "Write a haiku about autumn leaves."), ("gpt", "...")),
    ]
    text = json.dumps(records, indent=1)
    cut = text[:text.index('"r6"') + 30]  # the file ends part-way through record 6
    path = tmp_path / "conversations.json"
    path.write_text(cut)
    assert [r["id"] for r in read_sharegpt(path)] == [f"r{i}" for i in range(6)]
    path.write_text(text)
    prompts = conversation_prompts(path, size=10, seed=0)
    assert sorted(p["prompt"] for p in prompts) == ["How do I bake bread at home?", "Write a haiku about autumn leaves."]
    assert {p["kind"] for p in prompts} == {"conversation"}
    assert len(conversation_prompts(path, size=1)) == 1
    path.write_text("{}")
    with pytest.raises(BuildSpecError):
        conversation_prompts(path, size=1)
