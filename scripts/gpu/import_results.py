"""Take a GPU run's returned files into the repository (see scripts/gpu/README.md).

RESULTS holds what ``device_run.sh`` sent back, unpacked: ``engine/`` (the pass-cost files and
``headline-gpu.json`` that ``specbuild bench --device cuda`` wrote) and ``scale/`` (the drafter
run: ``drafter/`` with ``gpu_training_report.json``, ``gpu-corpus.npz``). This writes, with the
GPU machine's paths replaced by names:

- ``benchmarks/results/pass-cost-<label>.{json,md}`` (the bench's own files);
- ``benchmarks/results/<label>-drafter.json`` (the drafter run's report);
- ``benchmarks/results/<label>.md`` (both, as one page);
- the ``gpu_*`` keys into ``benchmarks/results/headline.json``: those the bench wrote, and
  ``gpu_eagle_data_positions_per_s`` (generation rate of the drafter run);
- with ``--adopt-drafter DIR``: the drafter's config and weights into DIR with its report as
  ``training_report.json`` and ``--heldout-acceptance`` (the CPU measure on the served weights)
  in its config.

Usage: python scripts/gpu/import_results.py RESULTS [--label gpu-h200] [--adopt-drafter DIR --heldout-acceptance A,B,C]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from builder.headline import update_headline

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# the GPU figures the README's headline table shows (builder/bench/docs_render.py); the bench's
# other gpu_* figures stay in its own files
HEADLINE_KEYS = ("gpu_engine_plain_decode_x_hf", "gpu_eagle_data_positions_per_s", "gpu_auto_all_x_plain",
                 "gpu_eagle_tokens_per_pass")


def _portable(value, target_name: str):
    """``value`` with the GPU machine's folders replaced by what they held."""
    if isinstance(value, dict):
        return {k: _portable(v, target_name) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v, target_name) for v in value]
    if isinstance(value, str) and value.startswith("/tmp/"):
        if "/target/" in value:
            return f"{target_name} (bfloat16-rounded weights)"
        return "<GPU machine>/" + Path(value).name
    return value


def _pass_cost(engine: Path, label: str, target_name: str) -> dict:
    src = engine / f"pass-cost-{label}.json"
    result = _portable(json.loads(src.read_text()), target_name)
    (RESULTS / src.name).write_text(json.dumps(result, indent=2) + "\n")
    md = (engine / f"pass-cost-{label}.md").read_text()
    for line in md.splitlines():
        if "/tmp/target/" in line:
            md = md.replace(line, line.replace(line[line.index("/tmp/target/"):].split(",")[0], target_name))
    (RESULTS / f"pass-cost-{label}.md").write_text(md)
    return result


def _page(label: str, device: str, pass_cost: dict, drafter: dict) -> str:
    rows = {(r["rows"], r["tokens"]): r for r in pass_cost["rows"]}
    gen, feat, train = drafter["generation"], drafter["features"], drafter["training"]
    curve = ", ".join(f"{p['acceptance'][0]:.3f} ({p['positions'] / 1e6:.1f}M)" for p in train["curve"])
    one = rows[(1, 1)]
    lines = [
        f"# GPU run ({device}), written by scripts/gpu/import_results.py", "",
        "The reference target's weights reach the GPU machine rounded to bfloat16 (64 MiB per call; "
        "scripts/gpu/README.md), run there as float32 values. Everything below runs those weights.", "",
        "## Slot engine on CUDA (`specbuild bench pass-cost --device cuda`)", "",
        f"One row, one token: ours {one['ours_ms']:.1f} ms, Hugging Face {one['hf_ms']:.1f} ms. "
        "Pass cost in one-row steps of the same engine:", "",
        "| rows | tokens per row | ours ms | ours x step | HF x step |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['tokens']} | {r['ours_ms']:.1f} | {r['ours_x_step']:.2f} | {r['hf_x_step']:.2f} |"
              for r in pass_cost["rows"]]
    lines += [
        "", "## Drafter data and training (`scripts/gpu/eagle3_at_scale.py`)", "",
        f"- Generation: {gen['sequences']} responses ({gen['positions']} positions) in {gen['seconds']:.0f} s, "
        f"{gen['positions_per_s']:.0f} positions/s, batches of {gen['rows']} rows, up to {gen['max_new_tokens']} new "
        f"tokens ({gen['greedy_passes']} greedy and {gen['sampled_passes']} sampled pass(es) over {gen['prompts']} "
        f"prompts at temperature {gen['temperature']}).",
        f"- Features: {feat['train_sequences']} sequences ({feat['train_positions']} training positions, "
        f"{feat['cpu_corpus_sequences']} of the sequences from the committed token corpus) prefilled in "
        f"{feat['seconds']:.0f} s.",
        f"- Training: {train['steps']} steps ({train['positions'] / 1e6:.1f}M positions) in {train['seconds']:.0f} s, "
        f"batch {train['settings']['batch_size']}, lr {train['settings']['lr']}, warm start from "
        f"{train['settings']['init_from']}. Held-out chain acceptance at depth 1 (positions trained): {curve}; "
        f"final by depth: {', '.join(f'{a:.3f}' for a in train['acceptance'])} (this device's forward; the CPU "
        "measure on the served weights is in the drafter's README).",
    ]
    return "\n".join(lines) + "\n"


