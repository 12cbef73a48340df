"""Offline chain acceptance of an EAGLE drafter on a token corpus (``specbuild eagle-data``,
greedy responses): per position of each response, whether the drafter's first d greedy drafts
all equal the target's greedy tokens. EAGLE-1 (a ``specbuild train-eagle`` file): the serving
code's ``draft_chain``, fed the target's features up to that position. EAGLE-3 (a folder, the
format read from its files): ``train-eagle3``'s own measure on the corpus's feature files (stored
by ``eagle-data --features eagle3``, else prefilled and written beside the shards: large,
git-ignored). The same measure for both, so the two compare on the same held-out sequences.

    python scripts/analysis/eagle_chain_acceptance.py --eagle artifacts/smollm2-135m-eagle --corpus HELD
    python scripts/analysis/eagle_chain_acceptance.py --eagle artifacts/smollm2-135m-eagle3 --corpus HELD
    # per workload, on the held-out split answered greedily (eagle-data --prompts builder/data/heldout_split.json)
    python scripts/analysis/eagle_chain_acceptance.py --eagle artifacts/smollm2-135m-eagle3 --corpus SPLIT --by-kind --k 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _kinds(corpus: str, files: list) -> list[str]:
    """The prompt kind (workload) of every sequence, in the order the feature files hold them."""
    import numpy as np

    from builder.train.prompt_set import PROMPTS_FILE, load_prompt_set

    prompts = load_prompt_set(Path(corpus) / PROMPTS_FILE)
    kinds: list[str] = []
    for feat in files:
        with np.load(Path(corpus) / feat.name.replace("feat-", "shard-").replace(".pt", ".npz")) as z:
            kinds += [prompts[int(i)]["kind"] for i in sorted(z["prompt_index"].tolist())]
    return kinds


def eagle3_chain_acceptance(eagle: str, target: str, corpus: str, k: int, by_kind: bool = False) -> dict:
    from builder.train.eagle3 import chain_acceptance as ttt_chain_acceptance, load_sequences
    from builder.train.eagle_features import corpus_feature_files
    from triton_backend.engines.torch.model_loading import load_model
    from triton_backend.speculation.drafters.eagle3_model import load_eagle3

    model = load_model(target).eval()
    net = load_eagle3(eagle, num_target_layers=int(model.config.num_hidden_layers)).eval()
    embed = model.get_input_embeddings().weight.detach().float()
    files = corpus_feature_files(target, corpus)
    seqs = load_sequences(files, max_len=1 << 30, layers=tuple(net.info.capture_layers))
    accepted = ttt_chain_acceptance(net, embed, seqs, k)
    out = {"eagle": eagle, "format": "eagle3", "corpus": corpus,
           "positions": sum(len(s.tokens) - 1 - s.first for s in seqs), "chain_acceptance": accepted}
    if by_kind:  # per workload: a corpus made from a JSON prompts file (e.g. the held-out split)
        kinds = _kinds(corpus, files)
        out["by_kind"] = {kind: ttt_chain_acceptance(net, embed, [s for s, c in zip(seqs, kinds) if c == kind], k)
                          for kind in dict.fromkeys(kinds)}
    return out


@torch.inference_mode()
def chain_acceptance(eagle: str, target: str, corpus: str, k: int, by_kind: bool = False) -> dict:
    from triton_backend.core.drafter_format import EagleFormat, detect_eagle_format

    if detect_eagle_format(eagle) is EagleFormat.EAGLE3:
        return eagle3_chain_acceptance(eagle, target, corpus, k, by_kind)
    from builder.train.eagle_corpus import iter_corpus
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.core.sampling import LogitsProcessor
    from triton_backend.engines.torch.model_loading import load_engine
    from triton_backend.speculation.drafters.eagle import EagleDrafter

    engine, _ = load_engine(target, RuntimeConfig(max_batch_size=1, max_seq_len=64))
    drafter = EagleDrafter.from_file(eagle, engine)
    model = engine.model
    greedy = LogitsProcessor()
    hits, starts = [0] * k, 0
    for tokens, plen, _temp in iter_corpus(corpus):
        ids = torch.from_numpy(tokens)[None]
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # [n, H] after the final norm
        top1 = model.get_output_embeddings()(hidden).argmax(-1)
        n, first = len(tokens), max(0, plen - 2)
        kv = drafter.new_cache(1, n + k + 1)
        for p in range(first, n - 1):
            lo = 0 if p == first else p  # the first call feeds the whole context, then one pair a step
            drafted, _ = drafter.draft_chain(kv, torch.tensor([lo]), hidden[None, lo:p + 1], ids[:, lo + 1:p + 2],
                                             torch.tensor([p + 1 - lo]), k, [greedy], [None])
            starts += 1
            for d in range(k):
                if p + 1 + d >= n or int(drafted[0, d]) != int(top1[p + 1 + d]):
                    break
                hits[d] += 1
    return {"eagle": eagle, "format": "eagle1", "corpus": corpus, "positions": starts, "chain_acceptance": [h / max(1, starts) for h in hits]}


def main() -> None:
    from triton_backend.core.reference_model import DEFAULT_REFERENCE

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eagle", required=True)
    p.add_argument("--target", default=DEFAULT_REFERENCE)
    p.add_argument("--corpus", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--by-kind", action="store_true", help="EAGLE-3: also per prompt kind (the corpus's workloads)")
    a = p.parse_args()
    print(json.dumps(chain_acceptance(a.eagle, a.target, a.corpus, a.k, a.by_kind), indent=2))


if __name__ == "__main__":
    main()
