"""Committing and detokenizing take work linear in the output: counted in tokens handed to the
tokenizer's decode and in token-list rebuilds, never timed. Streamed text still equals the
whole decode, on the real tokenizer (no model weights run)."""

from __future__ import annotations

import random
from typing import Any, Sequence

import pytest

from triton_backend.speculation.commit import Commit
from triton_backend.core.config import FinishReason, SamplingParams
from triton_backend.core.text import IncrementalDetokenizer, held_back

TEXT = ("Café 東京 🙂 naïve — déjà vu. The quick brown fox jumps over the lazy dog; "
        "print('hello, world') # 数据 résumé ") * 40


@pytest.fixture(scope="module")
def tokenizer():
    from triton_backend.engines.torch.model_loading import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


class CountingTokenizer:
    """The real tokenizer, counting the tokens every decode call is handed."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        self.decoded += len(ids)
        return self._tokenizer.decode(ids, **kwargs)


def _blocks(tokens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 5)
        out.append(tokens[i:i + n])
        i += n
    return out


def test_commit_and_detokenize_are_linear_in_the_output(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    params = SamplingParams(max_tokens=len(ids), stop=("never appears",), ignore_eos=True)
    commit = Commit([1, 2, 3], params, eos_token_ids=frozenset(), tokenizer=counting, max_context=10**6, method="off")
    tokens = commit.tokens
    text = []
    for block in _blocks(ids, 0):
        chunk = commit.commit(block)
        assert commit.tokens is tokens  # extended in place, never rebuilt
        if chunk is not None:
            text.append(chunk.text)
    assert chunk is not None and chunk.finish_reason is FinishReason.LENGTH
    assert commit.tokens == [1, 2, 3] + ids and "".join(text) == tokenizer.decode(ids, skip_special_tokens=True)
    # per token: the stop-string check's tail (len(stop) + 4 tokens) and the detokenizer's window;
    # once: the final decode. Re-decoding the whole output every block would be ~len(ids)^2 / 6.
    assert len(ids) > 1000 and counting.decoded < 30 * len(ids)


class WholeDecode:
    """The slow reference: decode everything on every update, then hold back a trailing
    incomplete character and a possible start of a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops, self.emitted = tokenizer, tuple(stops), ""

    def update(self, tokens: Sequence[int], *, final: bool) -> str:
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - held_back(text, self.stops)]
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_text_matches_the_whole_decode_update_by_update(tokenizer, seed):
    stops = ("STOP", "dog;x", "\u6570\u636e!")
    ids = tokenizer.encode(TEXT[:700] + " STOP here", add_special_tokens=False)
    fast, slow = IncrementalDetokenizer(tokenizer, stops), WholeDecode(tokenizer, stops)
    committed: list[int] = []
    for block in _blocks(ids, seed):
        committed.extend(block)
        assert fast.update(committed, final=False) == slow.update(committed, final=False)
    assert fast.update(committed, final=True) == slow.update(committed, final=True)
    assert fast.emitted == slow.emitted == tokenizer.decode(ids, skip_special_tokens=True)
