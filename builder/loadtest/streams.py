"""Sustained concurrent load against a running Triton server, checked token for token.

``run_load(endpoints, server_pid, decoder, config)`` runs ``config.streams`` client threads
for ``config.duration_s``; each sends one request at a time over its own gRPC stream to the
decoupled model, drawn from a fixed mix of templates (prompts x greedy / seeded sampling x
streamed or not x speculation method and draft length x max_tokens, plus a few invalid
requests). Every answer is compared with the same request generated in-process beforehand
(greedy and seeded sampling are deterministic): the text must be identical, which rules
out lost or duplicated tokens, and so must the token and target-pass counts. Meanwhile the
resident memory of the server's processes (tritonserver and its Python-backend stubs) is
sampled from /proc; at the end the Prometheus counters' deltas are compared with the sums
over what the clients received.
"""

from __future__ import annotations

import logging
import queue
import random
import re
import statistics
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from builder.ops.triton_client import GenerateRequest
from triton_backend.serving.launch.triton_server import Endpoints
from triton_backend.serving.interface import INPUTS, ServingConfig
from triton_backend.serving.service import parse_request

logger = logging.getLogger(__name__)

PROMPTS = (
    "What is the capital of France?",
    "Rewrite this sentence in the past tense: 'The cat sits on the mat and looks at the birds.'",
    "List three benefits of regular exercise.",
    "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta.",
    "Explain what a hash table is in two sentences.",
    "Translate to French: 'Good morning, how are you today?'",
    "def fibonacci(n):\n",
    "Write a haiku about the ocean.",
)
_WIRE = {spec.name: spec.dtype.wire for spec in INPUTS}


@dataclass(frozen=True)
class LoadConfig:
    streams: int = 32
    duration_s: float = 120.0
    warmup_s: float = 20.0  # memory is judged after this
    templates: int = 24
    min_tokens: int = 8
    max_tokens: int = 32
    invalid_every: int = 20  # one template in this many is an invalid request
    sample_every_s: float = 2.0
    memory_growth_limit_mib: float = 64.0
    seed: int = 0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if (self.streams < 1 or self.duration_s <= 0 or self.templates < 1
                or not 1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"bad load configuration: {self}")


@dataclass(frozen=True)
class Template:
    request: GenerateRequest
    expected_text: str | None  # None: an invalid request
    expected_tokens: int = 0
    expected_error: str = ""


def make_templates(decoder: Any, config: LoadConfig, serving: ServingConfig) -> list[Template]:
    """The request mix and, generated in-process, what each must answer."""
    rng = random.Random(config.seed)
    out = []
    for i in range(config.templates):
        prompt = PROMPTS[i % len(PROMPTS)]
        if config.invalid_every and i % config.invalid_every == config.invalid_every - 1:
            request = GenerateRequest(prompt=prompt, max_tokens=4, top_p=rng.choice([2.0, -0.5]), stream=True)
            out.append(Template(request, None, expected_error="top_p must be in (0, 1]"))
            continue
        sampled = rng.random() < 0.4
        request = GenerateRequest(
            prompt=prompt, max_tokens=rng.randint(config.min_tokens, config.max_tokens), chat=i % 5 != 4,
            stream=rng.random() < 0.7, speculation=rng.choice(["auto", "ngram", "off"]),
            num_draft_tokens=rng.randint(1, 8), temperature=0.8 if sampled else None,
            top_k=40 if sampled else None, top_p=0.9 if sampled else None,
            seed=rng.randrange(2**32) if sampled else None)
        out.append(expected_template(decoder, request, serving))
    return out


def expected_template(decoder: Any, request: GenerateRequest, serving: ServingConfig) -> Template:
    parsed = parse_request(request.arrays(), decoder.speculation, serving.default_max_tokens)
    prompt = parsed.prompt
    if parsed.chat:
        prompt = decoder.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=False)
    result = decoder.generate(prompt, parsed.sampling, parsed.speculation)
    return Template(request, result.text, result.stats.generated_tokens)


# -- one request over one gRPC stream ------------------------------------------------------------
@dataclass
class Answer:
    text: str = ""
    chunks: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    latency_s: float = 0.0


