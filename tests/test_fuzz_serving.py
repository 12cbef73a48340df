"""Property-based fuzzing of every request tensor of the served model, against a REAL Triton
server: wrong types and shapes, unknown inputs, empty and huge values, invalid UTF-8,
negative / NaN / infinite sampling parameters, huge max_tokens, unknown speculation modes.

The oracle is the same request parsed and generated in-process: a request Triton itself
must refuse (wrong type, shape, unknown or missing input) gets an error that names the
input; a request the model refuses gets exactly the in-process error; a valid request gets
exactly the in-process answer (greedy or seeded sampling) or, unseeded, a well-formed one;
a valid request with a huge ``max_tokens`` is accepted and streams, and is then cancelled.
Every error is short and carries no traceback; the server stays up and ends idle.

CI runs ``SPECBUILD_FUZZ_EXAMPLES`` cases (default 150); the long run sets it to 1000+.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_fixtures import (  # noqa: F401 (fixtures)
    DEPLOYMENT, SERVING, StreamOutcome, assert_client_safe, delta, http_infer, infer_input, reliable_decoder,
    reliable_triton, stream_request, wait_idle,
)

from triton_backend.core.errors import SpecbuildError
from triton_backend.serving.interface import INPUTS
from triton_backend.serving.limits import check_max_tokens
from triton_backend.serving.service import parse_request
from triton_backend.serving.tensors import TensorSpec

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SPECBUILD_FUZZ_EXAMPLES", "150"))
HUGE_MAX_TOKENS = 16  # above this a valid request is streamed a little, then cancelled
HUGE_REFERENCE_TOKENS = 256  # a huge request that ends by itself must end before this in-process
INT32 = (-(2**31), 2**31 - 1)
WIRE_NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32,
              "INT64": np.int64, "FP64": np.float64, "INT8": np.int8, "FP16": np.float16}
TALLY: collections.Counter[str] = collections.Counter()


# -- strategies ------------------------------------------------------------------------------
def _mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Two thirds in range, one third anything of the declared type."""
    return st.one_of(good, good, bad)


def _floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-38,
                                      3.4e38]), st.floats(width=32))


def _ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, -1, 65, INT32[0], INT32[1]]), st.integers(*INT32))


PROMPTS = ["What is the capital of France?", "Repeat: alpha beta gamma alpha beta gamma", "Réponds en français 🙂",
           "def add(a, b):\n", "1, 2, 3, 4,"]
GOOD_TEXT = st.one_of(st.sampled_from(PROMPTS), st.text(min_size=1, max_size=80)).map(str.encode)
BAD_TEXT = st.one_of(st.sampled_from([b"", ("word " * 9000).encode(), b"\xff\xfe", "\x00".encode()]),
                     st.binary(max_size=48))
SHORT_TEXT = st.text(min_size=1, max_size=6).map(str.encode)
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "text_input": _mostly(GOOD_TEXT, BAD_TEXT),
    "max_tokens": _mostly(st.integers(1, 3), st.one_of(st.sampled_from([0, -1, INT32[0], INT32[1], 10**6]),
                                                       st.integers(*INT32))),
    "stream": st.booleans(), "apply_chat_template": st.booleans(), "ignore_eos": st.booleans(),
    "exclude_input_in_output": st.booleans(),
    "temperature": _mostly(st.sampled_from([0.0, 0.0, 0.7, 1.0]), _floats()),
    "top_k": _mostly(st.sampled_from([0, 1, 5, 40]), _ints()),
    "top_p": _mostly(st.sampled_from([1.0, 0.9, 0.5]), _floats()),
    "random_seed": st.integers(0, 2**64 - 1),
    "end_id": _mostly(st.integers(0, 49151), _ints()),
    "stop_words": st.lists(_mostly(SHORT_TEXT, st.one_of(st.just(b""), st.binary(max_size=4))), max_size=3),
    "bad_words": _mostly(st.sampled_from([[], [b""]]), st.lists(st.binary(max_size=4), max_size=2)),
    "num_draft_tokens": _mostly(st.integers(0, 8), _ints()),
    "speculation": _mostly(st.sampled_from([b"auto", b"ngram", b"off"]),
                           st.one_of(st.sampled_from([b"draft", b"medusa", b" OFF ", b"Ngram"]),
                                     st.text(max_size=12).map(str.encode), st.binary(max_size=8))),
    "guided_decoding_guide_type": _mostly(st.sampled_from([b"json", b"json_schema", b"regex", b"ebnf_grammar"]),
                                          st.one_of(st.sampled_from([b"", b"JSON", b"xml"]), st.binary(max_size=8))),
    "guided_decoding_guide": _mostly(st.sampled_from([b"", b'{"type": "object"}', b"[a-z]+", b'root ::= "yes" | "no"']),
                                     st.one_of(st.sampled_from([b"{", b"(", b"\xff"]), st.binary(max_size=24))),
    "prefix_cache_namespace": _mostly(st.sampled_from([b"", b"tenant-a", b"user:alice"]),
                                      st.one_of(st.just(b"n" * 257), st.just(b"\xff\xfe"), st.binary(max_size=8))),
}
assert set(VALUES) == {spec.name for spec in INPUTS}, "a new input needs a fuzzing strategy"


