"""``specbuild bench ngram-replay RECORDS``: n-gram speculation replayed in pass-cost units.

Greedy speculation commits exactly plain decoding's tokens, and a chain draft is accepted up to
its first token that differs from them. So given a prompt and its plain greedy output, the real
n-gram session and controller (the gain rule and all) can be replayed round by round without
the model: each round costs the pass-cost table's figure for its tokens. The ratio
``tokens / cost`` (decode rounds only; the prefill round is paid by plain decoding too) is the
speed over plain decoding that a busy machine cannot disturb. ``--record`` records the
plain greedy outputs first (runs the model): the bench's own prompts (set ``bench``: the first
5 per workload of benchmarks/prompts.json, as ``specbuild bench`` runs them) and two held-out
sets (``tune``, ``check``) for tuning without touching the bench's prompts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from builder.bench.config import DEFAULT_PROMPTS
from triton_backend.core.config import DraftLengthConfig, NgramConfig, SpeculationConfig, SpeculationMode
from triton_backend.core.errors import ConfigError
from triton_backend.speculation.controller import controller_for
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.policy import PassCostModel, current_cost_model

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = ("bench", "tune", "check")


@dataclass(frozen=True)
class ReplayConfig:
    records: Path  # JSON list of {"set", "workload", "prompt": ids, "output": ids}
    sets: str = "bench"  # bench, tune, check or all
    k: tuple[int, ...] = (4, 8)
    max_tokens: int = 96
    costs: str | None = None  # a pass-cost JSON file, or "1:1,2:1.05,9:1.2" (one row); None: this machine's
    ngram_max: int | None = None
    trace: str | None = None  # a workload whose rounds are printed, drafted/accepted

    def __post_init__(self) -> None:
        if self.sets not in (*SETS, "all"):
            raise ConfigError(f"replay set {self.sets!r}: choose from {', '.join((*SETS, 'all'))}")
        if not self.k or min(self.k) < 1 or self.max_tokens < 1:
            raise ConfigError("replay draft lengths and max_tokens must be positive")


@dataclass(frozen=True)
class Replayed:
    tokens: int  # committed after the first (prefill) round
    cost: float  # their cost in one-row decode steps
    passes: int
    drafted: int
    accepted: int


def replay(prompt: Sequence[int], output: Sequence[int], spec: SpeculationConfig, cost_model: PassCostModel,
           max_tokens: int, trace: list[str] | None = None) -> Replayed:
    """One request's rounds; ``trace`` gets each as ``drafted/accepted`` (``-``: no n-gram matched)."""
    drafter = NgramDrafter(spec.ngram.min_n, spec.ngram.max_n)
    session = drafter.new_session()
    controller = controller_for(spec, SpeculationMode.NGRAM, drafter, session, cost_model)
    output = list(output[:max_tokens])
    tokens, done = list(prompt), 0
    cost, counted, passes, drafted, accepted = 0.0, 0, 0, 0, 0
    while done < len(output):
        k = max(0, min(controller.next_draft_length(), max_tokens - done - 1))
        matched = trace is not None and k > 0 and session.peek(tokens, k) is not None  # only the trace asks
        proposal = session.propose(tokens, k, None, None).tokens if k > 0 else []
        m = 0
        while m < len(proposal) and done + m < len(output) and proposal[m] == output[done + m]:
            m += 1
        block = output[done:done + m + 1]
        if passes > 0:  # the first round is the prefill: plain pays it too
            cost += cost_model.pass_cost([len(proposal) + 1])
            counted += len(block)
        passes += 1
        drafted, accepted = drafted + len(proposal), accepted + m
        controller.record(len(proposal), m)
        if trace is not None:
            trace.append(f"{len(proposal)}/{m}" if matched or k == 0 else "-")
        tokens += block
        done += len(block)
    return Replayed(counted, cost, passes, drafted, accepted)