def send(url: str, model: str, request: GenerateRequest, timeout_s: float) -> Answer:
    import tritonclient.grpc as grpcclient

    answer, replies, done = Answer(), queue.Queue(), False  # type: ignore[var-annotated]
    started = time.perf_counter()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            inputs = []
            for name, array in request.arrays().items():
                tensor = grpcclient.InferInput(name, list(array.shape), _WIRE[name])
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
            done = _read(answer, replies, timeout_s)
        finally:
            # cancel only what is unfinished: Triton 2.51 can lose track of a stream cancelled just
            # after its final response, and then never unloads the model (SIGTERM waits its whole
            # exit timeout, then exits 1)
            client.stop_stream(cancel_requests=not done)
    answer.latency_s = time.perf_counter() - started
    return answer


def _read(answer: Answer, replies: "queue.Queue[tuple[Any, Any]]", timeout_s: float) -> bool:
    """Fills ``answer``; True once the request is over (its final response or its error came)."""
    deadline = time.monotonic() + timeout_s
    pieces = []
    while True:
        result, error = replies.get(timeout=max(0.1, deadline - time.monotonic()))
        if error is not None:
            answer.error = error.message()
            return True
        text = result.as_numpy("text_output")
        if text is not None:
            piece = "".join(v.decode("utf-8") for v in np.asarray(text).reshape(-1))
            if piece:
                pieces.append(piece)
                answer.chunks += 1
        for name in ("num_output_tokens", "target_passes", "total_draft_tokens", "total_accepted_draft_tokens",
                     "speculation_method", "finish_reason"):
            value = result.as_numpy(name)
            if value is not None:
                item = np.asarray(value).reshape(-1)[0]
                answer.stats[name] = item.decode("utf-8") if isinstance(item, bytes) else item.item()
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            answer.text = "".join(pieces)
            return True


