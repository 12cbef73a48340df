"""How much of what the target writes a draft vocabulary of a given size covers: the ceiling on an
EAGLE-3 drafter's acceptance per position (a token outside the draft vocabulary is never drafted).
The vocabulary is the ``size`` tokens the target wrote most in the training corpora (responses
only, as ``train-eagle3`` picks it); coverage is measured on those corpora and, apart, on
held-out corpora (greedy answers to prompts never trained on), beside the shipped drafter's own
vocabulary (``--eagle``).

    python scripts/analysis/draft_vocab_coverage.py --train artifacts/eagle-corpus/users,artifacts/eagle-corpus/sharegpt \\
        --eval artifacts/eagle-corpus/held --eagle artifacts/smollm2-135m-eagle3 --sizes 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def response_counts(folders: list[str], vocab: int) -> np.ndarray:
    from builder.train.eagle_corpus import iter_corpus

    counts = np.zeros(vocab, dtype=np.int64)
    for folder in folders:
        for tokens, prompt_length, _ in iter_corpus(folder):
            counts += np.bincount(tokens[prompt_length:], minlength=vocab)[:vocab]
    return counts


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True, help="training corpus folders, comma-separated")
    ap.add_argument("--eval", default="", help="held-out corpus folders, comma-separated")
    ap.add_argument("--eagle", default=None, help="an EAGLE-3 drafter folder: its draft vocabulary's coverage too")
    ap.add_argument("--sizes", default="4096,8192,16384,32768")
    ap.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    train = response_counts(args.train.split(","), args.vocab)
    held = response_counts(args.eval.split(","), args.vocab) if args.eval else None
    order = np.argsort(-train, kind="stable")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        ids = order[:size]
        rows.append({"vocabulary": f"top {size} of training", "train": coverage(train, ids),
                     "heldout": coverage(held, ids) if held is not None else None})
    if args.eagle:
        from triton_backend.speculation.drafters.eagle3_model import load_eagle3

        net = load_eagle3(args.eagle)
        ids = np.flatnonzero(net.t2d.numpy())
        rows.append({"vocabulary": f"{args.eagle} ({len(ids)})", "train": coverage(train, ids),
                     "heldout": coverage(held, ids) if held is not None else None})
    report = {"train": args.train, "eval": args.eval, "train_positions": int(train.sum()),
              "heldout_positions": int(held.sum()) if held is not None else 0, "rows": rows}
    for r in rows:
        print(f"{r['vocabulary']:>48}  train {r['train']:.4f}  held-out "
              + (f"{r['heldout']:.4f}" if r["heldout"] is not None else "-"))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
