"""Stop conditions and incremental detokenization on the real tokenizer (no model weights run)."""

from __future__ import annotations

import pytest

from triton_backend.core.config import FinishReason, SamplingParams
from triton_backend.core.text import IncrementalDetokenizer, StopChecker, held_back


@pytest.fixture(scope="module")
def tokenizer():
    from triton_backend.engines.torch.model_loading import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def _feed(checker, tokens):
    generated: list[int] = []
    for t in tokens:
        generated.append(t)
        reason = checker.after_append(generated)
        if reason:
            return generated, reason
    return generated, None


def test_held_back():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back([1, 2, 3], [(3, 4)]) == 1
    assert held_back([1, 2, 3], [(2, 3)]) == 0  # a complete match is not a proper prefix


def test_eos_is_dropped(tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=10), frozenset({2}), tokenizer)
    generated, reason = _feed(checker, [100, 200, 2, 300])
    assert generated == [100, 200] and reason is FinishReason.EOS


def test_ignore_eos_and_length(tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True), frozenset({2}), tokenizer)
    generated, reason = _feed(checker, [100, 2, 300, 400])
    assert generated == [100, 2, 300] and reason is FinishReason.LENGTH


def test_stop_token_sequence_truncates_exactly(tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=10, stop_token_ids=((7, 8),)), frozenset(), tokenizer)
    generated, reason = _feed(checker, [5, 7, 6, 7, 8, 9])
    assert generated == [5, 7, 6] and reason is FinishReason.STOP


def test_stop_string_cuts_text(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    checker = StopChecker(SamplingParams(max_tokens=50, stop=("END",)), frozenset(), tokenizer)
    generated, reason = _feed(checker, ids)
    assert reason is FinishReason.STOP
    detok = IncrementalDetokenizer(tokenizer, ("END",))
    assert detok.update(generated, final=True, text_cut=checker.text_cut) == "The answer is 42. "


def test_streaming_never_splits_multibyte_or_leaks_stop_prefix(tokenizer):
    text = "Café 東京 🙂 done STOP here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ("STOP",))
    pieces = []
    for i in range(1, len(ids) + 1):
        piece = detok.update(ids[:i], final=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert text.startswith("".join(pieces))
    pieces.append(detok.update(ids, final=True))
    assert "".join(pieces) == text


def test_streaming_holds_back_a_possible_stop_string(tokenizer):
    ids = tokenizer.encode("hello wor", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ("world",))
    assert detok.update(ids, final=False) == "hello "
    assert detok.update(ids, final=True) == "wor"
