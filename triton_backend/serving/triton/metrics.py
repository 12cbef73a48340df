"""Triton custom metrics (``pb_utils.MetricFamily``) for the speculative model.

They appear on Triton's Prometheus endpoint (``/metrics``) next to Triton's own
``nv_inference_*`` series. Acceptance per draft position is two counters labelled by
``position`` (1 = the first drafted token); their ratio is the position's acceptance rate.
Only usable inside Triton's Python backend stub.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from triton_backend.core.stats import GenerationStats

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The per-replica load gauges an autoscaler reads (builder/ops/k8s: the HPA's Pods metric).
# IN_FLIGHT: requests from arrival to their last response, waiting ones included; QUEUED:
# requests waiting for a batch slot at the latest batched round.
IN_FLIGHT_GAUGE = "specdec_requests_in_flight"
QUEUED_GAUGE = "specdec_queued_requests"
PREFIX_FAMILIES = {"lookups": "prefix_lookups", "hits": "prefix_hits", "reused_tokens": "prefix_reused",
                   "prompt_tokens": "prefix_prompt", "evictions": "prefix_evictions"}  # PrefixTally field -> family
OUTCOMES = ("success", "invalid_request", "context_length", "vocab_mismatch", "model_load", "internal", "cancelled",
            "overloaded")


@dataclass
class RoundTally:
    """Batched rounds not published yet: counts summed, the latest batch size and queue."""

    rounds: int = 0
    rows: int = 0
    speculating_rows: int = 0
    draft_tokens: int = 0
    batch_size: int = 0
    queued: int = 0

    def add(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None:
        self.rounds += 1
        self.rows += batch_size
        self.speculating_rows += speculating_rows
        self.draft_tokens += draft_tokens
        self.batch_size, self.queued = batch_size, queued


@dataclass
class PrefixTally:
    """Prefix-cache lookups not published yet (one per request admitted to the batch)."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = 0

    def add(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        self.lookups += 1
        self.hits += int(reused_tokens > 0)
        self.reused_tokens += reused_tokens
        self.prompt_tokens += prompt_tokens
        self.evictions += evictions


class TritonMetrics:
    """Implements :class:`triton_backend.serving.service.RequestObserver` with Triton metrics."""

    def __init__(self, pb_utils: Any, model_name: str) -> None:
        self._pb = pb_utils
        self._labels = {"model": model_name}
        self._lock = threading.Lock()
        family = pb_utils.MetricFamily
        # the families must outlive their metrics: keep references to both
        self._families = {
            "requests": family("specdec_requests_total", "Requests by outcome", family.COUNTER),
            "in_flight": family(IN_FLIGHT_GAUGE, "Requests being generated now", family.GAUGE),
            "tokens": family("specdec_generated_tokens_total", "Generated tokens", family.COUNTER),
            "passes": family("specdec_target_passes_total", "Target forward passes", family.COUNTER),
            "drafted": family("specdec_draft_tokens_total", "Drafted tokens by method", family.COUNTER),
            "accepted": family("specdec_accepted_draft_tokens_total", "Accepted drafted tokens by method", family.COUNTER),
            "pos_drafted": family("specdec_position_draft_tokens_total", "Drafted tokens by draft position", family.COUNTER),
            "pos_accepted": family("specdec_position_accepted_tokens_total", "Accepted tokens by draft position",
                                   family.COUNTER),
            "fallbacks": family("specdec_fallbacks_total", "Requests that fell back to plain decoding", family.COUNTER),
            "latency": family("specdec_request_latency_seconds", "Request latency, first byte in to last out",
                              family.HISTOGRAM),
            "ttft": family("specdec_time_to_first_token_seconds", "Time to the first verified block",
                           family.HISTOGRAM),
            # the batch scheduler's rounds (one ragged target pass each)
            "batch_size": family("specdec_batch_size", "Rows in the latest batched target pass", family.GAUGE),
            "queued": family(QUEUED_GAUGE, "Requests waiting for a batch slot", family.GAUGE),
            "rounds": family("specdec_batch_rounds_total", "Batched target passes", family.COUNTER),
            "round_rows": family("specdec_batch_rows_total", "Rows over all batched passes", family.COUNTER),
            "round_speculating": family("specdec_batch_speculating_rows_total",
                                        "Rows that carried drafted tokens, over all batched passes", family.COUNTER),
            "round_drafted": family("specdec_batch_draft_tokens_total", "Drafted tokens verified in batched passes",
                                    family.COUNTER),
            # prefix caching (triton_backend/batching/prefix_cache.py): hit rate = hits / lookups
            "prefix_lookups": family("specdec_prefix_cache_lookups_total",
                                     "Requests admitted to the batch with the prefix cache on", family.COUNTER),
            "prefix_hits": family("specdec_prefix_cache_hits_total",
                                  "Requests that started from cached keys and values", family.COUNTER),
            "prefix_reused": family("specdec_prefix_cache_reused_tokens_total",
                                    "Prompt tokens taken from the prefix cache instead of prefilled", family.COUNTER),
            "prefix_prompt": family("specdec_prefix_cache_prompt_tokens_total",
                                    "Prompt tokens of the requests admitted with the prefix cache on", family.COUNTER),
            "prefix_evictions": family("specdec_prefix_cache_evictions_total",
                                       "Prefix-cache entries evicted for a new request's slot", family.COUNTER),
        }
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._rounds = RoundTally()
        self._prefix = PrefixTally()
        for outcome in OUTCOMES:
            self._metric("requests", outcome=outcome)
        for name in ("in_flight", "tokens", "passes", "fallbacks", "batch_size", "queued", "rounds", "round_rows",
                     "round_speculating", "round_drafted", *PREFIX_FAMILIES.values()):
            self._metric(name)

    def _metric(self, family: str, **labels: str) -> Any:
        key = (family, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            kwargs: dict[str, Any] = {"labels": {**self._labels, **labels}}
            if family in ("latency", "ttft"):
                kwargs["buckets"] = list(LATENCY_BUCKETS_S)
            metric = self._metrics[key] = self._families[family].Metric(**kwargs)
        return metric

    def started(self) -> None:
        with self._lock:
            self._metric("in_flight").increment(1)

    def succeeded(self, stats: GenerationStats, latency_s: float) -> None:
        with self._lock:
            self._metric("in_flight").increment(-1)
            self._metric("requests", outcome="success").increment(1)
            self._metric("tokens").increment(stats.generated_tokens)
            self._metric("passes").increment(stats.target_passes)
            if stats.drafted_tokens:
                self._metric("drafted", method=stats.method).increment(stats.drafted_tokens)
                self._metric("accepted", method=stats.method).increment(stats.accepted_tokens)
            for i, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
                self._metric("pos_drafted", position=str(i + 1)).increment(drafted)
                self._metric("pos_accepted", position=str(i + 1)).increment(accepted)
            if stats.fallback:
                self._metric("fallbacks").increment(1)
            self._metric("latency").observe(latency_s)
            self._metric("ttft").observe(stats.time_to_first_token_s)

    def round_done(self, batch_size: int, speculating_rows: int, draft_tokens: int, queued: int) -> None:
        """One batched round (:class:`triton_backend.batching.round_stats.RoundObserver`): counted here,
        published by :meth:`flush` (every metric update is a blocking round trip to the
        server process; the scheduler thread must not wait for them every round)."""
        with self._lock:
            self._rounds.add(batch_size, speculating_rows, draft_tokens, queued)

    def prefix_lookup(self, prompt_tokens: int, reused_tokens: int, evictions: int) -> None:
        """Where an admitted request's prompt came from
        (:class:`triton_backend.batching.round_stats.PrefixCacheObserver`): counted here, published by :meth:`flush`."""
        with self._lock:
            self._prefix.add(prompt_tokens, reused_tokens, evictions)

    def flush(self) -> None:
        """Publish the rounds and prefix-cache lookups counted since the last flush."""
        with self._lock:
            done, self._rounds = self._rounds, RoundTally()
            prefix, self._prefix = self._prefix, PrefixTally()
            if not self._families:
                return
            for field_name, family in PREFIX_FAMILIES.items():
                if getattr(prefix, field_name):
                    self._metric(family).increment(getattr(prefix, field_name))
            if not done.rounds:
                return
            self._metric("batch_size").set(done.batch_size)
            self._metric("queued").set(done.queued)
            self._metric("rounds").increment(done.rounds)
            self._metric("round_rows").increment(done.rows)
            self._metric("round_speculating").increment(done.speculating_rows)
            self._metric("round_drafted").increment(done.draft_tokens)

    def failed(self, outcome: str) -> None:
        with self._lock:
            self._metric("in_flight").increment(-1)
            self._metric("requests", outcome=outcome if outcome in OUTCOMES else "internal").increment(1)

    def close(self) -> None:
        """Drop metrics before their families (Triton requires that order)."""
        with self._lock:
            self._metrics.clear()
            self._families.clear()
