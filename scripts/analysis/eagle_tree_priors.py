"""Where the EAGLE tree model's constants come from (``triton_backend/speculation/tree_plan.py``).

1. Sibling ranks (the tree model's ``SIBLING_PRIOR`` before the best-first table of
   ``eagle_best_first.py`` replaced it): on the TUNE prompts (never the check set), the target's greedy output,
   its features fed to the reference drafter teacher-forced; at every position, the rank of
   the target's next token among the drafter's choices (rank 0 = its first choice). Printed:
   acceptance of rank ``r`` and its ratio to rank 0's.
2. ``ROW_SLOPE``: a drafter tree step over ``w`` nodes against a one-node step (after a
   200-token context, median of many), on the row kernel, one thread.

    .venv/bin/python scripts/analysis/eagle_tree_priors.py --per-workload 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spec_ratio import EAGLE, _prompts  # (the same held-out prompt split)

from triton_backend.core.config import SamplingParams, SpeculationConfig
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.speculation.drafters.eagle_model import TreeStep
from triton_backend.core.config import SpeculationMode


def ranks(decoder, drafter, texts: list[str], max_tokens: int, top: int) -> list[int]:
    tok = decoder.tokenizer
    counts = [0] * (top + 1)  # the last: beyond the top
    for text in texts:
        templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = decoder.encode(templated)
        out = decoder.generate(ids, SamplingParams(max_tokens=max_tokens), SpeculationConfig(method="off")).token_ids
        seq = ids + out
        with torch.inference_mode():
            hidden = decoder.target.model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            kv = drafter.new_cache(1, len(seq))
            pred = drafter.net(hidden[None, :-1], drafter.embed[torch.tensor([seq[1:]])], torch.tensor([0]), kv)[0]
            logits = drafter._logits(pred)  # [n, vocab]: row j guesses token j + 2
        order = torch.argsort(logits, -1, descending=True)[:, :top]
        for j in range(len(ids) - 1, len(seq) - 2):  # the generated part only
            hit = (order[j] == seq[j + 2]).nonzero()
            counts[int(hit[0]) if len(hit) else top] += 1
    return counts


def slope(drafter, widths=(1, 2, 4, 8), repeats: int = 30) -> dict[int, float]:
    context = 200
    kv = drafter.new_cache(1, context + 16)
    hidden = drafter.embed.shape[1]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        drafter.net(torch.randn(1, context, hidden, generator=g), drafter.embed[torch.arange(context)[None]],
                    torch.tensor([0]), kv)
        out = {}
        for w in widths:
            visible = torch.zeros(1, w, context + w, dtype=torch.bool)
            visible[0, :, :context] = True
            visible[0, torch.arange(w), context + torch.arange(w)] = True
            step = TreeStep(torch.full((1, w), context), context + torch.arange(w)[None], visible)
            feats, toks = torch.randn(1, w, hidden, generator=g), torch.arange(w)[None]
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f = drafter.net(feats, drafter.embed[toks], torch.tensor([context]), kv, tree=step)
                drafter._small_logits(f[0])
                times.append(time.perf_counter() - t0)
            out[w] = statistics.median(times)
    return {w: t / out[1] for w, t in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-workload", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    decoder = build_decoder(DeploymentConfig(target=DEFAULT_REFERENCE, eagle=str(EAGLE), runtime=RuntimeConfig(num_threads=1)))
    drafter = decoder.drafters[SpeculationMode.EAGLE]
    texts = [t for ts in _prompts("tune", args.per_workload).values() for t in ts]
    counts = ranks(decoder, drafter, texts, args.max_tokens, args.top)
    total = sum(counts)
    rates = [c / total for c in counts[:-1]]
    print(f"{len(texts)} tune prompts, {total} positions; acceptance by rank: "
          + ", ".join(f"{r:.3f}" for r in rates) + f"; beyond top {args.top}: {counts[-1] / total:.3f}")
    print("relative to rank 0: " + ", ".join(f"{r / rates[0]:.2f}" for r in rates))
    costs = slope(drafter)
    print("tree step over w nodes / one node: " + ", ".join(f"w={w}: {c:.2f}" for w, c in costs.items()))


if __name__ == "__main__":
    main()
