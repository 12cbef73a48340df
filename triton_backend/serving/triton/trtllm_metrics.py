"""TensorRT-LLM's metric names (tensorrtllm_backend's custom metrics reporter), with the values
specbuild has, beside the ``specdec_*`` series: dashboards built for TensorRT-LLM read them
unchanged. Labels: ``model`` (the token-level model's name, ``tensorrt_llm``, where TensorRT-LLM
publishes them: ServingConfig.trtllm_metrics_model) and ``version`` as there, plus the family's
own label.

- ``nv_trt_llm_request_metrics{request_type}``: ``active`` (requests being generated),
  ``max`` (the batch's slots), ``scheduled`` (rows in the latest batched pass), ``waiting``
  (requests queued for a slot).
- ``nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric}``:
  ``generation_requests`` (rows in the latest batched pass).
- ``nv_trt_llm_general_metrics{general_type}``: ``iteration_counter`` (batched passes),
  ``timestamp`` (microseconds since the epoch at the latest pass).
- ``nv_llm_input_token_len`` / ``nv_llm_output_token_len`` histograms
  (``response_metric_type`` ``total_input_tokens`` / ``total_output_tokens``) per request.

Families that describe what specbuild has not (paged KV-cache blocks, GPU memory,
disaggregated serving) are not published rather than published as zeros.
Only usable inside Triton's Python backend stub.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from triton_backend.core.stats import GenerationStats
from triton_backend.batching.round_stats import PrefixCacheObserver

TOKEN_BUCKETS = (10, 50, 100, 500, 1000, 2000, 4000, 8000)  # tensorrtllm_backend's token-length buckets


class TrtllmMetrics:
    """Implements :class:`triton_backend.serving.service.RequestObserver` and the scheduler's ``RoundObserver``."""

    def __init__(self, pb_utils: Any, model_name: str, max_batch_size: int, version: str = "1") -> None:
        family = pb_utils.MetricFamily
        labels = {"model": model_name, "version": version}
        self._lock = threading.Lock()
        self._families = [
            family("nv_trt_llm_request_metrics", "TRT LLM request metrics", family.GAUGE),
            family("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics", family.GAUGE),
            family("nv_trt_llm_general_metrics", "General TRT LLM metrics", family.GAUGE),
            family("nv_llm_input_token_len", "TRT LLM response metrics", family.HISTOGRAM),
            family("nv_llm_output_token_len", "TRT LLM response metrics", family.HISTOGRAM),
        ]
        requests, batcher, general, tokens_in, tokens_out = self._families
        self._m = {
            **{name: requests.Metric(labels={**labels, "request_type": name})
               for name in ("active", "max", "scheduled", "waiting")},
            "generation_requests": batcher.Metric(labels={**labels, "inflight_batcher_specific_metric": "generation_requests"}),
            **{name: general.Metric(labels={**labels, "general_type": name}) for name in ("iteration_counter", "timestamp")},
            "input": tokens_in.Metric(labels={**labels, "response_metric_type": "total_input_tokens"},
                                      buckets=list(TOKEN_BUCKETS)),
            "output": tokens_out.Metric(labels={**labels, "response_metric_type": "total_output_tokens"},
                                        buckets=list(TOKEN_BUCKETS)),
        }
        self._m["max"].set(max_batch_size)
        self._active = self._rounds = 0
        self._latest: tuple[int, int, int] | None = None  # the latest round not published yet

    def started(self) -> None:
        with self._lock:
            self._active += 1
            self._m["active"].set(self._active)

    def succeeded(self, stats: GenerationStats, latency_s: float) -> None:
        with self._lock:
            self._done()
            self._m["input"].observe(stats.prompt_tokens)
            self._m["output"].observe(stats.generated_tokens)

    def failed(self, outcome: str) -> None:
        with self._lock:
            self._done()

    def _done(self) -> None:
        self._active = max(0, self._active - 1)
        self._m["active"].set(self._active)

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None:
        """Counted here, published by :meth:`flush` (metric updates block on the server process)."""
        with self._lock:
            self._rounds += 1
            self._latest = (batch_size, queued, time.time_ns() // 1000)

    def flush(self) -> None:
        with self._lock:
            if self._latest is None or not self._m:
                return
            (batch_size, queued, stamp), self._latest = self._latest, None
            self._m["scheduled"].set(batch_size)
            self._m["generation_requests"].set(batch_size)
            self._m["waiting"].set(queued)
            self._m["iteration_counter"].set(self._rounds)
            self._m["timestamp"].set(stamp)

    def close(self) -> None:
        """Drop metrics before their families (Triton requires that order)."""
        with self._lock:
            self._m.clear()
            self._families.clear()


class Observers:
    """Several request (and round) observers as one: the service takes one."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def started(self) -> None:
        for o in self.observers:
            o.started()

    def succeeded(self, stats: GenerationStats, latency_s: float) -> None:
        for o in self.observers:
            o.succeeded(stats, latency_s)

    def failed(self, outcome: str) -> None:
        for o in self.observers:
            o.failed(outcome)

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None:
        for o in self.observers:
            o.round_done(batch_size, speculating_rows, draft_tokens, queued)

    def flush(self) -> None:
        for o in self.observers:
            o.flush()

    def prefix_lookup(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        for o in self.observers:
            if isinstance(o, PrefixCacheObserver):
                o.prefix_lookup(prompt_tokens, reused_tokens, evictions)

    def close(self) -> None:
        for o in self.observers:
            o.close()


__all__ = ["Observers", "TrtllmMetrics"]
