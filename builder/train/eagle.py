"""``specbuild train-eagle``: an EAGLE drafter trained on the frozen target's own outputs.

The target's features (last hidden states after the final norm) come from the target-data
shards (:mod:`builder.train.target_data`, ``hidden``); training touches only the drafter's ``fc``
and its decoder layer. At position ``j`` the drafter reads ``(feature_j, token_{j+1})`` and
learns the target's ``feature_{j+1}`` (smooth-L1) and the token the target wrote at
``j + 2`` (cross-entropy over ``candidate_vocab`` rows of the target's LM head), the
EAGLE-1 objective. ``unroll`` = 2 adds a training-time test step: the drafter reads its own
predicted features and is trained on what follows them (what chain drafting does from draft
position 2 on).

Resumable: every ``save_every_s`` the net, optimizer and step count go to ``<out>.train.pt``;
a rerun with the same settings resumes from it. The report keeps a learning curve (held-out
teacher-forced top-1 accuracy at draft positions 1 and 2 vs training positions and seconds).
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from builder.report_paths import repo_path
from builder.errors import BuildSpecError
from builder.train.target_data import iter_records
from builder.train.schedule import TimedCosine
from triton_backend.speculation.drafters.eagle_model import EagleInfo, EagleKV, EagleNet, save_eagle

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass(frozen=True)
class EagleTrainConfig:
    target: str
    data_dir: str
    heldout_dir: str
    out: str  # the drafter file (.safetensors)
    candidate_vocab: int = 8192  # 0: the whole vocabulary
    epochs: int = 6
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3
    cls_weight: float = 0.2  # the token loss next to the feature loss (weight 1)
    unroll: int = 1  # 2: also train on the drafter's own predicted features
    time_limit_s: float = 900.0
    eval_every_s: float = 120.0
    save_every_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.epochs) < 1 or int(self.batch_size) < 1:
            raise BuildSpecError("epochs and batch_size must be >= 1")
        if self.unroll not in (1, 2):
            raise BuildSpecError("unroll must be 1 or 2")
        if self.candidate_vocab < 0 or self.lr <= 0 or self.time_limit_s <= 0 or self.cls_weight < 0:
            raise BuildSpecError("candidate_vocab and cls_weight must be >= 0, lr and time_limit_s > 0")

    def identity(self) -> dict[str, object]:
        """Settings a resumed run must share with the interrupted one."""
        keep = ("target", "data_dir", "candidate_vocab", "epochs", "batch_size", "lr", "cls_weight", "unroll", "seed")
        return {k: v for k, v in asdict(self).items() if k in keep}


@dataclass
class CurvePoint:
    steps: int
    positions: int  # training positions seen (with repeats)
    seconds: float
    top1_pos1: float  # held-out: drafter's top-1 == target's token, true features
    top1_pos2: float  # held-out: the same one step later, from the drafter's own feature


@dataclass
class EagleTrainReport:
    out: str
    train_positions: int
    heldout_positions: int
    steps: int
    seconds: float
    top1_pos1: float
    top1_pos2: float
    top1_untrained: float
    curve: list[CurvePoint] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def summary(self) -> str:
        return (f"EAGLE drafter -> {repo_path(self.out)}: {self.train_positions} training positions, {self.steps} steps in "
                f"{self.seconds:.0f}s; held-out top-1 at draft position 1: {self.top1_pos1:.3f} "
                f"(untrained {self.top1_untrained:.3f}), position 2: {self.top1_pos2:.3f} ({self.heldout_positions} positions)")


@dataclass
class _Seq:
    features: torch.Tensor  # [m + 1, H] float16: the target's features at positions 0..m
    tokens: torch.Tensor  # [m + 1] int64: token_{j+1} for position j (the last is token_{n-1})
    labels: torch.Tensor  # [m] int64: token_{j+2} (IGNORE inside the prompt)


def load_sequences(data_dir: str) -> list[_Seq]:
    """Per record: features 0..n-2, the tokens that follow them, and response labels."""
    out = []
    for rec in iter_records(data_dir):
        if "hidden" not in rec:
            raise BuildSpecError(f"{data_dir} was generated without hidden states; EAGLE training needs them")
        ids, hidden, prompt = rec["input_ids"], rec["hidden"], int(rec["prompt_length"])
        n = ids.shape[0]
        if n < 3 or n - 1 <= prompt:
            continue
        labels = ids[2:].clone()
        labels[: max(0, prompt - 2)] = IGNORE  # learn to predict response tokens only
        out.append(_Seq(features=hidden[: n - 1], tokens=ids[1:], labels=labels))
    if not out:
        raise BuildSpecError(f"{data_dir} holds no response positions")
    return out


def _batch(seqs: list[_Seq], subset_table: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Padded ``features [B, T+1, H]``, ``tokens [B, T]``, ``labels [B, T]`` (IGNORE in padding)."""
    t = max(s.labels.shape[0] for s in seqs)
    hid = seqs[0].features.shape[1]
    feats = torch.zeros(len(seqs), t + 1, hid)
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    labels = torch.full((len(seqs), t), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        m = s.labels.shape[0]
        feats[i, : m + 1] = s.features[: m + 1].float()
        tokens[i, :m] = s.tokens[:m]
        lab = s.labels
        if subset_table is not None:
            lab = torch.where(lab >= 0, subset_table[lab.clamp(min=0)], lab)
        labels[i, :m] = lab
    return feats, tokens, labels


class _Trainer:
    def __init__(self, cfg: EagleTrainConfig, net: EagleNet, embed: torch.Tensor, head: torch.Tensor,
                 subset: torch.Tensor | None) -> None:
        self.cfg, self.net, self.embed, self.head = cfg, net, embed, head
        self.table = None
        if subset is not None:
            self.table = torch.full((embed.shape[0],), IGNORE, dtype=torch.long)
            self.table[subset] = torch.arange(subset.shape[0])

    def outputs(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Predicted features ``[B, T, H]`` per unrolled step (step 2 reads step 1's predictions)."""
        b, t = tokens.shape
        embeds = F.embedding(tokens, self.embed)
        inputs, outs = feats[:, :t], []
        for _ in range(steps):
            kv = EagleKV.empty(self.net.info, b, t, feats.dtype)
            pred = self.net(inputs, embeds, torch.zeros(b, dtype=torch.long), kv)
            outs.append(pred)
            inputs = torch.cat((feats[:, :1], pred[:, :-1]), 1)  # position j reads the prediction made at j - 1
        return outs

    def loss(self, feats: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = feats.new_zeros(())
        valid = (labels != IGNORE)[..., None].float()
        keep = labels != IGNORE  # the LM head only where a label is learned (most of the cost)
        for pred in self.outputs(feats, tokens, self.cfg.unroll):  # every step predicts the same next feature/token
            reg = (F.smooth_l1_loss(pred, feats[:, 1:], reduction="none") * valid).sum() / (valid.sum() * pred.shape[-1]).clamp(min=1)
            cls = F.cross_entropy(pred[keep] @ self.head.t(), labels[keep]) if bool(keep.any()) else total * 0
            total = total + reg + self.cfg.cls_weight * cls
        return total

    @torch.no_grad()
    def accuracy(self, seqs: list[_Seq], batch: int = 8) -> tuple[float, float]:
        """Held-out top-1 at draft positions 1 and 2, each given the tokens before it right (position 2
        reads the drafter's own feature of the position before; its context does too, which makes
        it an underestimate: in the loop, earlier positions hold the target's features)."""
        hits, total = [0, 0], [0, 0]
        for s in range(0, len(seqs), batch):
            feats, tokens, labels = _batch(seqs[s:s + batch], self.table)
            ok = labels != IGNORE
            for step, pred in enumerate(self.outputs(feats, tokens, 2)):
                top = (pred[ok] @ self.head.t()).argmax(-1)
                hits[step] += int((top == labels[ok]).sum())
                total[step] += int(ok.sum())
        return hits[0] / max(1, total[0]), hits[1] / max(1, total[1])


def _frequent(seqs: list[_Seq], size: int, vocab: int) -> torch.Tensor | None:
    if size == 0 or size >= vocab:
        return None
    labels = torch.cat([s.labels[s.labels >= 0] for s in seqs])
    counts = torch.bincount(labels, minlength=vocab).float()
    counts += torch.bincount(torch.cat([s.tokens for s in seqs]), minlength=vocab).float() * 1e-3  # ties: seen tokens
    return counts.topk(size).indices.sort().values


def _length_batches(seqs: list[_Seq], size: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffled batches of similar-length sequences (less padding)."""
    order = torch.randperm(len(seqs), generator=gen).tolist()
    chunk = size * 16
    batches = []
    for s in range(0, len(order), chunk):
        part = sorted(order[s:s + chunk], key=lambda i: seqs[i].labels.shape[0])
        batches += [part[i:i + size] for i in range(0, len(part), size)]
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def _resume(path: Path, cfg: EagleTrainConfig, net: EagleNet, opt: torch.optim.Optimizer) -> dict:
    if not path.is_file():
        return {"steps": 0, "seconds": 0.0, "positions": 0, "curve": [], "epoch": 0}
    try:  # tensors and plain containers only: a checkpoint file never runs code when it loads
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise BuildSpecError(f"{path} is not a training checkpoint this version can load safely ({exc}); "
                             "delete it to start over") from None
    if state.get("identity") != cfg.identity():
        raise BuildSpecError(f"{path} was made with other settings; delete it to start over")
    net.load_state_dict(state["net"])
    opt.load_state_dict(state["opt"])
    logger.info("resuming EAGLE training from %s at step %d", path, state["progress"]["steps"])
    return state["progress"]


def train_eagle(cfg: EagleTrainConfig, *, progress: bool = True) -> EagleTrainReport:
    """Train (or resume), measure held-out accuracy, save the drafter at ``cfg.out``."""
    from tqdm.auto import tqdm

    from triton_backend.engines.torch.model_loading import load_model

    start = time.monotonic()
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target)
    embed = target.get_input_embeddings().weight.detach().float()
    head_full = target.get_output_embeddings().weight.detach().float()
    info = EagleInfo.from_target_config(target.config, target=cfg.target)
    train, held = load_sequences(cfg.data_dir), load_sequences(cfg.heldout_dir)
    if train[0].features.shape[1] != info.hidden_size:
        raise BuildSpecError(f"data hidden size {train[0].features.shape[1]} is not the target's {info.hidden_size}")
    subset = _frequent(train, cfg.candidate_vocab, head_full.shape[0])
    head = head_full[subset] if subset is not None else head_full
    net = EagleNet(info)
    trainer = _Trainer(cfg, net, embed, head, subset)
    untrained = trainer.accuracy(held)[0]
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.0)
    ckpt = Path(cfg.out).with_suffix(".train.pt")
    state = _resume(ckpt, cfg, net, opt)
    gen = torch.Generator().manual_seed(cfg.seed)
    per_epoch = len(_length_batches(train, cfg.batch_size, torch.Generator().manual_seed(0)))
    sched = TimedCosine(opt, cfg.epochs * per_epoch, cfg.time_limit_s)
    sched.steps, sched.start = state["steps"] - 1, sched.start - state["seconds"]
    sched.step()  # back at the interrupted step, its learning rate applied
    curve = [CurvePoint(**p) for p in state["curve"]]
    losses: list[float] = []
    last_eval = last_save = time.monotonic()
    bar = tqdm(total=cfg.epochs * per_epoch, initial=state["steps"], desc="eagle steps", disable=not progress)
    for epoch in range(cfg.epochs):
        batches = _length_batches(train, cfg.batch_size, gen)  # same order as the interrupted run
        for index, batch in enumerate(batches):
            if epoch * per_epoch + index < state["steps"]:
                continue
            if sched.done:
                break
            feats, tokens, labels = _batch([train[i] for i in batch], trainer.table)
            loss = trainer.loss(feats, tokens, labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            sched.step()
            state["steps"] += 1
            state["positions"] += int((labels != IGNORE).sum())
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            now = time.monotonic()
            if now - last_eval >= cfg.eval_every_s:
                curve.append(CurvePoint(state["steps"], state["positions"], now - sched.start, *trainer.accuracy(held)))
                logger.info("step %d: held-out top-1 pos1 %.3f pos2 %.3f", state["steps"], curve[-1].top1_pos1, curve[-1].top1_pos2)
                last_eval = time.monotonic()
            if now - last_save >= cfg.save_every_s:
                _checkpoint(ckpt, cfg, net, opt, state, curve, sched)
                last_save = now
        if sched.done:
            logger.warning("time limit of %.0fs reached after %d steps", cfg.time_limit_s, state["steps"])
            break
    bar.close()
    acc1, acc2 = trainer.accuracy(held)
    curve.append(CurvePoint(state["steps"], state["positions"], time.monotonic() - sched.start, acc1, acc2))
    _checkpoint(ckpt, cfg, net, opt, state, curve, sched)
    net.info = EagleInfo(**{**asdict(info), "acceptance_pos1": round(acc1, 4)})
    save_eagle(cfg.out, net, subset)
    return EagleTrainReport(out=cfg.out, train_positions=sum(int((s.labels >= 0).sum()) for s in train),
                            heldout_positions=sum(int((s.labels >= 0).sum()) for s in held), steps=state["steps"],
                            seconds=time.monotonic() - start, top1_pos1=acc1, top1_pos2=acc2, top1_untrained=untrained,
                            curve=curve, losses=losses[-20:])


def _checkpoint(path: Path, cfg: EagleTrainConfig, net: EagleNet, opt: torch.optim.Optimizer, state: dict,
                curve: list[CurvePoint], sched: TimedCosine) -> None:
    progress = {**state, "seconds": time.monotonic() - sched.start, "curve": [asdict(p) for p in curve]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"identity": cfg.identity(), "net": net.state_dict(), "opt": opt.state_dict(), "progress": progress}, tmp)
    tmp.replace(path)
