"""Aggregates samples into the benchmark table: markdown, JSON and a PNG plot."""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

from builder.bench.config import BenchRun, Sample
from builder.headline import device_keys, update_headline
from builder.report_paths import portable
from builder.bench.rows import is_speculative_row
from builder.bench.self_draft import self_draft_headline
from builder.bench.writer import ReportTarget, ReportWriter
from triton_backend.speculation.controller import expected_tokens_per_round

logger = logging.getLogger(__name__)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _throughput_by_repeat(samples: list[Sample]) -> dict[int, float]:
    tokens: dict[int, int] = defaultdict(int)
    seconds: dict[int, float] = defaultdict(float)
    for s in samples:
        tokens[s.repeat] += s.num_tokens
        seconds[s.repeat] += s.latency_s
    return {r: tokens[r] / seconds[r] for r in tokens if seconds[r] > 0}


def _acceptance(samples: list[Sample]) -> dict:
    stats = [s.stats for s in samples if s.stats]
    if not stats:
        return {}
    drafted = sum(st["drafted_tokens"] for st in stats)
    accepted = sum(st["accepted_tokens"] for st in stats)
    rounds = sum(st["speculative_rounds"] for st in stats)
    passes = sum(st["target_passes"] for st in stats)
    generated = sum(st["generated_tokens"] for st in stats)
    lengths = [k for st in stats for k in st["draft_lengths"]]
    out = {"target_passes_per_token": passes / generated if generated else 0.0,
           "tokens_per_target_pass": generated / passes if passes else 0.0}
    out.update(_outside_target(stats))
    if drafted:
        a = accepted / drafted
        k_mean = sum(lengths) / len(lengths)
        positions: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for st in stats:
            for i, (d, acc) in enumerate(zip(st["drafted_per_position"], st["accepted_per_position"])):
                positions[i][0] += d
                positions[i][1] += acc
        out.update(acceptance_rate=a, mean_accepted_length=accepted / rounds if rounds else 0.0,
                   mean_draft_length=k_mean, expected_tokens_per_pass=expected_tokens_per_round(a, round(k_mean)),
                   per_position_acceptance=[acc / d if d else 0.0 for _, (d, acc) in sorted(positions.items())],
                   fallbacks=sum(1 for st in stats if st["fallback"]))
    return out


def _outside_target(stats: list[dict]) -> dict:
    """What the rows' rounds cost beyond the target's passes (drafting, tree building,
    verification, commits, bookkeeping): ms per target pass and its share of the request time,
    beside the target's own ms per pass. Empty where no pass was timed (rows sharing a batched pass)."""
    timed = [st for st in stats if st.get("target_pass_time_s")]
    passes = sum(st["target_passes"] for st in timed)
    total = sum(st["total_time_s"] for st in timed)
    target = sum(st["target_pass_time_s"] for st in timed)
    if not passes or total <= 0:
        return {}
    outside = max(0.0, total - target)
    return {"target_pass_ms": 1e3 * target / passes, "outside_target_ms_per_pass": 1e3 * outside / passes,
            "outside_target_share": outside / total}


def _same_output(sample: Sample, plain: Sample | None) -> bool:
    if plain is None:
        return False
    return sample.tokens == plain.tokens if sample.tokens else sample.text == plain.text


def summarize(run: BenchRun) -> dict:
    by_row_workload: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in run.samples:
        by_row_workload[(s.row, s.workload)].append(s)
    plain = {(s.workload, s.prompt_index, s.repeat): s for s in run.samples if s.row == "plain"}
    by_key = {(s.row, s.workload, s.prompt_index, s.repeat): s for s in run.samples}
    table = []
    for workload in list(run.config.workloads) + ["all"]:
        tput = {}
        for row in run.rows:
            samples = [s for (r, w), ss in by_row_workload.items() if r == row and (w == workload or workload == "all") for s in ss]
            tput[row] = _throughput_by_repeat(samples)
        for row in run.rows:
            samples = [s for (r, w), ss in by_row_workload.items() if r == row and (w == workload or workload == "all") for s in ss]
            if not samples:
                continue
            reps = sorted(tput[row])
            ratio_plain = [tput[row][r] / tput["plain"][r] for r in reps if r in tput["plain"]]
            ratio_hf = [tput[row][r] / tput["hf plain"][r] for r in reps if r in tput.get("hf plain", {})]
            identical = all(_same_output(s, plain.get((s.workload, s.prompt_index, s.repeat))) for s in samples)
            latencies = [s.latency_s for s in samples]
            entry = {
                "workload": workload, "row": row, **run.row_info.get(row, {}),
                "tokens_per_s": statistics.median(tput[row].values()),
                "tokens_per_s_spread": [min(tput[row].values()), max(tput[row].values())],
                "speedup_vs_plain": statistics.median(ratio_plain) if ratio_plain else None,
                "speedup_vs_plain_spread": [min(ratio_plain), max(ratio_plain)] if ratio_plain else None,
                "speedup_vs_hf_plain": statistics.median(ratio_hf) if ratio_hf else None,
                "ttft_s_p50": _percentile([s.ttft_s for s in samples], 0.5),
                "latency_s_p50": _percentile(latencies, 0.5), "latency_s_p95": _percentile(latencies, 0.95),
                "identical_to_plain": identical, "requests": len(samples),
                **_acceptance(samples),
            }
            twin = run.row_info.get(row, {}).get("twin")
            if twin:
                ratios = [s.latency_s / by_key[(twin, s.workload, s.prompt_index, s.repeat)].latency_s
                          for s in samples if (twin, s.workload, s.prompt_index, s.repeat) in by_key]
                entry["serving_overhead"] = statistics.median(ratios) - 1 if ratios else None
            table.append(entry)
    return {"environment": run.environment, "config": portable(asdict(run.config)), "rows": table}