def _values(spec: TensorSpec) -> st.SearchStrategy[Any]:
    return VALUES[spec.name]


@dataclass(frozen=True)
class Tensor:
    name: str
    wire: str
    array: np.ndarray


def _array(values: list[Any], wire: str, shape: tuple[int, ...]) -> np.ndarray:
    dtype = WIRE_NUMPY[wire]
    if wire == "BYTES":
        values = [v if isinstance(v, bytes) else str(v).encode() for v in values]
    elif wire == "BOOL":
        values = [bool(v) if not isinstance(v, bytes) else bool(len(v)) for v in values]
    else:
        values = [(len(v) if isinstance(v, bytes) else v) for v in values]
        info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
        finite = [v if not (isinstance(v, float) and not np.isfinite(v)) else None for v in values]
        if np.issubdtype(dtype, np.integer):
            values = [0 if v is None else int(min(max(v, info.min), info.max)) for v in finite]
        else:
            values = [o if v is None else float(min(max(v, info.min), info.max)) for v, o in zip(finite, values)]
    size = int(np.prod(shape))
    if not values:
        values = [b""] if wire == "BYTES" else [0]
    values = (values * (size // len(values) + 1))[:size]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(values, dtype=dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn, spec: TensorSpec, corrupt: bool) -> Tensor | None:
    """One input: left out, well-formed, or (``corrupt``) of a wrong type or shape."""
    present = spec.name == "text_input" or draw(st.integers(0, 2)) == 0
    if not present and not corrupt:
        return None
    wire = spec.dtype.wire
    if spec.dims == (-1,):
        values = draw(_values(spec))
        shape = (1, len(values))
    else:
        values, shape = [draw(_values(spec))], (1, 1)
    if corrupt:
        kind = draw(st.sampled_from(["dtype", "shape", "absent"]))
        if kind == "absent":
            return None
        if kind == "dtype":
            wire = draw(st.sampled_from(sorted(set(WIRE_NUMPY) - {wire})))
        else:
            shape = draw(st.sampled_from([(2, 1), (1, 2), (1, 1, 1), (9, 1), (1,), (0, 1), (1, 0)]))
            values = values * 2 if values else values
    return Tensor(spec.name, wire, _array(values, wire, shape))


@st.composite
def requests(draw: st.DrawFn) -> list[Tensor]:
    """A request: all inputs well-formed, one input broken, or many broken; sometimes an
    unknown input too."""
    how = draw(st.sampled_from(["none", "none", "one", "many"]))
    broken = {draw(st.sampled_from([s.name for s in INPUTS]))} if how == "one" else set()
    out = []
    for spec in INPUTS:
        corrupt = spec.name in broken or (how == "many" and draw(st.integers(0, 5)) == 0)
        tensor = draw(tensors(spec, corrupt))
        if tensor is not None:
            out.append(tensor)
    if draw(st.integers(0, 15)) == 0:
        out.append(Tensor("no_such_input", "INT32", np.array([[1]], dtype=np.int32)))
    return out


# -- the oracle -------------------------------------------------------------------------------
SPECS = {spec.name: spec for spec in INPUTS}


def structural_problems(request: list[Tensor]) -> set[str]:
    """Inputs Triton must refuse before the model sees the request (``"batch"``: a batch size
    over the model's maximum or differing between inputs, which Triton names no input for)."""
    problems = set()
    if "text_input" not in {t.name for t in request}:
        problems.add("text_input")
    for t in request:
        spec = SPECS.get(t.name)
        if spec is None or t.wire != spec.dtype.wire:
            problems.add(t.name)
        elif t.array.ndim != 2 or (spec.dims == (1,) and t.array.shape[1:] != (1,)):
            problems.add(t.name)
        elif not 1 <= t.array.shape[0] <= SERVING.max_batch_size:
            problems.update({t.name, "batch"})
    if len({t.array.shape[0] for t in request if t.array.ndim}) > 1:
        problems.add("batch")
    return problems


@dataclass
class Expected:
    error: str | None = None  # the exact message the model must send
    structural: frozenset[str] = frozenset()  # inputs Triton must refuse
    result: Any = None  # GenerationResult of a deterministic valid request
    huge: bool = False  # valid, too long to wait for: streamed a little, then cancelled
    capped: Any = None  # a huge request's in-process result at HUGE_REFERENCE_TOKENS (if it ended by itself)
    deterministic: bool = True
    max_tokens: int = 0
    prefix: str = ""  # exclude_input_in_output = false: the prompt as sent starts the text


def expect(request: list[Tensor], decoder) -> Expected:
    structural = structural_problems(request)
    if structural:
        return Expected(structural=frozenset(structural))
    try:
        parsed = parse_request({t.name: t.array for t in request}, DEPLOYMENT.speculation, SERVING.default_max_tokens)
        check_max_tokens(parsed.sampling.max_tokens, decoder.target.max_context)  # as the service does
        prompt = parsed.prompt
        prefix = parsed.prompt if parsed.include_prompt else ""
        if parsed.chat:
            prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=False)
        deterministic = parsed.sampling.greedy or parsed.sampling.seed is not None
        if parsed.sampling.max_tokens > HUGE_MAX_TOKENS:
            decoder.encode(prompt)
            decoder.resolve(parsed.speculation.method)
            capped = replace(parsed.sampling, max_tokens=HUGE_REFERENCE_TOKENS)
            return Expected(huge=True, deterministic=deterministic, prefix=prefix,
                            capped=lambda: decoder.generate(prompt, capped, parsed.speculation))
        result = decoder.generate(prompt, parsed.sampling, parsed.speculation)
        return Expected(result=result, deterministic=deterministic, max_tokens=parsed.sampling.max_tokens,
                        prefix=prefix)
    except SpecbuildError as exc:
        return Expected(error=str(exc))


def check(outcome: StreamOutcome, expected: Expected) -> str:
    """Asserts the server's answer is the expected one; returns the case's category."""
    if outcome.error is not None:
        assert_client_safe(outcome.error)
    if expected.structural:
        assert outcome.error is not None, "Triton accepted a malformed request"
        assert "batch" in expected.structural or any(f"'{name}'" in outcome.error for name in expected.structural), (
            sorted(expected.structural), outcome.error)
        return "refused by Triton (type/shape/unknown/missing input)"
    if expected.error is not None:
        assert outcome.error == expected.error
        return "refused by the model (typed error)"
    assert outcome.error is None, outcome.error
    if expected.huge:
        if outcome.cancelled:
            return "huge max_tokens: streamed, then cancelled"
        # it ended by itself (EOS or stop) before the cancellation: it must be what the model says
        assert outcome.final and outcome.stat("finish_reason") in ("eos", "stop")
        if expected.deterministic:
            local = expected.capped()
            assert local.finish_reason.value != "length" and outcome.text == expected.prefix + local.text
        return "huge max_tokens: ended by itself (EOS/stop) before the cancellation"
    assert outcome.final
    local = expected.result
    tokens = outcome.stat("num_output_tokens")
    assert outcome.stat("finish_reason") in ("length", "eos", "stop")
    if expected.deterministic:
        assert outcome.text == expected.prefix + local.text
        assert tokens == local.stats.generated_tokens
        assert outcome.stat("target_passes") == local.stats.target_passes
        assert outcome.stat("finish_reason") == local.finish_reason.value
        return "valid: identical to in-process"
    assert 0 <= tokens <= expected.max_tokens
    return "valid: unseeded sampling, well-formed"


# -- the test -----------------------------------------------------------------------------------
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(request=requests(), over_http=st.integers(0, 4).map(lambda i: i == 0))
def test_every_fuzzed_request_gets_the_right_answer_or_a_short_typed_error(reliable_triton, reliable_decoder,
                                                                            request: list[Tensor],
                                                                            over_http: bool) -> None:
    """Most requests go over a gRPC stream to the decoupled model, some through HTTP ``infer``
    to the unary entry point (BLS); a huge valid request always streams."""
    expected = expect(request, reliable_decoder)
    if over_http and not expected.huge:
        outcome = http_infer(reliable_triton.endpoints.http_url, [(t.name, t.array, t.wire) for t in request])
        route = "HTTP unary"
    else:
        tensors_ = [infer_input(t.name, t.array, t.wire) for t in request]
        outcome = stream_request(reliable_triton.endpoints.grpc_url, tensors_, timeout_s=120,
                                 cancel_after_s=0.3 if expected.huge else None)
        route = "gRPC stream"
    TALLY[f"{route}: {check(outcome, expected)}"] += 1
    assert reliable_triton.server.running


def test_after_the_fuzz_the_server_is_idle_healthy_and_counted_every_request(reliable_triton) -> None:
    """Runs after the fuzz (file order): nothing left in flight, no internal errors, and a
    normal request still answers."""
    metrics = wait_idle(reliable_triton)
    model = f'model="{SERVING.model_name}"'
    assert metrics.get(f'specdec_requests_total{{{model},outcome="internal"}}', 0.0) == 0
    before = metrics
    outcome = stream_request(reliable_triton.endpoints.grpc_url,
                             [infer_input("text_input", np.array([[b"Hello"]], dtype=np.object_), "BYTES")])
    assert outcome.final and outcome.error is None and outcome.stat("num_output_tokens") >= 1
    after = wait_idle(reliable_triton)
    assert delta(after, before, f'specdec_requests_total{{{model},outcome="success"}}') == 1
    print("\nfuzzed request categories:", dict(TALLY), "total", sum(TALLY.values()))
