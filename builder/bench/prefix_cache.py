"""Prefix caching and chunked prefill, measured in process through the batch scheduler (issue 46).

Two measures on the reference model, each side by side in one run (``scripts/prefix_cache_bench.py``):

- ``prefix_cache_ttft_x_cold``: time to the first token of a follow-up chat turn whose prompt
  shares a long prefix (a system prompt of ``shared_tokens`` tokens, the first turn and its
  answer) with a request that has finished, with the prefix cache on, over the same turn's with
  the cache off (its whole prompt prefilled). Both arms greedy; their outputs are compared.
- ``chunked_prefill_stream_rate_kept``: tokens/s of ``streams`` running plain streams while a
  ``long_prompt_tokens``-token prompt arrives (from its arrival to its first token, or for
  ``window_s`` seconds of its prefill when that takes longer: a round's cost is the same all
  through it), over their rate just before it arrived, for each ``prefill_chunk_tokens`` in ``chunk_sizes``;
  the figure is the largest chunk keeping at least ``keep_goal`` of the rate (the chunk is
  reported with it), and the long prompt's own time to first token at each size.

Requests go to :class:`~triton_backend.batching.scheduler.BatchScheduler` directly (no server):
what is measured is the scheduler and the engine, not the transport.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from builder.report_paths import repo_path
from builder.headline import HEADLINE_PATH, update_headline
from triton_backend.batching.scheduler import BatchScheduler, SchedulerConfig
from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.torch.model_loading import load_engine
from triton_backend.speculation.torch_decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "benchmarks" / "prompts.json"
RESULTS = ROOT / "benchmarks" / "results"
PLAIN = SpeculationConfig(method="off")


@dataclass(frozen=True)
class PrefixBenchConfig:
    target: str = "smollm2-135m-instruct"
    max_seq_len: int = 4096  # the default deployment's 2,048 leaves no room beside a 2,000-token prompt
    slots: int = 8
    shared_tokens: int = 1600  # the system prompt's tokens (the follow-up turn shares it and turn 1)
    answer_tokens: int = 32
    repeats: int = 3
    streams: int = 4
    long_prompt_tokens: int = 2000
    chunk_sizes: tuple[int, ...] = (4, 8, 12, 16, 32, 512)
    keep_goal: float = 0.7
    baseline_s: float = 3.0
    window_s: float = 12.0
    kernel_threads: int = 1  # a loaded 2-core host: helper threads that spin would measure the load
    label: str = "cpu"
    out: Path = RESULTS
    headline: Path | None = HEADLINE_PATH


class Clock:
    """A client that notes when each chunk came and how many tokens it carried."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.first = threading.Event()
        self.stop = False

    def on_chunk(self, chunk: Any) -> None:
        self.marks.append((time.perf_counter(), len(chunk.token_ids)))
        self.tokens.extend(chunk.token_ids)
        self.first.set()
        if chunk.finished:
            self.done.set()

    def on_error(self, exc: BaseException) -> None:
        self.error = exc
        self.first.set()
        self.done.set()

    def cancelled(self) -> bool:
        return self.stop

    def on_cancelled(self) -> None:
        self.done.set()

    def between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.marks if start < t <= end)


def _texts() -> list[str]:
    workloads = json.loads(PROMPTS.read_text())["workloads"]
    return [p for prompts in workloads.values() for p in prompts]


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """An agent-style system prompt of at least ``tokens`` tokens, made of the bench prompts."""
    lines, texts = ["You are a careful assistant. Notes from earlier sessions follow; use them when relevant."], _texts()
    i = 0
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        lines.append(f"Note {i + 1}: {texts[i % len(texts)]}")
        i += 1
    return "\n".join(lines)


