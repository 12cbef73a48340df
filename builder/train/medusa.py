"""``specbuild train-medusa``: Medusa-1 heads on a frozen target, trained on its own outputs.

The target's last hidden states are computed once (:mod:`builder.train.target_data`); training
then touches only the heads. At position ``j`` of a response, head ``i`` learns the token
the target wrote at ``j + 2 + i``. The heads share the target's LM head; the loss ranks the
``candidate_vocab`` most frequent response tokens (saved with the heads: the runtime ranks
the same candidates, which keeps drafting cheap). Held-out top-1/top-k accuracy per head is
measured on responses to prompts never trained on, and the tree (``medusa_choices``) is
grown from those accuracies: each node's expected gain is the product of its ranks'
accuracies along its path (as in the Medusa paper), the best ``tree_size`` nodes are kept.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from builder.errors import BuildSpecError
from builder.train.target_data import iter_records
from builder.report_paths import repo_path
from builder.train.schedule import TimedCosine
from triton_backend.speculation.drafters.medusa_model import MedusaHeads, MedusaHeadsInfo, save_medusa
from triton_backend.core.tree import Choices

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass(frozen=True)
class MedusaTrainConfig:
    target: str
    data_dir: str
    heldout_dir: str
    out: str
    num_heads: int = 4
    num_layers: int = 1
    candidate_vocab: int = 8192  # 0: the whole vocabulary
    epochs: int = 4
    batch_size: int = 256
    lr: float = 1e-3
    time_limit_s: float = 900.0
    tree_size: int = 15
    top_k_eval: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "epochs", "batch_size", "tree_size", "top_k_eval"):
            if int(getattr(self, name)) < 1:
                raise BuildSpecError(f"{name} must be >= 1")
        if self.candidate_vocab < 0 or self.lr <= 0 or self.time_limit_s <= 0:
            raise BuildSpecError("candidate_vocab must be >= 0, lr and time_limit_s > 0")


@dataclass
class MedusaTrainReport:
    out: str
    train_positions: int
    heldout_positions: int
    steps: int
    seconds: float
    top1: list[float]  # held-out, per head
    topk: list[list[float]]  # held-out P(label is the rank-r candidate), per head and rank
    top1_untrained: list[float]
    medusa_choices: Choices = ()
    losses: list[float] = field(default_factory=list)

    def summary(self) -> str:
        heads = ", ".join(f"head {i}: {a:.3f} (untrained {u:.3f})" for i, (a, u) in enumerate(zip(self.top1, self.top1_untrained)))
        return (f"Medusa heads -> {repo_path(self.out)}: {self.train_positions} training positions, {self.steps} steps in "
                f"{self.seconds:.0f}s; held-out top-1 accuracy ({self.heldout_positions} positions): {heads}; "
                f"tree of {len(self.medusa_choices)} nodes")


def head_examples(data_dir: str, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``[N, H]`` (float16) at response positions and labels ``[N, heads]``."""
    hidden, labels = [], []
    for rec in iter_records(data_dir):
        if "hidden" not in rec:
            raise BuildSpecError(f"{data_dir} was generated without hidden states; Medusa training needs them")
        ids, start = rec["input_ids"], int(rec["prompt_length"]) - 1
        n = ids.shape[0]
        if n - 1 <= start:
            continue
        rows = torch.arange(start, n - 1)
        lab = torch.full((rows.shape[0], num_heads), IGNORE, dtype=torch.long)
        for i in range(num_heads):
            ok = rows + 2 + i < n
            lab[ok, i] = ids[rows[ok] + 2 + i]
        hidden.append(rec["hidden"][start:n - 1])
        labels.append(lab)
    if not hidden:
        raise BuildSpecError(f"{data_dir} holds no response positions")
    return torch.cat(hidden), torch.cat(labels)


def frequent_tokens(labels: torch.Tensor, size: int, vocab: int) -> torch.Tensor | None:
    """The ``size`` most frequent label tokens (sorted ids), or None for the whole vocabulary."""
    if size == 0 or size >= vocab:
        return None
    counts = torch.bincount(labels[labels >= 0], minlength=vocab)
    return counts.topk(size).indices.sort().values


