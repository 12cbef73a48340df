"""What an EAGLE-3 drafter learns from, recomputed from a token corpus by batched prefill.

For every corpus sequence (:mod:`builder.train.eagle_corpus`) one causal forward of the
target gives, per position ``j``: the outputs of the capture layers (low, mid, high),
concatenated (``features`` ``[n, 3H]`` float16), and the target's greedy choice after ``j``
(``top1`` ``[n]``: what the drafter is trained to predict). One prefill of a sequence costs
far less than decoding it, so these large files are made again on any machine with one
command (``specbuild eagle-features``) instead of being kept.

One feature file per corpus shard (``feat-00000.pt``), written atomically; files present are
skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from builder.errors import BuildSpecError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeatureConfig:
    target: str
    corpus_dir: str
    out_dir: str
    capture_layers: tuple[int, ...] | None = None  # None: the default low/mid/high set
    batch_tokens: int = 4096  # padded tokens per prefill batch
    max_shards: int | None = None

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise BuildSpecError("batch_tokens must be >= 1")


def _shards(corpus: Path, limit: int | None) -> list[Path]:
    files = sorted(corpus.glob("shard-*.npz"))
    if not files:
        raise BuildSpecError(f"{corpus} holds no corpus shards; run `specbuild eagle-data` first")
    return files[:limit] if limit else files


def _sequences(file: Path) -> list[tuple[np.ndarray, int]]:
    with np.load(file) as z:
        tokens, offsets, plens = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lengths"]
    return [(tokens[offsets[i]:offsets[i + 1]], int(plens[i])) for i in range(len(plens))]


@torch.inference_mode()
def prefill_features(model: Any, seqs: list[np.ndarray], layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(features [n, len(layers) * H] float16, top1 [n] int32)`` per sequence, one padded batch."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.from_numpy(s)
        mask[i, :len(s)] = 1
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    fused = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)  # layer i's output
    top1 = model.get_output_embeddings()(out.last_hidden_state).argmax(-1)
    return [(fused[i, :len(s)].to(torch.float16), top1[i, :len(s)].to(torch.int32)) for i, s in enumerate(seqs)]


def _batches(seqs: list[tuple[np.ndarray, int]], batch_tokens: int) -> Iterator[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * len(seqs[i][0]) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def capture_layers_for(model: Any, layers: tuple[int, ...] | None) -> tuple[int, ...]:
    from triton_backend.speculation.drafters.eagle3_model import default_capture_layers

    total = int(model.config.num_hidden_layers)
    chosen = tuple(layers) if layers else default_capture_layers(total)
    if any(not 0 <= i < total for i in chosen):
        raise BuildSpecError(f"capture layers {chosen} must lie in [0, {total})")
    return chosen


def generate_features(config: FeatureConfig) -> Path:
    """Write the missing feature files; returns the folder."""
    from triton_backend.engines.torch.model_loading import load_model

    files = _shards(Path(config.corpus_dir), config.max_shards)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if not (out / f.name.replace("shard-", "feat-").replace(".npz", ".pt")).exists()]
    logger.info("features: %d corpus shards, %d to prefill", len(files), len(todo))
    if not todo:
        return out
    model = load_model(config.target).eval()
    layers = capture_layers_for(model, config.capture_layers)
    start, cpu_start, done_tokens = time.monotonic(), time.process_time(), 0
    for n, file in enumerate(todo):
        seqs = _sequences(file)
        results: list[Any] = [None] * len(seqs)
        for batch in _batches(seqs, config.batch_tokens):
            for i, res in zip(batch, prefill_features(model, [seqs[i][0] for i in batch], layers)):
                results[i] = res
        done_tokens += sum(len(s) for s, _ in seqs)
        record = {"layers": list(layers), "prompt_lengths": torch.tensor([p for _, p in seqs]),
                  "tokens": [torch.from_numpy(s) for s, _ in seqs], "features": [r[0] for r in results],
                  "top1": [r[1] for r in results]}
        target = out / file.name.replace("shard-", "feat-").replace(".npz", ".pt")
        tmp = target.with_suffix(".tmp")
        torch.save(record, tmp)
        tmp.replace(target)
        rate = done_tokens / max(time.monotonic() - start, 1e-9)
        cpu_rate = done_tokens / max(time.process_time() - cpu_start, 1e-9)
        logger.info("features: %d/%d shards, %.0f tokens/s (%.0f per CPU second)", n + 1, len(todo), rate, cpu_rate)
    return out


def iter_feature_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("feat-*.pt"))
    if not files:
        raise BuildSpecError(f"{folder} holds no feature files; run `specbuild eagle-features` first")
    return files


__all__ = ["FeatureConfig", "capture_layers_for", "generate_features", "iter_feature_files", "prefill_features"]
