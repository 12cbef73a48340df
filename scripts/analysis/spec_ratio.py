"""Short, interleaved speed ratios of speculative rows against plain decoding on held-out prompts.

For tuning the gain rule without touching the bench's prompts: every row runs every prompt,
repeats interleaved in a shuffled order, in one process. Two figures per row and workload:

- ``x plain``: the wall-clock ratio (total plain seconds / total row seconds);
- ``x cost``: the same ratio in pass-cost units (plain: one unit per generated token after the
  first; a row: the measured pass-cost table's cost of each of its passes by the tokens it
  carried, plus an EAGLE drafter's steps, :class:`PassMeter`), which a busy machine does not
  disturb (other drafters' own cost is not counted).

Every row's greedy output is checked against plain's. Example::

    .venv/bin/python scripts/analysis/spec_ratio.py --set tune --rows plain,ngram:8,medusa --repeats 2
    .venv/bin/python scripts/analysis/spec_ratio.py --rows plain,eagle,eagle-params  # measured draft cost vs parameter ratio
    .venv/bin/python scripts/analysis/spec_ratio.py --set check --rows plain,ngram:8,eagle,auto:8  # auto beside its sources
    .venv/bin/python scripts/analysis/spec_ratio.py --set check --rows plain,eagle-chain,eagle-tree  # EAGLE chains vs trees
    .venv/bin/python scripts/analysis/spec_ratio.py --eagle artifacts/smollm2-135m-eagle3 --draft-cost 0.1 \
        --rows plain,eagle-chain:3,eagle-tree:12:3,eagle-tree-fixed:2  # the bench's EAGLE rows (chain k=3, tree
        # <= 12 nodes depth <= 3) beside eval-eagle's always-drafted depth-2 trees; eagle-tree:N:D:TOP_K
    .venv/bin/python scripts/analysis/spec_ratio.py --prompts benchmarks/repeated_prompts.json \
        --rows plain,ngram:8,ngram-x:8  # n-gram lookup with the cross-request index (fills as the row's requests run)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from builder.bench.config import BenchPrompt
from builder.bench.rows import OursRow, PeerRow, Row, RowResult
from triton_backend.core.config import (CrossRequestConfig, CrossRequestContinuation, DraftLengthConfig, EagleConfig,
                                        FallbackConfig, SpeculationConfig, SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.drafters.suffix_index import CrossRequestIndex, cross_request_index
from triton_backend.speculation.cost_model import current_cost_model
from triton_backend.speculation.tree_plan import ROW_SLOPE

ROOT = Path(__file__).resolve().parents[2]
COPY_PROMPTS = ROOT / "builder" / "data" / "heldout_copy_prompts.json"
CODE_PROMPTS = ROOT / "builder" / "data" / "heldout_code_prompts.json"
HELDOUT = ROOT / "builder" / "data" / "heldout_prompts.txt"
MEDUSA = ROOT / "artifacts" / "smollm2-135m-medusa" / "heads.safetensors"
EAGLE = ROOT / "artifacts" / "smollm2-135m-eagle"


@dataclass
class DraftCostRow(OursRow):
    """A row whose drafter is priced at ``draft_cost`` target steps per drafted token (its
    measured cost, or the parameter ratio the gain rule used before) while the row runs."""

    draft_cost: float = 0.0

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult:
        drafter = self.decoder.drafters[self.speculation.method]
        measured, drafter.relative_cost = drafter.relative_cost, self.draft_cost
        try:
            return super().run(prompt, max_tokens, ignore_eos)
        finally:
            drafter.relative_cost = measured


@dataclass
class CrossRequestRow(OursRow):
    """n-gram lookup with a cross-request index of its own, filled by this row's earlier
    requests (the prompts run one after another), swapped in while the row runs."""

    index: CrossRequestIndex | None = None

    def run(self, prompt: BenchPrompt, max_tokens: int, ignore_eos: bool) -> RowResult:
        drafters = self.decoder.drafters
        plain = drafters[SpeculationMode.NGRAM]
        drafters[SpeculationMode.NGRAM] = NgramDrafter(plain.min_n, plain.max_n, self.index)
        try:
            return super().run(prompt, max_tokens, ignore_eos)
        finally:
            drafters[SpeculationMode.NGRAM] = plain
            if self.index is not None:
                self.index.flush()  # indexed before the next request, as on a server between two requests


def _file_prompts(path: Path, per_workload: int) -> dict[str, list[str]]:
    data = json.loads(path.read_text())
    return {workload: texts[:per_workload] for workload, texts in data["workloads"].items()}


def _prompts(which: str, per_workload: int) -> dict[str, list[str]]:
    """The held-out ``tune`` or ``check`` split. Chat: the non-code lines of ``heldout_prompts.txt``
    (``check`` after ``tune``'s); copy: ``heldout_copy_prompts.json``. Code: ``tune`` has the one
    code line of ``heldout_prompts.txt`` (what the tree model's tables were measured on),
    ``check`` the prompts of ``heldout_code_prompts.json`` (until 2026-11-26 it reused ``tune``'s)."""
    copy = json.loads(COPY_PROMPTS.read_text())
    lines = [line.strip() for line in HELDOUT.read_text().splitlines() if line.strip()]
    code = [line for line in lines if line.startswith("Write a Python") or "function" in line]
    chat = [line for line in lines if line not in code]
    offset = 0 if which == "tune" else per_workload
    if which != "tune":
        code = json.loads(CODE_PROMPTS.read_text())["check"]
    return {"chat": chat[offset:offset + per_workload], "code": code[:per_workload],
            "copy": copy[which][:per_workload]}


def _rows(spec: str, decoder, peer_model) -> list[Row]:
    rows: list[Row] = []
    for item in spec.split(","):
        name, _, arg = item.partition(":")
        if name == "plain":
            rows.append(OursRow("plain", decoder, SpeculationConfig(method=SpeculationMode.OFF)))
        elif name == "ngram":
            rows.append(OursRow(f"ngram k={arg}", decoder, SpeculationConfig(method=SpeculationMode.NGRAM,
                                                                             draft_length=DraftLengthConfig(num_draft_tokens=int(arg)))))
        elif name in ("ngram-x", "ngram-x-recent", "auto-x"):  # with the cross-request index (frequent / recent)
            config = CrossRequestConfig(enabled=True, continuation=CrossRequestContinuation.RECENT
                                        if name.endswith("recent") else CrossRequestContinuation.FREQUENT)
            method = SpeculationMode.AUTO if name == "auto-x" else SpeculationMode.NGRAM
            rows.append(CrossRequestRow(f"{name} k={arg}", decoder, SpeculationConfig(
                method=method, draft_length=DraftLengthConfig(num_draft_tokens=int(arg))),
                index=cross_request_index(config)))
        elif name == "medusa":
            rows.append(OursRow("medusa", decoder, SpeculationConfig(method=SpeculationMode.MEDUSA)))
        elif name in ("eagle", "eagle-params"):  # the measured draft cost (or eagle:COST); the parameter ratio
            drafter = decoder.drafters[SpeculationMode.EAGLE]
            cost = (float(arg) if arg else drafter.relative_cost) if name == "eagle" else _parameter_ratio(drafter, decoder.target)
            rows.append(DraftCostRow(f"{name} ({cost:.3f})", decoder, SpeculationConfig(method=SpeculationMode.EAGLE),
                                     draft_cost=cost))
        elif name == "eagle-chain":  # chains of at most ``arg`` (default 4), gain-sized
            k = int(arg or 4)
            rows.append(OursRow(f"eagle-chain k<={k}", decoder, SpeculationConfig(
                method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=k),
                eagle=EagleConfig(tree=False))))
        elif name == "eagle-tree":  # gain-sized trees: ``nodes[:depth[:top_k]]`` (default 12:4:4)
            given = [int(x) for x in arg.split(":")] if arg else []
            n, depth, top_k = (given + [12, 4, 4][len(given):])[:3]
            rows.append(OursRow(f"eagle-tree n<={n} d<={depth} top{top_k}", decoder, SpeculationConfig(
                method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=depth),
                eagle=EagleConfig(tree=True, max_tree_nodes=n, tree_top_k=top_k))))
        elif name in ("eagle-chain-fixed", "eagle-tree-fixed"):  # always draft: chains of k, trees of depth k
            k, _, n = arg.partition(":")  # eagle-tree-fixed:K[:N] (N nodes, default 12)
            k = int(k or 4)
            rows.append(OursRow(f"{name} k={k}" + (f" n={n}" if n else ""), decoder, SpeculationConfig(
                method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=k),
                fallback=FallbackConfig(enabled=False),
                eagle=EagleConfig(tree=name == "eagle-tree-fixed", max_tree_nodes=int(n or 12)))))
        elif name == "auto":  # n-gram match or EAGLE, chosen per round
            rows.append(OursRow(f"auto k={arg or 8}", decoder, SpeculationConfig(
                method=SpeculationMode.AUTO, draft_length=DraftLengthConfig(num_draft_tokens=int(arg or 8)))))
        elif name == "hf-lookup":
            rows.append(PeerRow("hf prompt-lookup", peer_model, {"prompt_lookup_num_tokens": 10}, {}))
        else:
            raise SystemExit(f"unknown row {item!r}")
    return rows


