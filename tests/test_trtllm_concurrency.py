"""The TensorRT-LLM runtime under concurrent requests (contract level: TensorRT-LLM cannot run
here). Serving hands each request to the engine from its own thread, with nothing that
serialises requests, so the Executor's in-flight batcher sees them together; each output
stays plain decoding. The engine is the request-contract stand-in of ``trtllm_fixtures``,
made to hold each request open a moment so overlaps are visible."""

from __future__ import annotations

import threading
import time

from conftest import tiny_engine
from trtllm_fixtures import TorchRequestEngine
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.serving.interface import ServingConfig
from triton_backend.serving.service import SpecdecService
from triton_backend.speculation.trtllm_loop import EngineDrafter, TargetInfo, TrtllmSpeculativeDecoder


class OverlapEngine(TorchRequestEngine):
    """Counts the requests inside the engine at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0

    def _enter(self) -> None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)

    def _leave(self) -> None:
        with self._lock:
            self.inside -= 1

    def generate(self, spec):
        self._enter()
        try:
            time.sleep(0.02)
            return super().generate(spec)
        finally:
            self._leave()

    def stream(self, spec):
        self._enter()
        try:
            time.sleep(0.02)
            yield from super().stream(spec)
        finally:
            self._leave()


def test_concurrent_requests_reach_the_engine_together_and_stay_exact() -> None:
    target, draft = tiny_engine(0), tiny_engine(1)
    engine = OverlapEngine(target, "target")
    info = TargetInfo("tiny0", target.vocab_size, target.max_context, 128, frozenset())
    decoder = TrtllmSpeculativeDecoder(engine, info, None, draft=EngineDrafter(TorchRequestEngine(draft, "draft"), 0.1),
                                       ngram=NgramDrafter(1, 3))
    # serving keeps its own threads for a runtime that batches in flight itself (no batch scheduler)
    service = SpecdecService(decoder, ServingConfig(max_concurrency=4), SpeculationConfig())
    assert service.scheduler is None
    service.shutdown()

    prompts = [[3, 17, 5, 9, 3, 17, 5], [1, 2, 3, 1, 2], [7, 7, 8], [4, 9, 4, 9, 4]]
    modes = ["draft", "ngram", "off", "draft"]
    params = SamplingParams(max_tokens=12)
    plain = SpeculativeDecoder(target, None)
    expected = [plain.generate(p, params, SpeculationConfig(method="off")).token_ids for p in prompts]
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        start.wait()
        results[i] = decoder.generate(prompts[i], params, SpeculationConfig(method=modes[i],
                                                                            draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False))).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == expected
    assert engine.most_inside >= 2, "requests were serialised before the engine"