def headline_figures(summary: dict) -> dict[str, float]:
    """The speculation headline: the worst of our speculative rows against plain over every
    workload, the best on copy and over all workloads, the best on copy against Hugging
    Face prompt lookup (the ratio of both rows' x-plain figures), the ``auto`` row over all
    workloads, the EAGLE rows' tokens per target pass and the self-draft rows' chat figure. Only what this run measured."""
    rows = [e for e in summary["rows"] if e.get("speedup_vs_plain") is not None]
    ours = [e for e in rows if is_speculative_row(e)]
    figures: dict[str, float] = {}
    per_workload = [e["speedup_vs_plain"] for e in ours if e["workload"] != "all"]
    if per_workload:
        figures["worst_speculative_row_x_plain"] = min(per_workload)
    best_all = [e["speedup_vs_plain"] for e in ours if e["workload"] == "all"]
    if best_all:
        figures["best_all_x_plain"] = max(best_all)
    # the best auto row as it deploys (any model drafter beside lookup, an EAGLE one with merged
    # trees; not the comparison row without them) among those whose outputs equal plain decoding's
    auto_all = [e["speedup_vs_plain"] for e in ours if e["workload"] == "all" and e.get("method") == "auto"
                and e.get("identical_to_plain", True)
                and not (e.get("model_drafter") == "eagle" and e.get("merge_lookup") is False)]
    if auto_all:
        figures["auto_all_x_plain"] = max(auto_all)
    eagle_passes = [e["tokens_per_target_pass"] for e in ours if e["workload"] == "all" and e.get("method") == "eagle"
                    and e.get("tokens_per_target_pass")]
    if eagle_passes:
        figures["eagle_tokens_per_pass"] = max(eagle_passes)
    figures.update(self_draft_headline(ours))
    best_copy = [e["speedup_vs_plain"] for e in ours if e["workload"] == "copy"]
    if best_copy:
        figures["best_copy_x_plain"] = max(best_copy)
        peer = [e["speedup_vs_plain"] for e in rows if e["workload"] == "copy" and e["row"] == "hf prompt-lookup"]
        if peer and peer[0] > 0:
            figures["copy_x_hf_prompt_lookup"] = max(best_copy) / peer[0]
    return figures


def heldout_figures(summary: dict, split: str = "heldout") -> dict[str, float]:
    """A run on a held-out prompt set (``bench heldout``: ``split`` "heldout"; ``bench
    mtbench``: "mtbench"): the EAGLE rows' tokens per target pass and the deployed ``auto`` row
    over plain, on chat and over all workloads, and whether every speculative row's output equals
    plain decoding's (1) or not (0). Kept apart from the bench prompts' keys: these sets are what
    nobody tuned on."""
    ours = [e for e in summary["rows"] if e.get("speedup_vs_plain") is not None and is_speculative_row(e)]
    figures: dict[str, float] = {}
    for workload in ("chat", "all"):
        passes = [e["tokens_per_target_pass"] for e in ours if e["workload"] == workload
                  and e.get("method") == "eagle" and e.get("tokens_per_target_pass")]
        if passes:
            figures[f"eagle_{split}_{workload}_tokens_per_pass"] = max(passes)
        auto = [e["speedup_vs_plain"] for e in ours if e["workload"] == workload and e.get("method") == "auto"
                and not (e.get("model_drafter") == "eagle" and e.get("merge_lookup") is False)]
        if auto:
            figures[f"{split}_{workload}_auto_x_plain"] = max(auto)
    if ours:
        figures[f"{split}_rows_identical_to_plain"] = float(all(e.get("identical_to_plain") for e in ours))
    return figures


