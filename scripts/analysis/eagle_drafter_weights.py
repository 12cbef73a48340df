"""The EAGLE-3 drafter's weight precision (``runtime.drafter_weights``) side by side: speed over
plain and tokens per target pass of always-drafted trees (depth 4, 11 nodes: no gain rule, so
only the drafter differs), per workload, every precision on each prompt in turn. Example::

    .venv/bin/python scripts/analysis/eagle_drafter_weights.py --set check --weights stored,fp8,int8
    .venv/bin/python scripts/analysis/eagle_drafter_weights.py --set bench  # benchmarks/prompts.json, 4 per workload
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path


import spec_ratio
from builder.bench.config import BenchPrompt
from builder.bench.rows import OursRow
from triton_backend.core.config import (DraftLengthConfig, EagleConfig, FallbackConfig, SpeculationConfig,
                                        SpeculationMode)
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.speculation.drafters.eagle3 import Eagle3Drafter


def _texts(which: str, per_workload: int) -> dict[str, list[str]]:
    if which == "bench":
        return spec_ratio._file_prompts(spec_ratio.ROOT / "benchmarks" / "prompts.json", per_workload)
    return spec_ratio._prompts(which, per_workload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("tune", "check", "bench"), default="check")
    parser.add_argument("--weights", default="stored,fp8,int8", help="comma-separated: stored or a weight precision")
    parser.add_argument("--per-workload", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--eagle", type=Path, default=spec_ratio.ROOT / "artifacts" / "smollm2-135m-eagle3")
    args = parser.parse_args()
    decoder = build_decoder(DeploymentConfig(target=DEFAULT_REFERENCE, runtime=RuntimeConfig(num_threads=1),
                                             eagle=str(args.eagle)))
    target, net = decoder.target, decoder.drafters[SpeculationMode.EAGLE].net
    drafters = {name: Eagle3Drafter(net, target, RuntimeConfig(drafter_weights=name).drafter_weights)
                for name in args.weights.split(",")}
    plain = OursRow("plain", decoder, SpeculationConfig(method=SpeculationMode.OFF))
    tree = OursRow("tree", decoder, SpeculationConfig(
        method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=4),
        fallback=FallbackConfig(enabled=False), eagle=EagleConfig(tree=True, max_tree_nodes=11)))
    prompts = []
    for workload, texts in _texts(args.set, args.per_workload).items():
        for i, text in enumerate(texts):
            templated = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False)
            prompts.append(BenchPrompt(workload, i, templated, decoder.encode(templated)))
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # seconds, tokens, passes
    for _ in range(args.repeats):
        for prompt in prompts:
            for name in ["plain", *drafters]:
                if name != "plain":
                    decoder.drafters[SpeculationMode.EAGLE] = drafters[name]
                passes, started = target.forward_calls, time.perf_counter()
                tokens = len((plain if name == "plain" else tree).run(prompt, args.max_tokens, False).tokens)
                for key in ((name, prompt.workload), (name, "all")):
                    cell = totals[key]
                    cell[0] += time.perf_counter() - started
                    cell[1] += tokens
                    cell[2] += target.forward_calls - passes
    workloads = [*dict.fromkeys(p.workload for p in prompts), "all"]
    print(f"{args.set} prompts, {args.per_workload} per workload x {args.repeats}, up to {args.max_tokens} tokens; "
          "always-drafted 4x11 trees: x plain / tokens per pass")
    print("| weights | " + " | ".join(workloads) + " |")
    print("|---" * (1 + len(workloads)) + "|")
    for name in drafters:
        cells = []
        for w in workloads:
            (s, n, p), (ps, pn, _) = totals[(name, w)], totals[("plain", w)]
            cells.append(f"{(n / s) / (pn / ps):.3f} / {n / p:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
