"""The ``specbuild bench`` subcommands that are not the speed table: ``pass-cost``,
``concurrency``, ``openai``, ``perf-analyzer``, ``json``, ``precision``, ``ngram-replay`` and
``render-readme``. Each: its flags -> the bench's typed config -> run -> its writer."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.bench.concurrency import MODES
from builder.bench.config import DEFAULT_OUT, BenchConfig
from builder.cli.bench_args import ints, prompt_arguments, report, report_target, results_arguments, words


def register(modes: argparse._SubParsersAction) -> None:
    for add in (_pass_cost, _concurrency, _openai, _perf_analyzer, _json, _precision, _ngram_replay, _render):
        add(modes)


def _pass_cost(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("pass-cost", help="the target's batched pass cost, rows x tokens per row, slot engine vs "
                         "the HF path")
    results_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (GPU figures: gpu_* headline keys)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per cell: 3 x this")
    p.add_argument("--sizes", type=ints, default=None, help="tokens per row (default 1..8)")
    p.add_argument("--batch", type=ints, default=None, help="rows per pass (default 1,2,4,8,16)")
    p.add_argument("--context", type=int, default=200, help="cached tokens per row")
    p.set_defaults(func=_cmd_pass_cost)


def _cmd_pass_cost(args: argparse.Namespace) -> int:
    from builder.bench.pass_cost import (DEFAULT_BATCH, DEFAULT_SIZES, PassCostConfig, measure_pass_cost,
                                         pass_cost_markdown, write_pass_cost)

    config = PassCostConfig(target=args.target, sizes=args.sizes or DEFAULT_SIZES, batch=args.batch or DEFAULT_BATCH,
                            context=args.context, repeats=args.repeats * 3, num_threads=args.threads, device=args.device)
    result = measure_pass_cost(config)
    return report(result, write_pass_cost, report_target(args), pass_cost_markdown(result))


def _requests(text: str) -> tuple[int | None, int]:
    """``N`` (every level sends N requests, round-robin over its streams) or ``N/stream`` (each
    stream sends N of its own) -> (requests_per_level, requests_per_stream)."""
    count, sep, unit = text.partition("/")
    if not count.strip().isdigit() or (sep and unit.strip() != "stream"):
        raise argparse.ArgumentTypeError(f"expected N or N/stream, got {text!r}")
    return (None, int(count)) if sep else (int(count), 2)


def _method(text: str) -> tuple[str, str | None]:
    """``ngram``, ``draft=DIR`` or ``medusa=DIR`` -> (method, drafter path)."""
    method, sep, path = text.partition("=")
    if method not in ("ngram", "draft", "medusa") or (method == "ngram") == bool(sep):
        raise argparse.ArgumentTypeError(f"expected ngram, draft=DIR or medusa=DIR, got {text!r}")
    return method, path or None


def _serving_arguments(p: argparse.ArgumentParser) -> None:
    """concurrency and openai: a real Triton server, streams of requests at each level."""
    results_arguments(p)
    p.add_argument("levels", type=ints, metavar="LEVELS", help="concurrent streams per level, e.g. 1,2,4,8,16")
    p.add_argument("--method", type=_method, default=("ngram", None), metavar="ngram|draft=DIR|medusa=DIR",
                   help="drafter of the speculating modes (default ngram)")
    p.add_argument("--k", type=int, default=4, help="draft length of the speculating modes")
    prompt_arguments(p)
    p.add_argument("--requests", type=_requests, default=(32, 2), metavar="N|N/stream",
                   help="N: every level sends N requests round-robin over its streams (the same work at every "
                        "level; default 32); N/stream: each stream sends N of its own")
    p.add_argument("--repeats", type=int, default=2, help="interleaved sweeps over every level (figures pool them)")


def _concurrency(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("concurrency", help="serving throughput/latency through a real Triton server at each "
                         "number of concurrent streams")
    _serving_arguments(p)
    p.add_argument("--modes", type=words, default=MODES,
                   help="serving modes (serial = the old one-at-a-time baseline)")
    p.set_defaults(func=_cmd_concurrency)


def _openai(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("openai", help="the same chat requests through Triton gRPC and through the OpenAI API in "
                         "front of it, side by side (headline openai_latency_x_grpc; docs/openai.md)")
    _serving_arguments(p)
    p.set_defaults(func=_cmd_concurrency, modes=MODES, api="openai")


def _concurrency_config(args: argparse.Namespace):  # -> ConcurrencyConfig
    from builder.bench.concurrency import ConcurrencyConfig

    method, path = args.method
    per_level, per_stream = args.requests
    return ConcurrencyConfig(
        target=args.target, concurrency=args.levels, method=method, draft=path if method == "draft" else None,
        medusa=path if method == "medusa" else None, modes=args.modes, num_draft_tokens=args.k, prompts_file=args.prompts,
        workloads=args.workloads, prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens,
        requests_per_stream=per_stream, requests_per_level=per_level, repeats=args.repeats, num_threads=args.threads)


def _cmd_concurrency(args: argparse.Namespace) -> int:
    config = _concurrency_config(args)
    if getattr(args, "api", None) == "openai":
        from builder.bench import openai_api

        summary = openai_api.run_api_bench(config)
        return report(summary, openai_api.write_api_report, report_target(args), openai_api.to_markdown(summary))
    from builder.bench.concurrency import run_concurrency_bench, to_markdown, write_concurrency_report

    summary = run_concurrency_bench(config)
    return report(summary, write_concurrency_report, report_target(args), to_markdown(summary))


def _perf_analyzer(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("perf-analyzer", help="NVIDIA's perf_analyzer against a real Triton server (needs "
                         "scripts/get_perf_analyzer.sh)")
    results_arguments(p, headline=False)
    p.add_argument("levels", type=ints, nargs="?", default=(1, 2, 4), metavar="LEVELS",
                   help="concurrency levels (default 1,2,4)")
    p.add_argument("--model", choices=("ensemble", "tensorrt_llm_bls"), default="ensemble",
                   help="ensemble (gRPC streaming) or tensorrt_llm_bls")
    prompt_arguments(p)
    p.set_defaults(func=_cmd_perf_analyzer)


def _cmd_perf_analyzer(args: argparse.Namespace) -> int:
    from builder.bench.perf_analyzer_bench import (PerfAnalyzerBenchConfig, run_perf_analyzer_bench, to_markdown,
                                                   write_perf_analyzer_report)

    config = PerfAnalyzerBenchConfig(
        target=args.target, model=args.model, streaming=args.model == "ensemble", concurrency=args.levels,
        prompts_file=args.prompts, workloads=args.workloads, prompts_per_workload=args.prompts_per_workload,
        max_tokens=args.max_tokens, num_threads=args.threads, out_dir=args.out, label=args.label)
    result = run_perf_analyzer_bench(config)
    return report(result, write_perf_analyzer_report, report_target(args), to_markdown(result.rows, config))


def _json(modes: argparse._SubParsersAction) -> None:
    from builder.bench.guided_json import JsonBenchConfig

    p = modes.add_parser("json", help="the JSON workload (extraction and tool-call prompts with schemas): "
                         "unconstrained plain, constrained plain and constrained speculative rows side by side, "
                         "outputs checked against constrained plain and their schemas (headline guided_*; "
                         "docs/structured-output.md)")
    results_arguments(p)
    p.add_argument("--prompts", type=Path, default=None, help="the prompt file (default benchmarks/json_prompts.json)")
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ngram-k", type=int, default=JsonBenchConfig.ngram_k, help="the speculative rows' n-gram draft length")
    p.set_defaults(func=_cmd_json)


def _cmd_json(args: argparse.Namespace) -> int:
    from builder.bench.guided_json import DEFAULT_JSON_PROMPTS, JsonBenchConfig, run_json_bench
    from builder.bench.guided_json_report import json_markdown, summarize_json, write_json_report

    config = JsonBenchConfig(target=args.target, prompts_file=args.prompts or DEFAULT_JSON_PROMPTS,
                             max_tokens=args.max_tokens, repeats=args.repeats, ngram_k=args.ngram_k,
                             num_threads=args.threads, out_dir=args.out, label=args.label)
    summary = summarize_json(run_json_bench(config))
    return report(summary, write_json_report, report_target(args), json_markdown(summary))


def _precision(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("precision", help="plain decoding of weight precisions against float32, one process: tok/s "
                         "at 1 row and greedy agreement on the held-out prompts (headline <p>_plain_x_fp32, "
                         "<p>_greedy_agreement; docs/quantized-weights.md)")
    results_arguments(p)
    p.add_argument("precisions", type=words, metavar="LIST", help="int8,int4,fp8,float16,bfloat16 (any of them)")
    p.add_argument("--agreement-prompts", type=int, default=16, help="held-out prompts for the agreement")
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=_cmd_precision)


def _cmd_precision(args: argparse.Namespace) -> int:
    from builder.bench.precision import PrecisionBenchConfig, precision_markdown, run_precision_bench, write_precision_bench
    from triton_backend.core.errors import ConfigError

    try:
        config = PrecisionBenchConfig(target=args.target, precisions=args.precisions, prompts=args.agreement_prompts,
                                      max_tokens=args.max_tokens, repeats=args.repeats, num_threads=args.threads)
    except ValueError as exc:
        raise ConfigError(f"bench precision: {exc}") from None
    result = run_precision_bench(config)
    return report(result, write_precision_bench, report_target(args), precision_markdown(result))


def _ngram_replay(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("ngram-replay", help="replay n-gram speculation over recorded plain greedy outputs in "
                         "pass-cost units (no model, no timing noise)")
    p.add_argument("records", type=Path, metavar="RECORDS", help="the recorded outputs (JSON)")
    p.add_argument("--record", action="store_true",
                   help="first record RECORDS (the bench prompts and two held-out sets; runs the model)")
    p.add_argument("--set", default="bench", help="bench, tune, check or all")
    p.add_argument("--costs", default=None, help="a pass-cost JSON file or tokens:cost pairs (default: this machine's table)")
    p.add_argument("--ngram-max", type=int, default=None, help="longest n-gram matched")
    p.add_argument("--trace", default=None, help="print this workload's rounds, drafted/accepted ('-': no match)")
    p.add_argument("--ngram-k", type=ints, default=(4, 8), help="draft lengths replayed")
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens)
    p.add_argument("--target", default=BenchConfig.target, help="--record: the model")
    p.add_argument("--threads", type=int, default=1, help="--record: torch CPU threads")
    p.set_defaults(func=_cmd_ngram_replay)


def _cmd_ngram_replay(args: argparse.Namespace) -> int:
    from builder.bench.ngram_replay import ReplayConfig, record, replay_table

    config = ReplayConfig(records=args.records, sets=args.set, k=args.ngram_k, max_tokens=args.max_tokens,
                          costs=args.costs, ngram_max=args.ngram_max, trace=args.trace)
    if args.record:
        print(f"recorded {record(config.records, config.max_tokens, args.target, args.threads)} outputs "
              f"into {config.records}")
    print("\n".join(replay_table(config)))
    return 0


def _render(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("render-readme", help="rewrite the figure tables of README.md and docs/*.md from the "
                         "result files")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the results folder (default benchmarks/results/)")
    p.add_argument("--check", action="store_true", help="write nothing, fail if a table is stale")
    p.set_defaults(func=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    from builder.bench.docs_render import render_docs
    from triton_backend.core.errors import ConfigError

    stale = render_docs(results=args.out, check=args.check)
    if stale and args.check:
        raise ConfigError(f"stale figure tables in {', '.join(str(p) for p in stale)}: "
                          "run `specbuild bench render-readme`")
    for path in stale:
        print(f"rendered: {path}")
    if not stale:
        print(f"every figure table matches {args.out}")
    return 0


__all__ = ["register"]