def _fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def to_markdown(summary: dict) -> str:
    env = summary["environment"]
    cfg = summary["config"]
    lines = [
        f"Machine: {env['processor']} ({env['device']}, torch {env['torch']}, {env['threads']} thread(s)); "
        f"{'exactly' if cfg.get('ignore_eos') else 'up to'} {cfg['max_tokens']} new tokens per request "
        f"({'past EOS' if cfg.get('ignore_eos') else 'stopping at EOS'}), {cfg['repeats']} interleaved repeats; "
        f"greedy, float32.",
        "",
        "| workload | row | tok/s | x plain (spread) | x HF plain | TTFT p50 s | p50 s | p95 s | accept | mean acc len | tok/pass | E(a,k) "
        "| outside target ms/pass (share) | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary["rows"]:
        spread = e.get("speedup_vs_plain_spread")
        x_plain = f"{_fmt(e['speedup_vs_plain'])} ({_fmt(spread[0])}-{_fmt(spread[1])})" if spread else "-"
        share = e.get("outside_target_share")
        outside = (f"{_fmt(e['outside_target_ms_per_pass'], '.1f')} ({100 * share:.0f} %)" if share is not None else "-")
        lines.append(
            f"| {e['workload']} | {e['row']} | {_fmt(e['tokens_per_s'], '.1f')} | {x_plain} | {_fmt(e['speedup_vs_hf_plain'])} "
            f"| {_fmt(e['ttft_s_p50'], '.3f')} | {_fmt(e['latency_s_p50'])} | {_fmt(e['latency_s_p95'])} "
            f"| {_fmt(e.get('acceptance_rate'), '.3f')} | {_fmt(e.get('mean_accepted_length'))} "
            f"| {_fmt(e.get('tokens_per_target_pass'))} | {_fmt(e.get('expected_tokens_per_pass'))} | {outside} | {_fmt(e['identical_to_plain'])} |"
        )
    overheads = [e for e in summary["rows"] if e["workload"] == "all" and e.get("serving_overhead") is not None]
    drafters = sorted({(e["drafter"], e["eagle_format"]) for e in summary["rows"] if e.get("drafter")})
    if drafters:
        lines += [""] + [f"EAGLE drafter: {path} ({fmt})" for path, fmt in drafters]
    if overheads:
        lines += ["", "Serving overhead through Triton (gRPC streaming, median of per-request latency ratios "
                      "against the same request in-process):", ""]
        for e in overheads:
            lines.append(f"- {e['row']}: {100 * e['serving_overhead']:+.1f} %")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the plot")
        return None
    rows = [e for e in summary["rows"] if e["workload"] != "all"]
    workloads = list(dict.fromkeys(e["workload"] for e in rows))
    names = list(dict.fromkeys(e["row"] for e in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        values = [next((e["speedup_vs_plain"] or 0 for e in rows if e["row"] == name and e["workload"] == w), 0) for w in workloads]
        ax1.bar([i + j * width for i in range(len(workloads))], values, width, label=name)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(workloads))], workloads)
    ax1.set_ylabel("speedup vs plain greedy (ours)")
    ax1.set_title("Speedup by method and workload")
    ax1.legend(fontsize=7)
    for e in summary["rows"]:
        if e["workload"] == "all" and e.get("per_position_acceptance"):
            ax2.plot(range(1, len(e["per_position_acceptance"]) + 1), e["per_position_acceptance"], marker="o", label=e["row"])
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax2.set_title("Acceptance by draft position (all workloads)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(summary: dict, target: ReportTarget) -> dict[str, Path]:
    """The run's JSON, markdown and plot in ``target.out_dir``; its headline figures merged into
    ``target.headline`` (see :func:`builder.bench.config.headline_file`; None: not written)."""
    out_dir, label, headline = target.out_dir, target.label, target.headline
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"bench-{label}.json", "markdown": out_dir / f"bench-{label}.md"}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(summary))
    figures = device_keys(headline_figures(summary), summary.get("environment", {}).get("device", "cpu"))
    if figures and headline is not None:
        update_headline(figures, headline)
        paths["headline"] = headline
    png = plot(summary, out_dir / f"bench-{label}.png") if target.plot else None
    if png is not None:
        paths["plot"] = png
    return paths


def write_speed_report(summary: dict, target: ReportTarget) -> dict[str, Path]:
    """``bench speed``'s writer: :func:`write_report`, and with EAGLE rows (``--eagle``)
    ``eagle_chat_x_plain`` merged into the same headline file
    (:func:`builder.train.eagle_job.eagle_bench_headline`)."""
    paths = write_report(summary, target)
    if summary.get("config", {}).get("eagle") is not None and target.headline is not None:
        from builder.train.eagle_job import eagle_bench_headline

        eagle_bench_headline(summary, target.headline)
    return paths


def heldout_writer(split: str) -> ReportWriter[dict]:
    """The writer of a run on a held-out prompt set (``bench heldout``: ``split`` "heldout";
    ``bench mtbench``: "mtbench"): the run's files as :func:`write_report` writes them, and only
    :func:`heldout_figures` merged into the headline file (the bench prompts' keys stay theirs)."""
    def write(summary: dict, target: ReportTarget) -> dict[str, Path]:
        paths = write_report(summary, replace(target, headline=None))
        figures = heldout_figures(summary, split)
        if target.headline is not None and figures:
            update_headline(figures, target.headline)
            paths["headline"] = target.headline
        return paths

    return write
