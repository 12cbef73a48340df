"""User-like drafter data (builder/train/user_prompts.py): the first pass's prompts are varied,
deterministic and free of every held-out and bench prompt by construction; the second pass turns
a finished corpus into the requests the target wrote and two-turn conversations whose assistant
turn is the target's own answer; several sampling temperatures; conversations encode through the
chat template; the held-out split is complete and in the exclusion set."""

from __future__ import annotations

import json

import pytest

from builder.errors import BuildSpecError
from builder.train import user_prompts
from builder.train.eagle_corpus import CorpusConfig, generate_corpus, iter_corpus
from builder.train.prompt_set import PromptSetConfig, heldout_split_file, heldout_texts, load_prompt_set, normalize_prompt
from builder.train.user_prompts import (KINDS, UserPromptConfig, build_user_prompts, clean_written_request,
                                        followup_prompts)


def test_heldout_split_is_complete_and_every_user_turn_is_excluded():
    split = json.loads(heldout_split_file().read_text())["workloads"]
    assert {k: len(v) for k, v in split.items()} == {"chat": 40, "code": 20, "multiturn": 20, "grounded": 10,
                                                      "arithmetic": 10}
    banned = heldout_texts()
    for conversation in split["multiturn"]:
        roles = [m["role"] for m in conversation]
        assert roles[0] == roles[-1] == "user" and all(a != b for a, b in zip(roles, roles[1:]))
        assert all(normalize_prompt(m["content"]) in banned for m in conversation if m["role"] == "user")
    for workload in ("chat", "code", "grounded", "arithmetic"):
        assert all(normalize_prompt(p) in banned for p in split[workload])


def test_user_prompts_are_varied_deterministic_and_held_out_free():
    a = build_user_prompts(UserPromptConfig(size=1500, seed=3))
    assert a == build_user_prompts(UserPromptConfig(size=1500, seed=3))
    assert a != build_user_prompts(UserPromptConfig(size=1500, seed=4))
    kinds = {p["kind"] for p in a}
    assert kinds == set(KINDS)
    keys = [normalize_prompt(p["prompt"]) for p in a]
    assert len(set(keys)) == len(keys) >= 1400
    assert not set(keys) & heldout_texts()
    # variety: no request frame dominates (first four words of chat requests)
    heads = [" ".join(k.split()[:4]) for p, k in zip(a, keys) if p["kind"] == "chat"]
    assert max(heads.count(h) for h in set(heads)) < 0.1 * len(heads) and len(set(heads)) > 0.2 * len(heads)


def test_a_generated_prompt_equal_to_a_held_out_one_is_dropped(monkeypatch):
    held = json.loads(heldout_split_file().read_text())["workloads"]["chat"][0]
    monkeypatch.setattr(user_prompts, "_advice", lambda rng, s: held)  # the generator hits a held-out prompt
    out = build_user_prompts(UserPromptConfig(size=400, seed=0))
    assert normalize_prompt(held) not in {normalize_prompt(p["prompt"]) for p in out}


def test_clean_written_request():
    assert clean_written_request('Message: "Can you help me plan a trip to Rome for four days?"') == \
        "Can you help me plan a trip to Rome for four days?"
    assert clean_written_request("Question 1: How do volcanoes form?\n\nAnswer: ...") == "How do volcanoes form?"
    assert clean_written_request("Sure! Here is a question for you.") is None
    assert clean_written_request("Hi") is None
    assert clean_written_request('A journalist might ask: "What is the hardest part of your job?" It is a good one.') \
        == "What is the hardest part of your job?"
    assert clean_written_request("I'm here to help you plan your travel. Where are you going?") is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from build_fixtures import make_tiny_llama
    from triton_backend.core.reference_model import ensure_reference_model

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), ensure_reference_model(), hidden=64, layers=2,
                           intermediate=128)


def test_two_passes_users_then_followups(tiny, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(user_prompts, "_DEFAULT_SHARES", {**user_prompts._DEFAULT_SHARES, "self_instruct": 0.5})
    first = CorpusConfig(target=str(tiny), out_dir=str(tmp_path / "users"), prompt_source="users",
                         prompt_set=PromptSetConfig(size=24),
                         max_new_tokens=12, rows=4, shard_size=8, max_shards=2, max_prompt_tokens=96,
                         temperatures=(0.6, 1.0), sampled_share=0.75, log_every_s=0.0)
    generate_corpus(first)
    meta = json.loads((tmp_path / "users" / "meta.json").read_text())
    assert meta["prompt_source"] == "users" and meta["temperatures"] == [0.6, 1.0]
    temps = {round(t, 4) for _, _, t in iter_corpus(tmp_path / "users")}
    assert temps <= {0.0, 0.6, 1.0} and len(temps) >= 2
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    # the random target writes no usable request; conversations still carry its own answers
    convs = followup_prompts(tmp_path / "users", tokenizer, seed=1, multiturn_share=1.0)
    firsts = load_prompt_set(tmp_path / "users" / "prompts.jsonl.gz")
    answered = {s["prompt"] for s in firsts[:16] if s["kind"] != "self_instruct"}
    assert convs and all(c["kind"] in ("multiturn", "self_written") for c in convs)
    for c in (c for c in convs if c["kind"] == "multiturn"):
        assert [m["role"] for m in c["messages"]] == ["user", "assistant", "user"]
        assert c["messages"][0]["content"] in answered
    second = CorpusConfig(target=str(tiny), out_dir=str(tmp_path / "follow"), prompt_source="followups",
                          followup_from=str(tmp_path / "users"), max_new_tokens=6, rows=4, shard_size=8, max_shards=1,
                          max_prompt_tokens=256, log_every_s=0.0)
    stats = generate_corpus(second)
    assert stats.positions > 0
    turns = [tokenizer.decode(tokens[:plen].tolist()).count("<|im_start|>user")
             for tokens, plen, _ in iter_corpus(tmp_path / "follow")]
    assert set(turns) <= {1, 2} and 2 in turns  # conversations carry their history in the context
    with pytest.raises(BuildSpecError, match="followup_from"):
        CorpusConfig(target=str(tiny), out_dir=str(tmp_path / "x"), prompt_source="followups")
    with pytest.raises(BuildSpecError, match="temperatures"):
        CorpusConfig(target=str(tiny), out_dir=str(tmp_path / "x"), temperatures=(0.0,))
