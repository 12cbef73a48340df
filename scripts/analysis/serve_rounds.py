"""In-process serving under load, without Triton: the bench's serving modes side by side.

Builds the bench's deployment (SmolLM2-135M, n-gram, ``k`` drafts), then for each concurrency
and mode runs ``c`` requests (the bench prompts, chat, ``ignore_eos``) through a
:class:`~triton_backend.serving.service.SpecdecService` (parse, chat template, scheduler, response
building: everything the Triton model does except gRPC), interleaving the modes ``repeats``
times so a busy machine's noise falls on all of them alike. Prints aggregate tok/s per mode
and concurrency, the ratios the headline keys use, and per round: engine pass time against
the whole round, rows speculating, tokens per pass, and the scheduler thread's CPU time per
output token (its own clock: a busy machine slows the wall clock, not this one).

``--requests-per-stream 2 --max-tokens 64`` sends what the concurrency bench sends: each of
``c`` streams sends its requests back to back, stream ``s``'s ``r``-th with prompt
``s * 2 + r`` (so x1 sends two short chat prompts, x8 all fifteen, the long copy prompts
too: their prefill is a larger share of the x8 level's work). ``scripts/analysis/serve_paths.py``
runs the same levels in process and through Triton side by side.

    .venv/bin/python scripts/analysis/serve_rounds.py --concurrency 1,8,16 --modes off,always,load_aware
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field, replace

from builder.bench.config import DEFAULT_PROMPTS
from builder.ops.triton_client import GenerateRequest
from triton_backend.core.config import DraftLengthConfig, FallbackConfig, RuntimeConfig, SpeculationConfig
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.config import DeploymentConfig
from triton_backend.serving.interface import ServingConfig
from triton_backend.serving.service import SpecdecService


class Sink:
    """A client; ``latency_s``: each send and cancellation query waits this long (Triton's
    Python backend makes both a blocking round trip to the server process)."""

    latency_s = 0.0

    def __init__(self) -> None:
        self.done = threading.Event()
        self.tokens = 0
        self.errors: list[str] = []

    def send(self, outputs, final: bool) -> None:  # noqa: ANN001
        time.sleep(self.latency_s)
        if final:
            self.tokens = int(outputs["num_output_tokens"].reshape(-1)[0])
            self.done.set()

    def fail(self, exc) -> None:  # noqa: ANN001
        self.errors.append(str(exc))
        self.done.set()

    def cancelled(self) -> bool:
        time.sleep(self.latency_s)
        return False

    def close(self) -> None:
        self.done.set()


@dataclass
class RoundLog:
    """Per round: seconds in the engine pass, seconds of the whole round, rows, speculating rows, tokens."""

    rounds: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    regimes: dict[str, int] = field(default_factory=dict)  # the load-aware planner's regime: rounds
    cpu_s: float = 0.0  # the scheduler thread's CPU time in the rounds (immune to other processes' load)
    tokens: int = 0  # output tokens of the level's requests


PROFILE = None  # a cProfile.Profile over every round's work on the scheduler thread (--profile)


def instrument(service: SpecdecService, log: RoundLog) -> None:
    scheduler = service.scheduler
    engine_forward = scheduler.target.forward
    round_fn = scheduler._round
    state = {"pass": 0.0, "rows": 0, "spec": 0, "tokens": 0}

    def forward(rows):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = engine_forward(rows)
        state["pass"] += time.perf_counter() - t0
        state["rows"] = len(rows)
        state["spec"] = sum(1 for r in rows if len(r.tokens) > 1)
        state["tokens"] = sum(len(r.tokens) for r in rows)
        return out

    def one_round() -> None:
        state["pass"] = 0.0
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if PROFILE is not None:
            PROFILE.enable()
        try:
            round_fn()
        finally:
            if PROFILE is not None:
                PROFILE.disable()
        log.rounds.append((state["pass"], time.perf_counter() - t0, state["rows"], state["spec"], state["tokens"]))
        log.cpu_s += time.thread_time() - cpu0
        regime = scheduler.planner.regime
        log.regimes[regime.value if regime is not None else "-"] = log.regimes.get(regime.value if regime else "-", 0) + 1

    scheduler.target.forward = forward
    scheduler._round = one_round


def run_level(decoder, prompts: list[str], mode: str, c: int, k: int, max_tokens: int,  # noqa: ANN001
              pump: bool = True, share_prefix: bool = True, requests_per_stream: int = 1) -> tuple[float, RoundLog]:
    """``c`` streams sending ``requests_per_stream`` requests each, back to back; stream ``s``'s
    ``r``-th request has prompt ``(s * requests_per_stream + r) % len(prompts)``, as in the
    concurrency bench. Returns aggregate tok/s and the rounds' log."""
    spec = SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=k))
    if mode == "always":
        spec = replace(spec, fallback=FallbackConfig(enabled=False))
    serving = ServingConfig(max_batch_size=1 if mode == "serial" else max(c, 1), max_queue_size=64,
                            batch_policy="per_request" if mode == "always" else "load_aware",
                            default_max_tokens=max_tokens)
    service = SpecdecService(decoder, serving, spec)
    if not pump:  # the scheduler thread talks to the clients itself (as before the response pump)
        service._pump.wrap = lambda inner: inner
    if not share_prefix:  # every prompt prefilled whole (as before prompt prefixes were shared)
        service.scheduler._share_prefix = lambda seq, engine: None
    log = RoundLog()
    instrument(service, log)
    speculation = "off" if mode in ("serial", "off") else "ngram"
    sinks: list[Sink] = []
    lock = threading.Lock()

    def stream(s: int) -> None:  # the bench's client: requests back to back, its prompt choice
        for r in range(requests_per_stream):
            request = GenerateRequest(prompt=prompts[(s * requests_per_stream + r) % len(prompts)], max_tokens=max_tokens,
                                      speculation=speculation, num_draft_tokens=k, chat=True, stream=True,
                                      ignore_eos=True)
            sink = Sink()
            with lock:
                sinks.append(sink)
            service.submit(request.arrays(), sink)
            sink.done.wait(600)

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(c)]
    try:
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    finally:
        service.shutdown()
    errors = [e for s in sinks for e in s.errors]
    if errors:
        raise RuntimeError(f"{mode} x{c}: {errors[:3]}")
    log.tokens = sum(s.tokens for s in sinks)
    return log.tokens / wall, log


