"""Replays n-gram speculation over recorded greedy outputs, in pass-cost units (no model).

Greedy speculation commits exactly plain decoding's tokens, and a chain draft is accepted up
to its first token that differs from them. So given a prompt and its plain greedy output, the
real n-gram session and controller (the gain rule and all) can be replayed round by round
without the model: each round costs the pass-cost table's figure for its tokens. The ratio
``tokens / cost`` (decode passes only, the prefill round left out) is the speed over plain
decoding a busy machine cannot disturb. Record outputs with ``--record`` first (slow: runs the
model), then replay as often as needed (fast)::

    .venv/bin/python scripts/analysis/ngram_replay.py --record /tmp/plain.json --max-tokens 160
    .venv/bin/python scripts/analysis/ngram_replay.py /tmp/plain.json --k 4,8,16 --set tune
    .venv/bin/python scripts/analysis/ngram_replay.py /tmp/plain.json --k 8 --set bench --trace copy  # round by round

``--record`` stores the held-out sets (``tune``, ``check``) and the bench's own prompts
(``bench``: benchmarks/prompts.json, the first 5 per workload as ``specbuild bench`` runs them).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from triton_backend.core.config import DraftLengthConfig, NgramConfig, SpeculationConfig, SpeculationMode
from triton_backend.speculation.controller import controller_for
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.speculation.policy import PassCostModel, current_cost_model

ROOT = Path(__file__).resolve().parents[2]


def replay(prompt: Sequence[int], output: Sequence[int], spec: SpeculationConfig, cost_model: PassCostModel,
           max_tokens: int, trace: list[str] | None = None) -> tuple[int, float, int, int, int]:
    """(tokens after the first round, their cost in steps, passes, drafted, accepted) of one
    request; ``trace``: gets each round as ``drafted/accepted`` (``-``: no n-gram matched)."""
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
    return counted, cost, passes, drafted, accepted


def _record(path: Path, max_tokens: int) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spec_ratio import _prompts  # noqa: E402 (the held-out prompt sets)

    from triton_backend.core.config import RuntimeConfig, SamplingParams
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.deployment.config import DeploymentConfig
    from triton_backend.core.reference_model import DEFAULT_REFERENCE

    decoder = build_decoder(DeploymentConfig(target=DEFAULT_REFERENCE, runtime=RuntimeConfig(num_threads=1)))
    bench = json.loads((ROOT / "benchmarks" / "prompts.json").read_text())["workloads"]
    records = []
    for which in ("tune", "check", "bench"):
        for workload, texts in (_prompts(which, 5) if which != "bench" else {w: t[:5] for w, t in bench.items()}).items():
            for text in texts:
                templated = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                  add_generation_prompt=True, tokenize=False)
                ids = decoder.encode(templated)
                result = decoder.generate(ids, SamplingParams(max_tokens=max_tokens), SpeculationConfig(method="off"))
                records.append({"set": which, "workload": workload, "prompt": ids, "output": result.token_ids})
    path.write_text(json.dumps(records))


def _table(text: str | None) -> PassCostModel:
    if text is None:
        return current_cost_model()
    if Path(text).is_file():
        return PassCostModel.from_json(json.loads(Path(text).read_text()))
    return PassCostModel({1: {int(t): float(c) for t, c in (p.split(":") for p in text.split(","))}}, "given")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--record", action="store_true", help="record plain greedy outputs into RECORDS (runs the model)")
    parser.add_argument("--set", default="tune", help="tune, check, bench or all")
    parser.add_argument("--k", default="4,8")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--costs", default=None, help="a pass-cost JSON file, or 1:1,2:1.75,8:1.78,9:3 (one row)")
    parser.add_argument("--ngram-max", type=int, default=None)
    parser.add_argument("--trace", default=None, help="print this workload's rounds, drafted/accepted ('-': no match)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.record:
        _record(args.records, args.max_tokens)
        return
    model = _table(args.costs)
    records = [r for r in json.loads(args.records.read_text()) if args.set == "all" or r["set"] == args.set]
    print(f"pass costs ({model.source}): {dict(sorted(model.table[1].items()))}")
    print("| workload | k | x plain (cost) | accept | tok/pass |")
    print("|---|---|---|---|---|")
    for k in (int(x) for x in args.k.split(",")):
        ngram = NgramConfig() if args.ngram_max is None else NgramConfig(max_n=args.ngram_max)
        spec = SpeculationConfig(method="ngram", draft_length=DraftLengthConfig(num_draft_tokens=k), ngram=ngram)
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0, 0, 0])
        for r in records:
            trace: list[str] | None = [] if r["workload"] == args.trace else None
            t, c, p, d, a = replay(r["prompt"], r["output"], spec, model, args.max_tokens, trace)
            if trace is not None:
                print(f"k={k} {r['set']}/{r['workload']}: {' '.join(trace)}")
            for key in (r["workload"], "all"):
                s = sums[key]
                s[0] += t
                s[1] += c
                s[2] += p
                s[3] += d
                s[4] += a
                s[5] += min(len(r["output"]), args.max_tokens)
        for key, (t, c, p, d, a, n) in sorted(sums.items()):
            print(f"| {key} | {k} | {t / c:.2f} | {a / d if d else float('nan'):.2f} | {n / p:.2f} |")


if __name__ == "__main__":
    main()