def _parameter_ratio(drafter, target) -> float:
    return (sum(p.numel() for p in drafter.net.parameters()) + drafter.head.numel()) / max(1, target.num_parameters())


class PassMeter:
    """A run's cost in pass-cost units, whatever its drafts' shape: every target pass after the
    first (the prompt's) by the new tokens it carried (the measured table), every EAGLE drafter
    step by the nodes it ran (the tree model's cost: the measured cost per drafted token, times
    ``1 + ROW_SLOPE * (nodes - 1)``). Other drafters' own cost is not counted."""

    def __init__(self, decoder) -> None:
        self.sizes: list[int] = []
        self.draft = 0.0
        engine, drafter = decoder.target, decoder.drafters.get(SpeculationMode.EAGLE)
        self.engine = engine
        forward = engine.forward

        def counted(rows):
            self.sizes.append(sum(len(r.tokens) for r in rows))
            return forward(rows)

        engine.forward = counted
        if drafter is not None:  # the drafter's feed and tree/chain steps (whatever runs them)
            for name in ("_feed_net", "_step_net"):
                setattr(drafter, name, self._counted(drafter, getattr(drafter, name)))

    def _counted(self, drafter, step):
        def drafted(features, *args, **kwargs):  # a tree step's placement by keyword or 6th argument
            tree = kwargs.get("tree", args[4] if len(args) > 4 else None)
            width = int(features.shape[1]) if tree is not None else 1
            self.draft += drafter.relative_cost * (1.0 + ROW_SLOPE * (width - 1))
            return step(features, *args, **kwargs)

        return drafted

    def reset(self) -> None:
        self.sizes, self.draft = [], 0.0

    def units(self) -> float:
        model = current_cost_model(self.engine)
        return max(sum(model.pass_cost([n]) for n in self.sizes[1:]) + self.draft, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("tune", "check"), default="tune")
    parser.add_argument("--rows", default="plain,ngram:4,ngram:8,medusa")
    parser.add_argument("--workloads", default=None, help="default: chat,code,copy (or every workload of --prompts)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="a prompt file ({'workloads': {name: [prompt, ...]}}) instead of --set; its prompts "
                             "run interleaved across workloads, in file order")
    parser.add_argument("--per-workload", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--costs", default=None,
                        help="install this one-row pass-cost table (1:1,2:1.75,...) instead of the measured one")
    parser.add_argument("--eagle", type=Path, default=EAGLE, help="the EAGLE drafter (file or folder)")
    parser.add_argument("--draft-cost", type=float, default=None,
                        help="price the EAGLE drafter at this many target steps per drafted token (default: measured)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    choices = None
    fields = {"target": DEFAULT_REFERENCE, "runtime": RuntimeConfig(num_threads=1)}
    if "medusa" in args.rows:
        from triton_backend.speculation.drafters.medusa_model import load_medusa

        choices = tuple(load_medusa(str(MEDUSA)).heads.info.medusa_choices[:7])  # as the bench cuts it
        fields.update(medusa=str(MEDUSA), medusa_choices=choices)
    if "eagle" in args.rows or "auto" in args.rows:
        fields.update(eagle=str(args.eagle))
    decoder = build_decoder(DeploymentConfig(**fields))
    if args.draft_cost is not None and SpeculationMode.EAGLE in decoder.drafters:  # a busy machine's measurement varies
        decoder.drafters[SpeculationMode.EAGLE].relative_cost = args.draft_cost
    if args.costs is not None:  # a busy machine's measurement may fall back to the default table
        from triton_backend.speculation.cost_model import MEASURED, PassCostModel

        table = {int(t): float(c) for t, c in (p.split(":") for p in args.costs.split(","))}
        MEASURED.record(decoder.target, PassCostModel({1: table}, "given"))
    peer = None
    if "hf-lookup" in args.rows:
        from triton_backend.engines.torch.model_loading import load_model

        peer = load_model(DEFAULT_REFERENCE, RuntimeConfig(num_threads=1)).eval()
    rows = _rows(args.rows, decoder, peer)
    tok = decoder.tokenizer
    prompts: list[BenchPrompt] = []
    sets = _prompts(args.set, args.per_workload) if args.prompts is None else _file_prompts(args.prompts, args.per_workload)
    wanted = args.workloads.split(",") if args.workloads else list(sets)
    sets = {w: texts for w, texts in sets.items() if w in wanted}
    for i in range(max(map(len, sets.values()))):  # interleaved: one of each workload in turn
        for workload, texts in sets.items():
            if i < len(texts):
                templated = tok.apply_chat_template([{"role": "user", "content": texts[i]}], add_generation_prompt=True,
                                                    tokenize=False)
                prompts.append(BenchPrompt(workload, i, templated, decoder.encode(templated)))
    for row in rows:
        row.run(prompts[0], 8, False)
        if isinstance(row, CrossRequestRow) and row.index is not None:
            row.index.clear()  # the measured requests start from an empty index
    meter = PassMeter(decoder)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    units: dict[tuple[str, str], float] = defaultdict(float)
    drafted: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    outputs: dict[tuple[str, str, int], list[int]] = {}
    order = random.Random(0)
    started = time.perf_counter()
    for rep in range(args.repeats):
        for prompt in prompts:
            shuffled = list(rows)
            order.shuffle(shuffled)
            for row in shuffled:
                meter.reset()
                result = row.run(prompt, args.max_tokens, False)
                key = (row.name, prompt.workload)
                seconds[key] += result.latency_s
                tokens[key] += len(result.tokens)
                if result.stats is not None:
                    units[key] += meter.units()
                    d = drafted[key]
                    d[0] += result.stats["drafted_tokens"]
                    d[1] += result.stats["accepted_tokens"]
                    d[2] += result.stats["target_passes"]
                outputs[(row.name, prompt.workload, prompt.index)] = result.tokens
    # exactness: every row's greedy tokens against plain's
    mismatches = [f"{name} {w}#{i}" for (name, w, i), out in outputs.items()
                  if ("plain", w, i) in outputs and out != outputs[("plain", w, i)] and not name.startswith("hf")]
    cost = current_cost_model(decoder.target)
    print(f"cost table: {cost.source} {dict(cost.table[1])}")
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {time.perf_counter() - started:.0f} s")
    print("| workload | row | x plain | x cost | accept | tok/pass |")
    print("|---|---|---|---|---|---|")
    for workload in wanted + ["all"]:
        for row in rows:
            keys = [(row.name, w) for w in wanted] if workload == "all" else [(row.name, workload)]
            pkeys = [("plain", k[1]) for k in keys]
            t, s = sum(tokens[k] for k in keys), sum(seconds[k] for k in keys)
            pt, ps = sum(tokens[k] for k in pkeys), sum(seconds[k] for k in pkeys)
            if not s or not ps:
                continue
            x = (t / s) / (pt / ps)
            u = sum(units[k] for k in keys)
            xc = (t / u) / 1.0 if u else float("nan")
            d = [sum(drafted[k][i] for k in keys) for i in range(3)]
            acc = d[1] / d[0] if d[0] else float("nan")
            per_pass = t / d[2] if d[2] else float("nan")
            print(f"| {workload} | {row.name} | {x:.2f} | {xc:.2f} | {acc:.2f} | {per_pass:.2f} |")
    for row in rows:
        if isinstance(row, CrossRequestRow) and row.index is not None:
            st = row.index.stats
            print(f"{row.name}: index {row.index.size} tokens; rounds drafted from it {st['rounds']}, "
                  f"acceptance {st['accepted'] / max(1, st['drafted']):.2f} ({st['accepted']}/{st['drafted']})")
    if mismatches:
        print("MISMATCHES:", mismatches)


if __name__ == "__main__":
    main()
