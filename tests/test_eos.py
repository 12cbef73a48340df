"""End-of-sequence ids: read in one place from configs (objects or JSON dicts) and tokenizers."""

from __future__ import annotations

from types import SimpleNamespace

from triton_backend.core.config import SamplingParams
from triton_backend.engines.trtllm.requests import NO_END_ID, end_ids
from triton_backend.core.eos import eos_token_ids, min_tokens_end_ids, stopping_eos


def test_ids_from_configs_objects_and_dicts_else_the_tokenizer():
    tokenizer = SimpleNamespace(eos_token_id=9)
    assert eos_token_ids(SimpleNamespace(eos_token_id=2), {"eos_token_id": [3, 4]}, None, tokenizer=tokenizer) == {2, 3, 4}
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), {}, tokenizer=tokenizer) == {9}
    assert eos_token_ids(SimpleNamespace(), tokenizer=None) == frozenset()


def test_a_request_applies_its_settings_to_them():
    eos = frozenset({7, 3})
    assert stopping_eos(SamplingParams(), eos) == {3, 7}
    assert stopping_eos(SamplingParams(ignore_eos=True), eos) == frozenset()
    assert min_tokens_end_ids(SamplingParams(stop_token_ids=((5,), (6, 8))), eos) == [3, 7, 5]
    assert min_tokens_end_ids(SamplingParams(ignore_eos=True, stop_token_ids=((5,),)), eos) == [5]
    assert end_ids(SamplingParams(), eos).end_id == 3 and end_ids(SamplingParams(ignore_eos=True), eos).end_id == NO_END_ID