def _bench(engine: Path, label: str, target_name: str) -> dict | None:
    src = engine / f"bench-{label}.json"
    if not src.is_file():
        return None
    summary = _portable(json.loads(src.read_text()), target_name)
    (RESULTS / src.name).write_text(json.dumps(summary, indent=2) + "\n")
    md = (engine / f"bench-{label}.md").read_text()
    (RESULTS / f"bench-{label}.md").write_text(md)
    if (engine / f"bench-{label}.png").is_file():
        shutil.copy(engine / f"bench-{label}.png", RESULTS / f"bench-{label}.png")
    return summary


def _two(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bench_lines(summary: dict) -> list[str]:
    cfg = summary["config"]
    rows = [r for r in summary["rows"] if r["workload"] == "all"]
    same = all(r.get("identical_to_plain") for r in summary["rows"] if r.get("identical_to_plain") is not None)
    lines = ["", "## Speculative decoding on CUDA (`specbuild bench --device cuda`)", "",
             f"{cfg['prompts_per_workload']} prompt(s) per workload (chat, code, copy), up to {cfg['max_tokens']} "
             f"tokens, {cfg['repeats']} repeat(s): a check that every row runs on the device and equals plain "
             f"decoding there ({'every row identical to plain' if same else 'NOT every row identical to plain'}), "
             "with first speed figures; the full table is in the bench's files beside this page.", "",
             "| row (all workloads) | tok/s | x plain | tokens per target pass | identical |", "|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f} | "
              f"{_two(r.get('tokens_per_target_pass'))} | {'yes' if r.get('identical_to_plain') else 'no'} |"
              for r in rows]
    return lines


def _adopt(scale: Path, dest: Path, report: dict, acceptance: list[float]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(scale / "drafter" / "model.safetensors", dest / "model.safetensors")
    config = json.loads((scale / "drafter" / "config.json").read_text())
    config["specbuild"]["heldout_chain_acceptance"] = [round(a, 4) for a in acceptance]
    config["specbuild"]["init_from"] = report["training"]["settings"]["init_from"]
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    report = dict(report, cpu_heldout_chain_acceptance=acceptance)
    (dest / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path)
    p.add_argument("--label", default="gpu-h200")
    p.add_argument("--target-name", default="smollm2-135m-instruct")
    p.add_argument("--adopt-drafter", type=Path, default=None)
    p.add_argument("--heldout-acceptance", default="", help="the CPU held-out chain acceptance by depth, A,B,C")
    args = p.parse_args()
    pass_cost = _pass_cost(args.results / "engine", args.label, args.target_name)
    drafter = _portable(json.loads((args.results / "scale" / "drafter" / "gpu_training_report.json").read_text()),
                        args.target_name)
    (RESULTS / f"{args.label}-drafter.json").write_text(json.dumps(drafter, indent=2) + "\n")
    page = _page(args.label, drafter["device"], pass_cost, drafter)
    bench = _bench(args.results / "engine", args.label, args.target_name)
    if bench is not None:
        page += "\n".join(_bench_lines(bench)) + "\n"
    (RESULTS / f"{args.label}.md").write_text(page)
    figures = json.loads((args.results / "engine" / "headline-gpu.json").read_text())
    figures["gpu_eagle_data_positions_per_s"] = round(drafter["generation"]["positions_per_s"], 1)
    figures = {k: v for k, v in figures.items() if k in HEADLINE_KEYS}
    update_headline(figures, RESULTS / "headline.json")
    if args.adopt_drafter:
        acceptance = [float(a) for a in args.heldout_acceptance.split(",") if a]
        if not acceptance:
            raise SystemExit("--adopt-drafter needs --heldout-acceptance (the CPU measure on the served weights)")
        _adopt(args.results / "scale", args.adopt_drafter, drafter, acceptance)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
