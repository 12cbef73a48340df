"""Documented request maxima (triton_backend/serving/limits.py, docs/security.md), the stop
matcher whose per-token cost does not grow with the number of stop strings, and the HTTP
guard's check for integers Triton's JSON conversion would wrap. No server: fast."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from triton_backend.serving.front.http_guard import integer_problem
from triton_backend.core.config import SpeculationConfig
from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.text import StopMatcher
from triton_backend.serving.limits import LIMITS, check_max_tokens
from triton_backend.serving.service import parse_request


def arrays(**values: object) -> dict[str, np.ndarray]:
    out = {"text_input": np.array([[b"Hello"]], dtype=object)}
    for name, value in values.items():
        if isinstance(value, list):
            out[name] = np.array([[v.encode() for v in value]], dtype=object)
        elif isinstance(value, str):
            out[name] = np.array([[value.encode()]], dtype=object)
        else:
            out[name] = np.array([[value]], dtype=np.int32)
    return out


def test_stop_matcher_agrees_with_substring_search() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("ab cd") for _ in range(rng.randint(0, 20)))
        assert StopMatcher(stops).found_in(text) == any(s in text for s in stops), (stops, text)


def test_stop_matcher_cost_does_not_grow_with_the_number_of_stop_strings() -> None:
    """10,000 stop strings cost about what one does (a search per string would cost ~10,000x;
    the bound is loose for a shared machine)."""
    text = "the quick brown fox jumps over the lazy dog " * 200
    one, many = StopMatcher(["zebra"]), StopMatcher([f"zebra{i}" for i in range(10_000)])

    def cost(matcher: StopMatcher) -> float:
        began = time.perf_counter()
        for _ in range(5):
            assert not matcher.found_in(text)
        return time.perf_counter() - began

    cost(many)  # warm up
    assert cost(many) < 5 * cost(one) + 0.01


@pytest.mark.parametrize("values, message", [
    ({"stop_words": [f"s{i}" for i in range(100_000)]}, "100000 stop words, over the limit of 32"),
    ({"stop_words": ["x" * 300]}, "a stop word of 300 characters, over the limit of 256"),
    ({"bad_words": [f"b{i}" for i in range(65)]}, "65 bad words, over the limit of 64"),
    ({"text_input": "x" * (LIMITS.max_prompt_chars + 1)}, f"over the limit of {LIMITS.max_prompt_chars}"),
])
def test_maxima_are_refused_with_a_typed_error(values: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_request(arrays(**values), SpeculationConfig())


def test_max_tokens_over_the_context_is_refused_not_cut() -> None:
    check_max_tokens(2048, 2048)
    with pytest.raises(InvalidRequestError, match="max_tokens = 1000000000 is over the maximum of 2048"):
        check_max_tokens(10**9, 2048)


@pytest.mark.parametrize("body, problem", [
    ({"text_input": "hi", "max_tokens": 2**32 + 5}, "max_tokens: a value does not fit its type INT32"),
    ({"text_input": "hi", "max_tokens": 2**40}, "max_tokens"),
    ({"text_input": "hi", "top_k": -(2**31) - 1}, "top_k"),
    ({"text_input": "hi", "seed": 2**64}, "seed: a value does not fit its type UINT64"),
    ({"text_input": "hi", "seed": 2**64 - 1, "max_tokens": 2**31 - 1}, None),
    ({"text_input": "hi", "stop_words": ["a"], "temperature": 1e300}, None),
])
def test_integers_triton_would_wrap_are_found(body: dict, problem: str | None) -> None:
    found = integer_problem("/v2/models/ensemble/generate", json.dumps(body).encode())
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_integers_in_infer_bodies_are_checked_by_their_datatype() -> None:
    body = {"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [[2**32 + 5]]},
                       {"name": "random_seed", "datatype": "UINT64", "shape": [1, 1], "data": [2**63]}]}
    assert "max_tokens" in integer_problem("/v2/models/specdec_unary/infer", json.dumps(body).encode())
    body["inputs"][0]["data"] = [[5]]
    assert integer_problem("/v2/models/specdec_unary/infer", json.dumps(body).encode()) is None
    assert integer_problem("/v2/models/x/infer", b"not json") is None


def test_deploy_settings_bring_the_guard_and_close_the_admin_apis() -> None:
    import argparse

    from builder.cli.deploy import add_deploy_arguments, config_from_settings, resolve_settings
    from triton_backend.serving.front.http_guard import DEFAULT_MAX_BODY_BYTES

    parser = argparse.ArgumentParser()
    add_deploy_arguments(parser)
    config = config_from_settings(resolve_settings(parser.parse_args([]), {}))
    assert config.max_body_bytes == DEFAULT_MAX_BODY_BYTES and config.server.restricted is not None
    assert "model-repository" in config.server.restricted.apis and len(config.server.restricted.key) >= 32
    keyed = config_from_settings(resolve_settings(parser.parse_args([]), {"SPECBUILD_ADMIN_KEY": "a" * 20,
                                                                          "SPECBUILD_MAX_BODY_BYTES": "0"}))
    assert keyed.server.restricted.key == "a" * 20 and keyed.max_body_bytes is None
    opened = config_from_settings(resolve_settings(parser.parse_args(["--open-admin-apis"]), {}))
    assert opened.server.restricted is None
    flags = keyed.server.restricted.flags()
    assert flags[0].startswith("--http-restricted-api=model-repository,") and flags[0].endswith(":specbuild-admin-key=" + "a" * 20)
