"""What an EAGLE-3 drafter learns from, recomputed from a token corpus by batched prefill.

For every corpus sequence (:mod:`builder.train.eagle_corpus`) one causal forward of the
target gives, per position ``j``: the outputs of the capture layers (low, mid, high),
concatenated (``features`` ``[n, 3H]`` float16), and the target's greedy choice after ``j``
(``top1`` ``[n]``: what the drafter is trained to predict). One prefill of a sequence costs
far less than decoding it, so these large files are made again on any machine with one
command (``specbuild eagle-features``) instead of being kept.

One feature file per corpus shard (``feat-00000.pt``), written atomically; files present are
skipped, so an interrupted run resumes. ``specbuild eagle-data --features eagle3`` writes the
same files beside its token shards from the generation passes themselves (no second forward);
:func:`corpus_feature_files` hands the trainer those and prefills only the shards without one.
Feature files are large (``3 x hidden x 2`` bytes a position) and never committed.
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


def feature_path(folder: Path, shard: Path) -> Path:
    """The feature file of corpus shard ``shard-NNNNN.npz`` in ``folder``: ``feat-NNNNN.pt``."""
    return folder / shard.name.replace("shard-", "feat-").replace(".npz", ".pt")


def write_feature_file(target: Path, layers: tuple[int, ...], prompt_lengths: list[int], tokens: list[torch.Tensor],
                       features: list[torch.Tensor], top1: list[torch.Tensor]) -> None:
    """One shard's record, atomically: per sequence ``tokens [n]`` int64, ``features [n, len(layers) * H]``
    float16 and ``top1 [n]`` int32 (the target's greedy token after each position)."""
    record = {"layers": list(layers), "prompt_lengths": torch.tensor(prompt_lengths), "tokens": tokens,
              "features": features, "top1": top1}
    tmp = target.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(target)


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
    try:
        chosen = tuple(layers) if layers else default_capture_layers(total)
    except ValueError as exc:  # a target with too few layers for the default set
        raise BuildSpecError(f"{exc}; name the capture layers") from None
    if any(not 0 <= i < total for i in chosen):
        raise BuildSpecError(f"capture layers {chosen} must lie in [0, {total})")
    return chosen


def generate_features(config: FeatureConfig) -> Path:
    """Write the missing feature files; returns the folder."""
    from triton_backend.engines.torch.model_loading import load_model

    files = _shards(Path(config.corpus_dir), config.max_shards)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if not feature_path(out, f).exists()]
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
        write_feature_file(feature_path(out, file), layers, [p for _, p in seqs], [torch.from_numpy(s) for s, _ in seqs],
                           [r[0] for r in results], [r[1] for r in results])
        rate = done_tokens / max(time.monotonic() - start, 1e-9)
        cpu_rate = done_tokens / max(time.process_time() - cpu_start, 1e-9)
        logger.info("features: %d/%d shards, %.0f tokens/s (%.0f per CPU second)", n + 1, len(todo), rate, cpu_rate)
    return out


def corpus_feature_files(target: str, corpus: str | Path) -> list[Path]:
    """The feature file of every shard of an ``eagle-data`` folder: the one stored beside it
    (captured during generation) when present, else made now by prefill and written there."""
    folder = Path(corpus)
    shards = _shards(folder, None)
    missing = [f for f in shards if not feature_path(folder, f).exists()]
    logger.info("%s: %d shards, %d with stored features, %d to prefill", folder, len(shards),
                len(shards) - len(missing), len(missing))
    if missing:
        generate_features(FeatureConfig(target=target, corpus_dir=str(folder), out_dir=str(folder)))
    return [feature_path(folder, f) for f in shards]


def feature_files(target: str, folders: str | Path) -> list[Path]:
    """Feature files of one folder or several (comma-separated): an ``eagle-data`` corpus folder
    (holding ``shard-*.npz``) through :func:`corpus_feature_files`, else an ``eagle-features`` folder."""
    names = [f.strip() for f in str(folders).split(",") if f.strip()]
    if not names:
        raise BuildSpecError(f"no feature folder given ({str(folders)!r})")
    files: list[Path] = []
    for name in names:
        is_corpus = any(Path(name).glob("shard-*.npz"))
        files += corpus_feature_files(target, name) if is_corpus else iter_feature_files(name)
    return files


def iter_feature_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("feat-*.pt"))
    if not files:
        raise BuildSpecError(f"{folder} holds no feature files; run `specbuild eagle-features` first")
    return files


__all__ = ["FeatureConfig", "capture_layers_for", "corpus_feature_files", "feature_files", "feature_path",
           "generate_features", "iter_feature_files", "prefill_features", "write_feature_file"]
