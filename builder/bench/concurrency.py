"""``specbuild bench concurrency 1,2,4,8,16``: serving throughput and latency under load.

A real Triton server (loopback, free ports) per serving mode, all up at once; at each
concurrency ``c``, ``c`` client threads send gRPC streaming requests (the bench prompts,
fixed length) back to back: with ``requests_per_level`` every level sends the same requests
round-robin over its streams (one stream sends all of them in turn), so each level does the
same work; else each stream sends ``requests_per_stream`` of its own. The modes run one after another at
each level, in an order that rotates, and the whole sweep is repeated ``repeats`` times, so
a busy machine's drift falls on every mode alike (the ratios are measured side by side). Per
mode and ``c`` over the repeats: aggregate output tokens/s (all tokens over all wall time),
per-request p50/p95 latency and time to first token. Modes:

- ``serial``: one request at a time (``max_batch_size`` 1, plain decoding): the old
  serialised behaviour, the baseline;
- ``off``: in-flight batching, plain decoding;
- ``always``: in-flight batching, every request speculates with ``k`` drafts (fallback off);
- ``load_aware``: in-flight batching, draft lengths per round from the pass-cost plan.

Greedy outputs of every mode are checked against ``off`` (identical text per prompt).
Headline: ``serving_throughput_8_over_1`` (``off`` at 8 streams over 1) and
``policy_worst_ratio_to_best`` (over every ``c``: ``load_aware`` / best of off, always).
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from builder.bench.config import DEFAULT_PROMPTS
from builder.bench.writer import ReportTarget
from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import DEFAULT_REFERENCE

logger = logging.getLogger(__name__)

MODES = ("serial", "off", "always", "load_aware")


@dataclass(frozen=True)
class ConcurrencyConfig:
    target: str = DEFAULT_REFERENCE
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    modes: tuple[str, ...] = MODES
    method: str = "ngram"  # the drafter of the speculating modes
    num_draft_tokens: int = 4
    draft: str | None = None
    medusa: str | None = None
    prompts_file: Path = DEFAULT_PROMPTS
    workloads: tuple[str, ...] = ("chat", "code", "copy")
    prompts_per_workload: int = 5
    max_tokens: int = 64
    requests_per_stream: int = 2
    requests_per_level: int | None = None  # set: every level sends these requests, round-robin over its streams
    repeats: int = 2  # interleaved sweeps over every level and mode
    num_threads: int = 1

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or not self.modes:
            raise ConfigError(f"unknown concurrency modes {unknown}; choose from {MODES}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency levels must be positive integers")
        if self.max_tokens < 1 or self.requests_per_stream < 1 or self.repeats < 1:
            raise ConfigError("max_tokens, requests_per_stream and repeats must be positive")
        if self.requests_per_level is not None and self.requests_per_level < max(self.concurrency):
            raise ConfigError(f"requests_per_level ({self.requests_per_level}) must be at least the largest "
                              f"concurrency ({max(self.concurrency)}): every stream sends one")

    def stream_requests(self, stream: int, concurrency: int) -> list[int]:
        """The request numbers stream ``stream`` of ``concurrency`` sends, in order (request
        ``i`` asks prompt ``i`` modulo the prompts). With ``requests_per_level`` every level
        sends the same requests, so its tokens/s compares the same work (the same prompts,
        hence the same prefill); else each stream sends ``requests_per_stream`` of its own."""
        if self.requests_per_level is not None:
            return list(range(stream, self.requests_per_level, concurrency))
        return [stream * self.requests_per_stream + r for r in range(self.requests_per_stream)]


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> text (greedy: the same every time)
    errors: list[str] = field(default_factory=list)
    repeat_rates: list[float] = field(default_factory=list)  # tokens/s of each repeat (merged levels)

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "concurrency": self.concurrency, "requests": self.requests, "tokens": self.tokens,
                "wall_s": self.wall_s, "tokens_per_s": self.tokens / self.wall_s if self.wall_s > 0 else 0.0,
                "latency_p50_s": _percentile(self.latencies_s, 50), "latency_p95_s": _percentile(self.latencies_s, 95),
                "ttft_p50_s": _percentile(self.ttft_s, 50), "ttft_p95_s": _percentile(self.ttft_s, 95),
                "errors": len(self.errors), "tokens_per_s_by_repeat": [round(r, 2) for r in self.repeat_rates]}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _serving(config: ConcurrencyConfig, mode: str) -> tuple[Any, Any, str]:
    """(deployment, serving config, request speculation mode) of one serving mode."""
    from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SpeculationConfig
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.serving.interface import ServingConfig

    def absolute(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path is not None and Path(path).exists() else path

    most = max(config.concurrency)
    spec = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=config.num_draft_tokens))
    if mode == "always":
        spec = replace(spec, fallback=FallbackConfig(enabled=False))
    deployment = DeploymentConfig(target=absolute(config.target) or config.target, draft=absolute(config.draft),
                                  medusa=absolute(config.medusa), runtime=RuntimeConfig(num_threads=config.num_threads,
                                                                                        max_batch_size=max(16, most)),
                                  speculation=spec)
    serving = ServingConfig(max_batch_size=1 if mode == "serial" else most, max_queue_size=max(64, 4 * most),
                            batch_policy="per_request" if mode == "always" else "load_aware",
                            default_max_tokens=config.max_tokens)
    return deployment, serving, "off" if mode in ("serial", "off") else config.method


def _prompts(config: ConcurrencyConfig) -> list[str]:
    data = json.loads(Path(config.prompts_file).read_text())["workloads"]
    return [p for w in config.workloads for p in list(data[w])[: config.prompts_per_workload]]


@dataclass
class Reply:
    """One request's answer as a load generator sees it."""
    text: str
    tokens: int
    latency_s: float
    ttft_s: float


