"""In-flight batching through a REAL Triton server: concurrent gRPC streams with mixed
speculation (draft model, n-gram, Medusa, plain, auto; greedy and seeded sampling) share
batched target passes, and every answer is identical to the same request served alone
in-process; requests join a running batch and leave it; a full queue is refused at once;
one request through the scheduler equals ``SpeculativeDecoder.stream`` (output and stats)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import ServingSink
from triton_fixtures import RunningTriton, one_measurement, running_triton

from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig
from triton_backend.serving.service import parse_request

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = DeploymentConfig(draft_layers=tuple(range(0, 30, 3)),
                              medusa=str(REPO_ROOT / "artifacts" / "smollm2-135m-medusa" / "heads.safetensors"))
SERVING = ServingConfig(max_batch_size=8, max_queue_size=16, default_max_tokens=16)
PROMPTS = [
    "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta.",
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "List three benefits of regular exercise.",
    "Translate to French: 'Good morning, how are you today?'",
]
# (speculation, temperature, seed, max_tokens): >= 8 concurrent, every method, two seeded samplers
MIX = [("draft", 0.0, None, 14), ("ngram", 0.0, None, 20), ("medusa", 0.0, None, 12), ("off", 0.0, None, 10),
       ("auto", 0.0, None, 16), ("ngram", 0.8, 7, 12), ("draft", 0.7, 11, 10), ("medusa", 0.0, None, 18),
       ("off", 0.9, 5, 8), ("ngram", 0.0, None, 6)]


def _requests() -> list[GenerateRequest]:
    return [GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=n, temperature=t or None, seed=seed,
                            top_k=20 if t else None, speculation=mode, chat=True, stream=True)
            for i, (mode, t, seed, n) in enumerate(MIX)]


@pytest.fixture(scope="module")
def decoder():
    from triton_backend.deployment.torch_deployment import build_decoder

    with one_measurement():  # the server's pass-cost table, so the two draft alike
        return build_decoder(DEPLOYMENT)


@pytest.fixture(scope="module")
def batched_triton(tmp_path_factory: pytest.TempPathFactory):
    with running_triton(tmp_path_factory.mktemp("batched"), DEPLOYMENT, SERVING) as running:
        yield running


def _alone(decoder, request: GenerateRequest):
    parsed = parse_request(request.arrays(), DEPLOYMENT.speculation, SERVING.default_max_tokens)
    prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": parsed.prompt}],
                                                   add_generation_prompt=True, tokenize=False)
    return decoder.generate(prompt, parsed.sampling, parsed.speculation)


def _concurrently(t: RunningTriton, requests: list[GenerateRequest], wave_after: int | None = None) -> list:
    """Each request on its own gRPC stream; with ``wave_after``, the rest start once the first
    of the first ``wave_after`` requests has finished (they join a running batch)."""
    config = ClientConfig(t.endpoints.grpc_url, ClientProtocol.GRPC)
    results: list = [None] * len(requests)
    first_done = threading.Event()

    def one(i: int) -> None:
        if wave_after is not None and i >= wave_after:
            first_done.wait(300)
        try:
            results[i] = generate(config, requests[i])
        except Exception as exc:  # reported by the assertion below
            results[i] = exc
        if wave_after is None or i < wave_after:
            first_done.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return results


def test_concurrent_mixed_requests_equal_each_request_alone(batched_triton, decoder) -> None:
    requests = _requests()
    expected = [_alone(decoder, r) for r in requests]
    before = batched_triton.metrics()
    results = _concurrently(batched_triton, requests, wave_after=6)
    for request, result, alone in zip(requests, results, expected):
        assert not isinstance(result, Exception), f"{request.speculation}: {result}"
        assert result.text == alone.text, f"{request.speculation} t={request.temperature}"
        assert result.stats["num_output_tokens"] == alone.stats.generated_tokens
        assert result.stats["finish_reason"] == alone.finish_reason.value
    after = batched_triton.metrics()

    def delta(name: str) -> float:
        key = next(k for k in after if k.startswith(name + "{"))
        return after[key] - before.get(key, 0.0)

    rounds, rows = delta("specdec_batch_rounds_total"), delta("specdec_batch_rows_total")
    assert rows / rounds > 1.5, f"requests did not share passes: {rows} rows in {rounds} rounds"
    assert delta("specdec_batch_draft_tokens_total") > 0


def test_full_queue_is_refused_at_once_and_one_request_equals_stream(decoder) -> None:
    from triton_backend.serving.service import SpecdecService

    service = SpecdecService(decoder, ServingConfig(max_batch_size=1, max_queue_size=1), DEPLOYMENT.speculation)
    request = GenerateRequest(prompt=PROMPTS[0], max_tokens=12, chat=True, speculation="ngram")
    sinks = [ServingSink(), ServingSink(), ServingSink()]
    try:
        service.submit(request.arrays(), sinks[0])
        deadline = time.monotonic() + 60
        while service.scheduler.load() != (1, 0) and time.monotonic() < deadline:
            time.sleep(0.001)
        service.submit(request.arrays(), sinks[1])
        started = time.perf_counter()
        service.submit(request.arrays(), sinks[2])
        assert time.perf_counter() - started < 1.0 and sinks[2].done.is_set()
        assert sinks[2].errors and "overloaded" in sinks[2].errors[0] and not sinks[2].sent
    finally:
        service.shutdown()
    alone = _alone(decoder, request)
    for sink in sinks[:2]:
        assert sink.done.is_set() and not sink.errors
        final = sink.sent[-1]
        assert final["text_output"].reshape(-1)[0].decode() == alone.text
        # served alone in the batch: the controller's own decisions, so the stats match too
        assert int(final["total_draft_tokens"].reshape(-1)[0]) == alone.stats.drafted_tokens
        assert int(final["target_passes"].reshape(-1)[0]) == alone.stats.target_passes