def cost_model(costs: str | None) -> PassCostModel:
    if costs is None:
        return current_cost_model()
    if Path(costs).is_file():
        return PassCostModel.from_json(json.loads(Path(costs).read_text()))
    try:
        curve = {int(t): float(c) for t, c in (p.split(":") for p in costs.split(","))}
    except ValueError:
        raise ConfigError(f"pass costs {costs!r}: a pass-cost JSON file or tokens:cost pairs, e.g. 1:1,2:1.05")
    if 1 not in curve:
        raise ConfigError("pass costs need the one-token step (1:...)")
    return PassCostModel({1: curve}, "given")


def prompt_sets(per_workload: int = 5) -> dict[str, dict[str, list[str]]]:
    """set -> workload -> prompts: the bench's own and the two held-out sets."""
    bench = json.loads(DEFAULT_PROMPTS.read_text())["workloads"]
    copy = json.loads((DATA / "heldout_copy_prompts.json").read_text())
    lines = [line.strip() for line in (DATA / "heldout_prompts.txt").read_text().splitlines() if line.strip()]
    code = [line for line in lines if line.startswith("Write a Python") or "function" in line]
    chat = [line for line in lines if line not in code]
    held = {which: {"chat": chat[offset:offset + per_workload], "code": code[:per_workload],
                    "copy": copy[which][:per_workload]} for which, offset in (("tune", 0), ("check", per_workload))}
    return {"bench": {w: list(t)[:per_workload] for w, t in bench.items()}, **held}


def record(path: Path, max_tokens: int, target: str, threads: int = 1) -> int:
    """Plain greedy outputs of every prompt set into ``path``; returns the number recorded."""
    from triton_backend.core.config import SamplingParams
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.deployment.torch_deployment import build_decoder

    decoder = build_decoder(DeploymentConfig(target=target, runtime=RuntimeConfig(num_threads=threads)))
    records = []
    for which, workloads in prompt_sets().items():
        for workload, texts in workloads.items():
            for text in texts:
                templated = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                  add_generation_prompt=True, tokenize=False)
                ids = decoder.encode(templated)
                result = decoder.generate(ids, SamplingParams(max_tokens=max_tokens), SpeculationConfig(method="off"))
                records.append({"set": which, "workload": workload, "prompt": ids, "output": result.token_ids})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records))
    return len(records)


def load_records(config: ReplayConfig) -> list[dict[str, Any]]:
    try:
        records = json.loads(config.records.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read replay records {config.records}: {exc}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and {"set", "workload", "prompt", "output"} <= set(r)
                                                for r in records):
        raise ConfigError(f"{config.records}: a list of {{set, workload, prompt, output}} records expected")
    return [r for r in records if config.sets == "all" or r["set"] == config.sets]


def replay_table(config: ReplayConfig) -> list[str]:
    """Markdown lines: per draft length and workload, x plain in cost units, acceptance, tokens
    per pass; with ``trace``, that workload's rounds first."""
    model = cost_model(config.costs)
    records = load_records(config)
    lines = [f"pass costs ({model.source}): {dict(sorted(model.table[1].items()))}"]
    table = ["| workload | k | x plain (cost) | accept | tok/pass |", "|---|---|---|---|---|"]
    for k in config.k:
        ngram = NgramConfig() if config.ngram_max is None else NgramConfig(max_n=config.ngram_max)
        spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=k), ngram=ngram)
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0, 0, 0])
        for r in records:
            trace: list[str] | None = [] if r["workload"] == config.trace else None
            done = replay(r["prompt"], r["output"], spec, model, config.max_tokens, trace)
            if trace is not None:
                lines.append(f"k={k} {r['set']}/{r['workload']}: {' '.join(trace)}")
            for key in (r["workload"], "all"):
                s = sums[key]
                for i, v in enumerate((done.tokens, done.cost, done.passes, done.drafted, done.accepted,
                                       min(len(r["output"]), config.max_tokens))):
                    s[i] += v
        for key, (t, c, p, d, a, n) in sorted(sums.items()):
            table.append(f"| {key} | {k} | {t / c if c else float('nan'):.2f} | "
                         f"{a / d if d else float('nan'):.2f} | {n / p if p else float('nan'):.2f} |")
    return lines + table


__all__ = ["ReplayConfig", "Replayed", "cost_model", "prompt_sets", "record", "replay", "replay_table"]