def grpc_sender(url: str, config: ConcurrencyConfig, speculation: str,
                temperature: float | None = None) -> Callable[[str], Reply]:
    """One streamed chat request to Triton's ``specdec`` over gRPC per call (ignore_eos: fixed lengths)."""
    from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate

    client = ClientConfig(url, ClientProtocol.GRPC)

    def send(prompt: str) -> Reply:
        remote = generate(client, GenerateRequest(prompt=prompt, max_tokens=config.max_tokens, temperature=temperature,
                                                  speculation=speculation, num_draft_tokens=config.num_draft_tokens,
                                                  chat=True, stream=True, ignore_eos=True))
        return Reply(remote.text, int(remote.stats.get("num_output_tokens", 0)), remote.latency_s,
                     remote.time_to_first_chunk_s)

    return send


def drive_level(send: Callable[[str], Reply], prompts: list[str], mode: str, concurrency: int,
                config: ConcurrencyConfig) -> LevelResult:
    """``concurrency`` threads, each sending its requests (:meth:`ConcurrencyConfig.stream_requests`)
    back to back through ``send``; failures are counted and the run goes on."""
    result = LevelResult(mode, concurrency, 0, 0, 0.0)
    lock = threading.Lock()

    def stream(s: int) -> None:
        for number in config.stream_requests(s, concurrency):
            index = number % len(prompts)
            try:
                reply = send(prompts[index])
            except Exception as exc:  # counted and reported; the run goes on
                with lock:
                    result.errors.append(str(exc))
                continue
            with lock:
                result.requests += 1
                result.tokens += reply.tokens
                result.latencies_s.append(reply.latency_s)
                result.ttft_s.append(reply.ttft_s)
                result.texts.setdefault(index, reply.text)

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - started
    return result


def run_level(url: str, prompts: list[str], speculation: str, mode: str, concurrency: int,
              config: ConcurrencyConfig) -> LevelResult:
    """``concurrency`` gRPC streams to the server at ``url`` (:func:`drive_level`)."""
    return drive_level(grpc_sender(url, config, speculation), prompts, mode, concurrency, config)


def merge_levels(runs: list[LevelResult]) -> LevelResult:
    """One mode and level over its repeats: tokens and wall time summed (tokens/s is all
    tokens over all time), latencies pooled; a greedy text that changes between repeats is
    reported as an error (the output must not depend on the run)."""
    first = runs[0]
    merged = LevelResult(first.mode, first.concurrency, 0, 0, 0.0)
    for run in runs:
        merged.requests += run.requests
        merged.tokens += run.tokens
        merged.wall_s += run.wall_s
        merged.latencies_s += run.latencies_s
        merged.ttft_s += run.ttft_s
        merged.errors += run.errors
        merged.repeat_rates.append(run.tokens / run.wall_s if run.wall_s > 0 else 0.0)
        for index, text in run.texts.items():
            if merged.texts.setdefault(index, text) != text:
                merged.errors.append(f"prompt {index}: the text differs between repeats")
    return merged


