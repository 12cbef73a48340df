"""Where the EAGLE tree model's table comes from (``BEST_FIRST`` and ``BEST_FIRST_DEPTH`` in
``triton_backend/speculation/tree_plan.py``).

On held-out prompts (``spec_ratio.py``'s split; the table is fit on ``tune``, checked on
``check``), the target's greedy output; at every position of it, teacher-forced (the target's
features up to there), the serving drafter grows a tree of ``--depth`` levels and ``--top-k``
children per node and keeps ``--nodes`` candidates. The target's continuation says which
nodes a greedy verification accepts. Printed: for the ``i``-th likeliest node (by the
drafter's score) among those at most ``--table-depth`` deep, how often it is on the accepted
path and its mean depth, and the expected tokens per pass of the best ``n`` nodes (one more
than the sum of the first ``n``). Example (the committed table)::

    .venv/bin/python scripts/analysis/eagle_best_first.py --set tune --per-workload 16
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from spec_ratio import _prompts  # (the same held-out prompt split)

from triton_backend.core.config import SamplingParams, SpeculationConfig, SpeculationMode
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.core.reference_model import DEFAULT_REFERENCE
from triton_backend.core.sampling import LogitsProcessor
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.speculation.drafters.eagle_tree import TreeShape

ROOT = Path(__file__).resolve().parents[2]


def _depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def records(decoder, texts: list[str], shape: TreeShape, max_tokens: int) -> list[tuple[list[int], list[float], set[int]]]:
    """Per response position: (node depths, node scores, accepted nodes) of the tree drafted there."""
    tok, drafter = decoder.tokenizer, decoder.drafters[SpeculationMode.EAGLE]
    greedy = LogitsProcessor()
    out = []
    for text in texts:
        templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = decoder.encode(templated)
        full = ids + decoder.generate(ids, SamplingParams(max_tokens=max_tokens), SpeculationConfig(method="off")).token_ids
        session = decoder.target.new_session()
        _, features = session.tree_features(full[:1], full[1:], list(range(-1, len(full) - 2)), drafter.capture_layers)
        session.release()
        eagle = drafter.new_session()
        first = len(ids) - 1
        eagle.observe(0, features[:first])
        for p in range(first, len(full) - 1):
            if p > first:
                eagle.observe(p - 1, features[p - 1:p])
            tree = eagle.propose_tree(full[:p + 1], shape, greedy, None)
            children: dict[int, list[int]] = {}
            for node, parent in enumerate(tree.parents or []):
                children.setdefault(parent, []).append(node)
            path, node = set(), -1
            for token in full[p + 1:]:
                node = next((c for c in children.get(node, []) if tree.tokens[c] == token), None)
                if node is None:
                    break
                path.add(node)
            out.append((_depths(tree.parents or []), list(tree.scores or []), path))
        eagle.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("tune", "check"), default="tune")
    parser.add_argument("--per-workload", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--eagle", type=Path, default=ROOT / "artifacts" / "smollm2-135m-eagle3")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--table-depth", type=int, default=4)
    parser.add_argument("--table-size", type=int, default=16)
    args = parser.parse_args()
    decoder = build_decoder(DeploymentConfig(target=DEFAULT_REFERENCE, eagle=str(args.eagle),
                                             runtime=RuntimeConfig(num_threads=1)))
    texts = [t for ts in _prompts(args.set, args.per_workload).values() for t in ts]
    recs = records(decoder, texts, TreeShape(args.depth, args.top_k, args.nodes), args.max_tokens)
    size = args.table_size
    hits, depth = [0] * size, [0] * size
    for depths, scores, path in recs:
        order = sorted((i for i in range(len(scores)) if depths[i] <= args.table_depth), key=lambda i: (-scores[i], i))
        for j, i in enumerate(order[:size]):
            hits[j] += i in path
            depth[j] += depths[i]
    n = max(1, len(recs))
    rates = [h / n for h in hits]
    print(f"{len(texts)} {args.set} prompts, {len(recs)} positions; trees of depth <= {args.table_depth}, top {args.top_k}")
    print("on the accepted path, best first: " + ", ".join(f"{r:.3f}" for r in rates))
    print("mean depth: " + ", ".join(f"{d / n:.1f}" for d in depth))
    print("tokens per pass of the best n: " + ", ".join(f"{n_}:{1 + c:.2f}" for n_, c in
                                                      zip(range(1, size + 1), itertools.accumulate(rates))))


if __name__ == "__main__":
    main()