# -- memory and metrics --------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (tritonserver and its backend stubs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    config: dict[str, Any]
    duration_s: float = 0.0
    requests: int = 0
    succeeded: int = 0
    refused_as_expected: int = 0
    streamed_chunks: int = 0
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    unexpected_errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    rss_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    metric_checks: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (server delta, clients)
    in_flight_after: float = 0.0

    def latency(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    def memory(self) -> dict[str, Any]:
        """Total RSS of the server's processes after the warm-up: first third vs last third."""
        after = [(t, sum(v.values())) for t, v in self.rss_samples if t >= self.config["warmup_s"]]
        if len(after) < 3:
            return {"samples_after_warmup": len(after), "growth_mib": 0.0, "flat": False}
        third = max(1, len(after) // 3)
        first = statistics.mean(v for _, v in after[:third])
        last = statistics.mean(v for _, v in after[-third:])
        return {"samples_after_warmup": len(after), "first_third_mib": round(first, 1),
                "last_third_mib": round(last, 1), "max_mib": round(max(v for _, v in after), 1),
                "growth_mib": round(last - first, 1),
                "flat": last - first <= self.config["memory_growth_limit_mib"]}

    @property
    def passed(self) -> bool:
        return (not self.mismatches and not self.unexpected_errors and self.in_flight_after == 0
                and all(a == b for a, b in self.metric_checks.values()) and bool(self.memory()["flat"])
                and self.succeeded > 0)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("latencies_s", "rss_samples")}
        out.update(passed=self.passed, memory=self.memory(), tokens_per_s=round(self.tokens / self.duration_s, 1),
                   requests_per_s=round(self.requests / self.duration_s, 2),
                   latency_p50_s=round(self.latency(0.5), 3), latency_p95_s=round(self.latency(0.95), 3),
                   latency_max_s=round(self.latency(1.0), 3))
        out["rss_timeline_mib"] = [(round(t, 1), round(sum(v.values()), 1)) for t, v in self.rss_samples]
        return out


class _Run:
    def __init__(self, endpoints: Endpoints, server_pid: int, templates: list[Template], config: LoadConfig,
                 model: str) -> None:
        self.endpoints, self.pid, self.templates = endpoints, server_pid, templates
        self.config, self.model = config, model
        self.report = LoadReport(config=asdict(config))
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.by_method: Counter[str] = Counter()
        self.accepted_by_method: Counter[str] = Counter()
        self.passes = 0

    def worker(self, index: int, deadline: float) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        first = True
        while time.monotonic() < deadline:
            # the first requests cover the templates in order (so a short run sees each kind), then at random
            template = self.templates[index % len(self.templates)] if first else rng.choice(self.templates)
            first = False
            try:
                answer = send(self.endpoints.grpc_url, self.model, template.request, self.config.request_timeout_s)
            except Exception as exc:  # recorded: the run fails on any of these
                with self.lock:
                    self.report.requests += 1
                    self.report.unexpected_errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            self.record(template, answer)

    def record(self, template: Template, answer: Answer) -> None:
        with self.lock:
            r = self.report
            r.requests += 1
            if template.expected_text is None:
                if answer.error is not None and template.expected_error in answer.error:
                    r.refused_as_expected += 1
                else:
                    r.unexpected_errors.append(f"expected a refusal, got {answer.error or answer.text!r}"[:300])
                return
            if answer.error is not None:
                r.unexpected_errors.append(answer.error[:300])
                return
            r.succeeded += 1
            r.latencies_s.append(answer.latency_s)
            r.streamed_chunks += answer.chunks
            tokens = int(answer.stats.get("num_output_tokens", -1))
            r.tokens += tokens
            self.passes += int(answer.stats.get("target_passes", 0))
            method = str(answer.stats.get("speculation_method", ""))
            self.by_method[method] += int(answer.stats.get("total_draft_tokens", 0))
            self.accepted_by_method[method] += int(answer.stats.get("total_accepted_draft_tokens", 0))
            # text and length must be exact; the passes may not: under in-flight batching the
            # load-aware plan sets draft lengths from the batch (the metric totals still must agree)
            got = (answer.text, tokens)
            want = (template.expected_text, template.expected_tokens)
            if got != want:
                r.mismatches.append(f"{template.request.prompt[:40]!r}: got {got!r}, expected {want!r}"[:400])

    def sampler(self, started: float) -> None:
        while not self.stop.is_set():
            sample = {str(p): rss_mib(p) for p in process_tree(self.pid)}
            self.report.rss_samples.append((time.monotonic() - started, sample))
            self.stop.wait(self.config.sample_every_s)

    def check_metrics(self, before: dict[str, float], after: dict[str, float]) -> None:
        m = f'model="{self.model}"'
        r = self.report
        expected = {
            f'specdec_requests_total{{{m},outcome="success"}}': r.succeeded,
            f'specdec_requests_total{{{m},outcome="invalid_request"}}': r.refused_as_expected,
            f"specdec_generated_tokens_total{{{m}}}": r.tokens,
            f"specdec_target_passes_total{{{m}}}": self.passes,
            f"specdec_request_latency_seconds_count{{{m}}}": r.succeeded,
        }
        for method, drafted in self.by_method.items():
            if drafted:
                expected[f'specdec_draft_tokens_total{{method="{method}",{m}}}'] = drafted
                expected[f'specdec_accepted_draft_tokens_total{{method="{method}",{m}}}'] = (
                    self.accepted_by_method[method])
        for name, clients in expected.items():
            r.metric_checks[name] = (after.get(name, 0.0) - before.get(name, 0.0), float(clients))
        r.in_flight_after = after.get(f"specdec_requests_in_flight{{{m}}}", -1.0)


def run_load(endpoints: Endpoints, server_pid: int, templates: list[Template], config: LoadConfig,
             model: str = "specdec") -> LoadReport:
    """Run the load; the server must be otherwise idle (the metric deltas are compared)."""
    run = _Run(endpoints, server_pid, templates, config, model)
    before = metrics(endpoints.metrics_url)
    started = time.monotonic()
    sampler = threading.Thread(target=run.sampler, args=(started,), daemon=True)
    sampler.start()
    deadline = started + config.duration_s
    workers = [threading.Thread(target=run.worker, args=(i, deadline), name=f"load-{i}") for i in range(config.streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    run.report.duration_s = time.monotonic() - started
    run.stop.set()
    sampler.join()
    after = _settled_metrics(endpoints, model)
    run.check_metrics(before, after)
    logger.info("load: %d requests, %d ok, %d mismatches, %d unexpected errors", run.report.requests,
                run.report.succeeded, len(run.report.mismatches), len(run.report.unexpected_errors))
    return run.report


def _settled_metrics(endpoints: Endpoints, model: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once nothing is in flight (Triton counts a request as its last response leaves)."""
    gauge = f'specdec_requests_in_flight{{model="{model}"}}'
    deadline = time.monotonic() + timeout_s
    current = metrics(endpoints.metrics_url)
    while current.get(gauge, 0.0) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        current = metrics(endpoints.metrics_url)
    return current


__all__ = ["Answer", "LoadConfig", "LoadReport", "Template", "expected_template", "make_templates", "metrics",
           "process_tree", "rss_mib", "run_load", "send"]