def run_concurrency_bench(config: ConcurrencyConfig) -> dict[str, Any]:
    from contextlib import ExitStack

    from builder.stages.model_repository import render_model_repository
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer

    prompts = _prompts(config)
    runs: dict[tuple[str, int], list[LevelResult]] = {(m, c): [] for m in config.modes for c in config.concurrency}
    with ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}
        for mode in config.modes:
            deployment, serving, speculation = _serving(config, mode)
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"specbuild-concurrency-{mode}-")))
            repository = render_model_repository(deployment, work / "model_repo", serving)
            server = stack.enter_context(TritonServer(ServerConfig(repository, exit_timeout_s=10,
                                                                   log_file=work / "triton.log")))
            urls[mode] = (server.endpoints.grpc_url, speculation)
            logger.info("%s: Triton up at %s", mode, urls[mode][0])
        for mode, (url, speculation) in urls.items():  # warm-up
            run_level(url, prompts[:1], speculation, mode, 1, replace(config, requests_per_stream=1,
                                                                      requests_per_level=None))
        turn = 0
        for repeat in range(config.repeats):
            for c in config.concurrency:
                order = list(config.modes)
                order = order[turn % len(order):] + order[:turn % len(order)]
                turn += 1
                for mode in order:
                    url, speculation = urls[mode]
                    level = run_level(url, prompts, speculation, mode, c, config)
                    logger.info("repeat %d, %s x%d: %.1f tok/s", repeat + 1, mode, c, level.summary()["tokens_per_s"])
                    runs[(mode, c)].append(level)
    levels = [merge_levels(runs[(m, c)]) for m in config.modes for c in config.concurrency]
    return summarize(levels, config)


def summarize(levels: list[LevelResult], config: ConcurrencyConfig) -> dict[str, Any]:
    plain = {(lv.concurrency, i): t for lv in levels if lv.mode == "off" for i, t in lv.texts.items()}
    rows = []
    for lv in levels:
        row = lv.summary()
        same = [t == plain[(lv.concurrency, i)] for i, t in lv.texts.items() if (lv.concurrency, i) in plain]
        row["identical_to_plain"] = all(same) if same else None
        rows.append(row)
    rate = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        base = rate.get(("off", r["concurrency"]))
        r["speedup_over_plain"] = r["tokens_per_s"] / base if base else None
    return {"config": {"target": config.target, "method": config.method, "k": config.num_draft_tokens,
                       "max_tokens": config.max_tokens, "requests_per_stream": config.requests_per_stream,
                       "requests_per_level": config.requests_per_level, "repeats": config.repeats,
                       "concurrency": list(config.concurrency), "modes": list(config.modes)},
            "rows": rows, "headline": headline_figures(rate, config.concurrency)}


def headline_figures(rate: dict[tuple[str, int], float], concurrency: tuple[int, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    if rate.get(("off", 1)) and ("off", 8) in rate:
        out["serving_throughput_8_over_1"] = rate[("off", 8)] / rate[("off", 1)]
    ratios = []
    for c in concurrency:
        best = max(rate.get(("off", c), 0.0), rate.get(("always", c), 0.0))
        if ("load_aware", c) in rate and best > 0 and ("off", c) in rate and ("always", c) in rate:
            ratios.append(rate[("load_aware", c)] / best)
    if ratios:
        out["policy_worst_ratio_to_best"] = min(ratios)
    return out


def to_markdown(summary: dict[str, Any]) -> str:
    lines = ["| mode | streams | tok/s | per repeat | x plain | p50 s | p95 s | TTFT p50 s | TTFT p95 s | same as plain | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        speedup = f"{r['speedup_over_plain']:.2f}" if r["speedup_over_plain"] else "-"
        each = ", ".join(f"{v:.1f}" for v in r.get("tokens_per_s_by_repeat", []))
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {each} | {speedup} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p95_s']:.3f} | {r['identical_to_plain']} | {r['errors']} |")
    for key, value in summary["headline"].items():
        lines.append(f"\n{key}: {value:.3f}")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the plot")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in summary["config"]["modes"]:
        points = [(r["concurrency"], r["speedup_over_plain"]) for r in summary["rows"]
                  if r["mode"] == mode and r["speedup_over_plain"]]
        if points:
            ax.plot(*zip(*points), marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s over plain batched")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_concurrency_report(summary: dict[str, Any], target: ReportTarget) -> dict[str, Path]:
    target.out_dir.mkdir(parents=True, exist_ok=True)
    stem = target.out_dir / f"concurrency-{target.label}"
    paths = {"json": stem.with_suffix(".json"), "markdown": stem.with_suffix(".md")}
    from builder.report_paths import portable

    paths["json"].write_text(json.dumps(portable(summary), indent=2))
    paths["markdown"].write_text(to_markdown(summary) + "\n")
    if target.plot:
        image = plot(summary, stem.with_suffix(".png"))
        if image is not None:
            paths["plot"] = image
    if target.headline is not None and summary["headline"]:
        from builder.headline import update_headline

        update_headline(summary["headline"], target.headline)
        paths["headline"] = target.headline
    return paths


__all__ = ["ConcurrencyConfig", "MODES", "run_concurrency_bench", "write_concurrency_report"]