def _encode(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's prompt, as the server encodes a rendered chat."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _run(scheduler: BatchScheduler, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """(output, time to first token) of one request."""
    clock = Clock()
    started = time.perf_counter()
    scheduler.submit(prompt, params, PLAIN, clock)
    if not clock.done.wait(600) or clock.error is not None:
        raise RuntimeError(f"a bench request failed: {clock.error}")
    return clock.tokens, clock.marks[0][0] - started


def measure_ttft(decoder: SpeculativeDecoder, config: PrefixBenchConfig) -> dict[str, Any]:
    """A follow-up turn's time to first token, cache on (turn 1 finished just before) vs off."""
    tok = decoder.tokenizer
    system = {"role": "system", "content": system_prompt(tok, config.shared_tokens)}
    first = [system, {"role": "user", "content": "Which of the notes is about cats? Answer in one sentence."}]
    turn1 = _encode(tok, first)
    answer_params = SamplingParams(max_tokens=config.answer_tokens, ignore_eos=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cold, warm, outputs, shared = [], [], set(), 0
    for _ in range(config.repeats):
        off = BatchScheduler(decoder, SchedulerConfig(max_batch_size=config.slots, prefix_cache=False))
        on = BatchScheduler(decoder, SchedulerConfig(max_batch_size=config.slots))
        try:
            answer, _ = _run(on, turn1, answer_params)
            follow = _encode(tok, first + [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                                           {"role": "user", "content": "And which one is about the weather?"}])
            entry = turn1 + answer
            shared = next((i for i, (a, b) in enumerate(zip(entry, follow)) if a != b), min(len(entry), len(follow)))
            deadline = time.monotonic() + 60
            while len(on.prefix_cache or ()) == 0 and time.monotonic() < deadline:  # turn 1's slot joins the cache
                time.sleep(0.001)
            out_on, ttft_on = _run(on, follow, params)
            out_off, ttft_off = _run(off, follow, params)
        finally:
            on.shutdown()
            off.shutdown()
        warm.append(ttft_on)
        cold.append(ttft_off)
        outputs.add((tuple(out_on), tuple(out_off)))
    identical = all(a == b for a, b in outputs)
    ratio = statistics.median(warm) / statistics.median(cold)
    logger.info("follow-up TTFT: cache %.1f ms, cold %.1f ms (x%.3f), %d shared tokens of %d",
                1e3 * statistics.median(warm), 1e3 * statistics.median(cold), ratio, shared, len(follow))
    return {"prompt_tokens": len(follow), "shared_tokens": shared, "system_tokens": config.shared_tokens,
            "ttft_cached_s": warm, "ttft_cold_s": cold, "ttft_x_cold": round(ratio, 4), "outputs_identical": identical}


def stream_rate(decoder: SpeculativeDecoder, config: PrefixBenchConfig, chunk: int, long_prompt: list[int],
                prompts: list[list[int]]) -> dict[str, float]:
    """The running streams' tokens/s before and while the long prompt prefills at ``chunk`` tokens a round."""
    scheduler = BatchScheduler(decoder, SchedulerConfig(max_batch_size=config.slots, prefill_chunk_tokens=chunk,
                                                        prefix_cache=False))
    clocks, long = [Clock() for _ in prompts], Clock()
    try:
        params = SamplingParams(max_tokens=config.max_seq_len - max(len(p) for p in prompts) - 8, ignore_eos=True)
        for prompt, clock in zip(prompts, clocks):
            scheduler.submit(prompt, params, PLAIN, clock)
        for clock in clocks:
            clock.first.wait(120)
        time.sleep(0.5 + config.baseline_s)  # every stream decoding, then the baseline window
        arrival = time.perf_counter()
        scheduler.submit(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True), PLAIN, long)
        done = long.first.wait(config.window_s)
        if long.error is not None:
            raise RuntimeError(f"the long prompt failed: {long.error}")
        end = long.marks[0][0] if done else time.perf_counter()
        before = sum(c.between(arrival - config.baseline_s, arrival) for c in clocks) / config.baseline_s
        during = sum(c.between(arrival, end) for c in clocks) / (end - arrival)
    finally:
        long.stop = True
        for clock in clocks:
            clock.stop = True
        scheduler.shutdown()
    return {"chunk": chunk, "rate_before": round(before, 2), "rate_during": round(during, 2),
            "kept": round(during / before, 4), "long_ttft_s": round(end - arrival, 3) if done else None}


def _median_or_none(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and all(v is not None for v in values) else None


def measure_chunking(decoder: SpeculativeDecoder, config: PrefixBenchConfig) -> dict[str, Any]:
    tok = decoder.tokenizer
    texts = _texts()
    prompts = [_encode(tok, [{"role": "user", "content": t}]) for t in texts[:config.streams]]
    long_prompt = _encode(tok, [{"role": "system", "content": system_prompt(tok, config.long_prompt_tokens)},
                                {"role": "user", "content": "Summarize the notes."}])[:config.long_prompt_tokens]
    trials: dict[int, list[dict[str, float]]] = {c: [] for c in config.chunk_sizes}
    for _ in range(config.repeats):
        for chunk in config.chunk_sizes:  # interleaved: the machine's load drifts alike for every size
            trials[chunk].append(stream_rate(decoder, config, chunk, long_prompt, prompts))
            logger.info("chunk %d: %s", chunk, trials[chunk][-1])
    rows = [{"chunk": c, "kept": statistics.median(t["kept"] for t in ts),
             "long_ttft_s": _median_or_none([t["long_ttft_s"] for t in ts]),
             "rate_before": statistics.median(t["rate_before"] for t in ts), "trials": ts} for c, ts in trials.items()]
    good = [r for r in rows if r["kept"] >= config.keep_goal]
    chosen = max(good, key=lambda r: r["chunk"]) if good else max(rows, key=lambda r: r["kept"])
    return {"long_prompt_tokens": len(long_prompt), "streams": config.streams, "rows": rows,
            "chosen_chunk": chosen["chunk"], "kept": chosen["kept"]}


def run_prefix_bench(config: PrefixBenchConfig) -> dict[str, Any]:
    """Both measures; writes ``prefix-cache-<label>.json`` / ``.md`` under ``config.out`` and the
    headline figures (a CPU run's keys; a GPU run's carry ``gpu_``)."""
    engine, tokenizer = load_engine(config.target, RuntimeConfig(max_seq_len=config.max_seq_len,
                                                                 max_batch_size=config.slots,
                                                                 kernel_threads=config.kernel_threads))
    decoder = SpeculativeDecoder(engine, tokenizer)
    result: dict[str, Any] = {"config": {k: (repo_path(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
                              "engine": repr(engine), "measured_through": "BatchScheduler in process (no server)"}
    result["ttft"] = measure_ttft(decoder, config)
    result["chunked_prefill"] = measure_chunking(decoder, config)
    figures = {"prefix_cache_ttft_x_cold": result["ttft"]["ttft_x_cold"],
               "chunked_prefill_stream_rate_kept": result["chunked_prefill"]["kept"],
               "chunked_prefill_chunk_tokens": result["chunked_prefill"]["chosen_chunk"]}
    if config.label != "cpu":
        figures = {f"{config.label}_{k}": v for k, v in figures.items()}
    result["figures"] = figures
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / f"prefix-cache-{config.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    (config.out / f"prefix-cache-{config.label}.md").write_text(markdown(result))
    if config.headline is not None and result["ttft"]["outputs_identical"]:
        update_headline(figures, config.headline)
    return result


def markdown(result: dict[str, Any]) -> str:
    ttft, chunked = result["ttft"], result["chunked_prefill"]
    lines = [f"# Prefix caching and chunked prefill ({result['config']['label']})", "",
             f"Engine: `{result['engine']}`; measured through the {result['measured_through']}.", "",
             "## Follow-up turn, time to first token", "",
             f"Prompt {ttft['prompt_tokens']} tokens, {ttft['shared_tokens']} shared with a finished request "
             f"(system prompt {ttft['system_tokens']} tokens, turn 1 and its answer).", "",
             "| arm | TTFT (median, ms) | runs (ms) |", "|---|---|---|"]
    for name, key in (("prefix cache", "ttft_cached_s"), ("cold (cache off)", "ttft_cold_s")):
        runs = ttft[key]
        lines.append(f"| {name} | {1e3 * statistics.median(runs):.1f} | {', '.join(f'{1e3 * r:.1f}' for r in runs)} |")
    lines += ["", f"prefix_cache_ttft_x_cold = **{ttft['ttft_x_cold']}**; outputs identical: {ttft['outputs_identical']}",
              "", f"## {chunked['streams']} streams while a {chunked['long_prompt_tokens']}-token prompt arrives", "",
              "| prefill_chunk_tokens | rate kept (median) | streams' tok/s before | long prompt's TTFT (s) |",
              "|---|---|---|---|"]
    for row in chunked["rows"]:
        ttft_s = f"{row['long_ttft_s']:.2f}" if row["long_ttft_s"] is not None else f"> {result['config']['window_s']}"
        lines.append(f"| {row['chunk']} | {row['kept']:.3f} | {row['rate_before']:.1f} | {ttft_s} |")
    lines += ["", f"chunked_prefill_stream_rate_kept = **{chunked['kept']}** at {chunked['chosen_chunk']} tokens a round "
              "(the largest chunk measured keeping the goal's share, else the best)", ""]
    return "\n".join(lines)


__all__ = ["PrefixBenchConfig", "measure_chunking", "measure_ttft", "run_prefix_bench", "stream_rate", "system_prompt"]