def summarize_rounds(log: RoundLog) -> str:
    r = log.rounds
    if not r:
        return "-"
    passes = [p for p, *_ in r]
    whole = [w for _, w, *_ in r]
    spec = [s for *_, s, _ in r]
    tokens = [t for *_, t in r]
    return (f"rounds {len(r)}, pass {1e3 * statistics.median(passes):.0f} ms of round {1e3 * statistics.median(whole):.0f} ms"
            f" (outside pass {1e3 * (sum(whole) - sum(passes)) / len(r):.0f} ms/round), rows speculating mean "
            f"{statistics.mean(spec):.2f}, tokens/pass {statistics.mean(tokens):.1f}, regimes {log.regimes}, "
            f"scheduler CPU {1e3 * log.cpu_s / max(1, log.tokens):.1f} ms/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--modes", default="off,always,load_aware")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--draft-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--requests-per-stream", type=int, default=1,
                        help="requests each stream sends back to back (the concurrency bench sends 2)")
    parser.add_argument("--verbose-rounds", action="store_true")
    parser.add_argument("--compare-pump", action="store_true",
                        help="also run each level with the scheduler thread sending responses itself")
    parser.add_argument("--compare-prefix", action="store_true",
                        help="also run each level with every prompt prefilled whole (no prefix sharing)")
    parser.add_argument("--sink-latency-ms", type=float, default=0.0,
                        help="each response send / cancellation query waits this long (Triton's IPC)")
    parser.add_argument("--profile", action="store_true", help="cProfile the rounds; print the top functions")
    args = parser.parse_args()
    global PROFILE
    if args.profile:
        import cProfile

        PROFILE = cProfile.Profile()
    Sink.latency_s = args.sink_latency_ms / 1e3
    logging.basicConfig(level=logging.WARNING)
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    data = json.loads(DEFAULT_PROMPTS.read_text())["workloads"]
    prompts = [p for w in ("chat", "code", "copy") for p in list(data[w])[:5]]
    deployment = DeploymentConfig(runtime=RuntimeConfig(num_threads=1, max_batch_size=max(16, *levels)),
                                  speculation=SpeculationConfig(draft_length=DraftLengthConfig(num_draft_tokens=args.draft_k)))
    decoder = build_decoder(deployment)
    run_level(decoder, prompts[:1], "off", 1, args.draft_k, 8)  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    cpu_per_token: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for c in levels:
            for mode in modes:
                variants = [(True, True)] + ([(False, True)] if args.compare_pump else []) + \
                    ([(True, False)] if args.compare_prefix else [])
                for pump, share in variants:
                    rate, log = run_level(decoder, prompts, mode, c, args.draft_k, args.max_tokens, pump, share,
                                          args.requests_per_stream)
                    name = mode if pump and share else f"{mode}-nopump" if share else f"{mode}-noprefix"
                    rates.setdefault((name, c), []).append(rate)
                    cpu_per_token.setdefault((name, c), []).append(log.cpu_s / max(1, log.tokens))
                    print(f"{name:>16} x{c:<3} {rate:6.1f} tok/s  {summarize_rounds(log)}", flush=True)
                if args.verbose_rounds:
                    for p, w, n, s, t in log.rounds:
                        print(f"    pass {1e3 * p:6.1f} ms round {1e3 * w:6.1f} ms rows {n:2d} spec {s:2d} tokens {t}")
    if PROFILE is not None:
        import pstats

        pstats.Stats(PROFILE).sort_stats("tottime").print_stats(25)
    best = {key: max(v) for key, v in rates.items()}
    print("\nmedian tok/s:", {f"{m}x{c}": round(statistics.median(v), 1) for (m, c), v in rates.items()})
    for name in ("off", "off-nopump", "off-noprefix"):
        if (name, 1) in best and (name, 8) in best:
            print(f"{name} 8-over-1: {statistics.median(rates[(name, 8)]) / statistics.median(rates[(name, 1)]):.2f} "
                  f"(scheduler CPU per token, x1 over x8: "
                  f"{statistics.median(cpu_per_token[(name, 1)]) / statistics.median(cpu_per_token[(name, 8)]):.2f})")
    for c in levels:
        if all((m, c) in rates for m in ("off", "always", "load_aware")):
            med = {m: statistics.median(rates[(m, c)]) for m in ("off", "always", "load_aware")}
            print(f"x{c}: load_aware / best(off, always) = {med['load_aware'] / max(med['off'], med['always']):.2f} "
                  f"(always/off {med['always'] / med['off']:.2f})")


if __name__ == "__main__":
    main()
