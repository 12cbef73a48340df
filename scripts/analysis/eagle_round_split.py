"""Where an EAGLE round's time goes, in ms per target pass, beside plain decoding.

Wall clock of held-out chat and code prompts (``spec_ratio.py``'s ``check`` split) split into
the target's passes (``target``: the engine's forward; for EAGLE rows the LM head runs in
``accept``), the drafter's proposal (``propose``) and within it its feed of the committed
pairs (``feed``), its tree or chain steps (``steps``) and its head (``logits``), and the
verification (``accept``: the target's LM head over the drafted nodes and the walk). Rows:
``plain``, ``gain`` (the gain-sized trees, the bench's tree row), ``fixed3x12``, ``fixed4x7``,
``fixed4x11`` and ``fixed4x16`` (always-drafted trees of DEPTH x NODES). Example::

    .venv/bin/python scripts/analysis/eagle_round_split.py --rows plain,gain --per-workload 6
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
import triton_backend.speculation.eagle_round as eagle_round

ROWS = {"plain": SpeculationConfig(method=SpeculationMode.OFF), "gain": SpeculationConfig(method=SpeculationMode.EAGLE)}
for _name, (_depth, _nodes) in {"fixed3x12": (3, 12), "fixed4x7": (4, 7), "fixed4x11": (4, 11), "fixed4x16": (4, 16)}.items():
    ROWS[_name] = SpeculationConfig(method=SpeculationMode.EAGLE, draft_length=DraftLengthConfig(num_draft_tokens=_depth),
                                    fallback=FallbackConfig(enabled=False), eagle=EagleConfig(tree=True, max_tree_nodes=_nodes))
PARTS = ("target", "propose", "feed", "steps", "logits", "accept")


def _timed(owner, name: str, key: str, seconds: dict[str, float]) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - started
            seconds[key + " calls"] += 1

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="plain,gain,fixed3x12,fixed4x16")
    parser.add_argument("--per-workload", type=int, default=4)
    parser.add_argument("--eagle", type=Path, default=spec_ratio.ROOT / "artifacts" / "smollm2-135m-eagle3")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    decoder = build_decoder(DeploymentConfig(target=DEFAULT_REFERENCE, runtime=RuntimeConfig(num_threads=1),
                                             eagle=str(args.eagle)))
    prompts = []
    for workload, texts in spec_ratio._prompts("check", args.per_workload).items():
        if workload in ("chat", "code"):
            for i, text in enumerate(texts):
                templated = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                  add_generation_prompt=True, tokenize=False)
                prompts.append(BenchPrompt(workload, i, templated, decoder.encode(templated)))
    seconds: dict[str, float] = defaultdict(float)
    drafter = decoder.drafters[SpeculationMode.EAGLE]
    for owner, name, key in ((decoder.target, "forward", "target"), (drafter, "propose_trees", "propose"),
                             (drafter, "_feed_net", "feed"), (drafter, "_step_net", "steps"),
                             (drafter, "_small_logits", "logits"), (eagle_round, "accept_eagle", "accept")):
        _timed(owner, name, key, seconds)
    print(f"{len(prompts)} prompts (chat and code, check split), up to {args.max_tokens} tokens; ms per target pass")
    print("| row | tok/pass | ms/pass | " + " | ".join(PARTS) + " |")
    print("|---" * (3 + len(PARTS)) + "|")
    for name in args.rows.split(","):
        row = OursRow(name, decoder, ROWS[name])
        row.run(prompts[0], 8, False)  # warm
        seconds.clear()
        tokens, started = 0, time.perf_counter()
        for prompt in prompts:
            tokens += len(row.run(prompt, args.max_tokens, False).tokens)
        wall, passes = time.perf_counter() - started, max(1.0, seconds["target calls"])
        parts = " | ".join(f"{1e3 * seconds[p] / passes:.2f}" for p in PARTS)
        print(f"| {name} | {tokens / passes:.2f} | {1e3 * wall / passes:.2f} | {parts} |")


if __name__ == "__main__":
    main()