def _remap(labels: torch.Tensor, subset: torch.Tensor | None, vocab: int) -> torch.Tensor:
    if subset is None:
        return labels
    table = torch.full((vocab,), IGNORE, dtype=torch.long)
    table[subset] = torch.arange(subset.shape[0])
    return torch.where(labels >= 0, table[labels.clamp(min=0)], labels)


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
                  top_k: int, batch: int = 1024) -> list[list[float]]:
    """Per head, the fraction of positions whose label is the rank-``r`` candidate (r < top_k).
    ``labels`` index ``weight``'s rows (IGNORE where undefined; labels outside count as misses)."""
    hits = torch.zeros(heads.info.num_heads, top_k)
    total = (labels != IGNORE).sum(0).clamp(min=1).float()
    for s in range(0, hidden.shape[0], batch):
        logits = heads.logits(hidden[s:s + batch].float(), weight)  # [heads, b, V']
        top = logits.topk(top_k, dim=-1).indices  # [heads, b, k]
        lab = labels[s:s + batch].t()  # [heads, b]
        hits += (top == lab[..., None]).sum(1).float()
    return (hits / total[:, None]).tolist()


def grow_tree(rank_acc: list[list[float]], size: int) -> Choices:
    """The ``size`` nodes of largest expected gain (product of rank accuracies along the path)."""
    frontier = [(-rank_acc[0][r], (r,)) for r in range(len(rank_acc[0]))]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        depth = len(path)
        if depth < len(rank_acc):
            for r in range(len(rank_acc[depth])):
                heapq.heappush(frontier, (neg * rank_acc[depth][r], path + (r,)))
    return tuple(sorted(chosen, key=lambda c: (len(c), c)))


def _epoch(heads: MedusaHeads, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
           opt: torch.optim.Optimizer, sched: TimedCosine, cfg: MedusaTrainConfig, gen: torch.Generator) -> list[float]:
    losses = []
    order = torch.randperm(hidden.shape[0], generator=gen)
    for s in range(0, order.shape[0], cfg.batch_size):
        if sched.done:
            break
        idx = order[s:s + cfg.batch_size]
        logits = heads.logits(hidden[idx].float(), weight)  # [heads, b, V']
        lab = labels[idx].t()  # [heads, b]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def train_medusa(cfg: MedusaTrainConfig, *, progress: bool = True) -> MedusaTrainReport:
    from tqdm.auto import tqdm

    from triton_backend.engines.torch.model_loading import load_model

    start = time.monotonic()
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target)
    head_weight = target.get_output_embeddings().weight.detach().float()
    vocab, hidden_size = head_weight.shape
    train_h, train_y = head_examples(cfg.data_dir, cfg.num_heads)
    held_h, held_y = head_examples(cfg.heldout_dir, cfg.num_heads)
    if train_h.shape[1] != hidden_size:
        raise BuildSpecError(f"data hidden size {train_h.shape[1]} is not the target's {hidden_size}")
    subset = frequent_tokens(train_y, cfg.candidate_vocab, vocab)
    weight = head_weight[subset] if subset is not None else head_weight
    train_y, held_y = _remap(train_y, subset, vocab), _remap(held_y, subset, vocab)
    info = MedusaHeadsInfo(num_heads=cfg.num_heads, num_layers=cfg.num_layers, hidden_size=hidden_size,
                           vocab_size=vocab, target=cfg.target)
    heads = MedusaHeads(info)
    untrained = [row[0] for row in rank_accuracy(heads, weight, held_h, held_y, 1)]
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(train_h.shape[0] / cfg.batch_size)
    sched = TimedCosine(opt, cfg.epochs * steps_per_epoch, cfg.time_limit_s - (time.monotonic() - start))
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    for epoch in tqdm(range(cfg.epochs), desc="medusa epochs", disable=not progress):
        step_losses = _epoch(heads, weight, train_h, train_y, opt, sched, cfg, gen)
        losses += step_losses
        logger.info("epoch %d: %d steps, mean loss %.3f", epoch, len(step_losses), sum(step_losses) / max(1, len(step_losses)))
        if sched.done:
            if len(losses) < cfg.epochs * steps_per_epoch:
                logger.warning("time limit of %.0fs reached after %d steps", cfg.time_limit_s, len(losses))
            break
    acc = rank_accuracy(heads, weight, held_h, held_y, cfg.top_k_eval)
    choices = grow_tree(acc, cfg.tree_size)
    heads.info = replace(info, medusa_choices=choices, head_accuracy=tuple(a[0] for a in acc))
    save_medusa(cfg.out, heads, subset)
    return MedusaTrainReport(out=cfg.out, train_positions=train_h.shape[0], heldout_positions=held_h.shape[0],
                             steps=len(losses), seconds=time.monotonic() - start, top1=[a[0] for a in acc], topk=acc,
                             top1_untrained=untrained, medusa_choices=choices, losses=losses[-20:])

