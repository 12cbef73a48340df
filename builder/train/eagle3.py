"""``specbuild train-eagle3``: an EAGLE-3 drafter trained with training-time test.

Data: feature files (:mod:`builder.train.eagle_features`; ``features_dir`` / ``heldout_dir`` may
name ``eagle-features`` folders or ``eagle-data`` corpus folders, whose shards' stored features
are used and whose shards without one are prefilled first): per position the fused low/mid/high
target features and the target's greedy next token. The drafter is trained to predict the
target's choice ``top1[j + 1]`` from ``(features_j, token_{j+1})``, over a reduced draft
vocabulary (the ``draft_vocab`` tokens the target writes most in the training data, mapped to
the target's ids by ``d2t``), initialised from the target's own LM-head rows and final norm, or
warm-started from an existing drafter folder (``init_from``: its weights and vocabulary map;
:mod:`builder.train.eagle3_init`).

Training-time test (``ttt_steps`` = S): step 0 reads the target's features; step ``s`` reads
the drafter's own output of step ``s - 1`` one position back, as chain drafting does, and
attends to the target-feature entries up to where its chain started plus its own chain's
entries (one mask over the keys of all steps). Step ``s``'s loss is weighted ``step_decay^s``.

Measured on held-out feature files: chain acceptance at draft depth ``d`` = the share of
starting positions where the drafter's first ``d`` greedy drafts all equal the target's
greedy tokens (what greedy verification of a ``d``-token chain accepts), from greedy responses.

Resumable: ``<out>/train_state.pt`` (net, optimizer, step, curve) every ``save_every_s``; a rerun
with the same settings continues (a checkpoint in ``out`` wins over ``init_from``: the init only
starts a run). The report (``training_report.json``) holds the learning curve, whose first point
is step 0: the untrained drafter's acceptance, or the init's.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.nn import functional as F

from builder.errors import BuildSpecError
from builder.report_paths import portable, repo_path
from builder.train.eagle3_init import (InitDrafter, TargetParts, check_layers, coverage_of, fresh_net, read_init, revocab,
                                       target_parts, warm_net)
from builder.train.eagle_features import feature_files
from builder.train.schedule import TimedCosine
from triton_backend.speculation.drafters.eagle3_model import Eagle3Net, save_eagle3

logger = logging.getLogger(__name__)

STATE = "train_state.pt"
REPORT = "training_report.json"
DEFAULT_DRAFT_VOCAB = 8192


@dataclass(frozen=True)
class Eagle3TrainConfig:
    target: str
    features_dir: str
    heldout_dir: str
    out: str  # output folder (config.json, model.safetensors, training_report.json)
    # features_dir / heldout_dir: one folder, or several comma-separated
    draft_vocab: int | None = None  # None: DEFAULT_DRAFT_VOCAB, or the init's (init_from)
    ttt_steps: int = 3
    step_decay: float = 0.8
    epochs: int = 4
    batch_size: int = 8
    max_len: int = 512
    lr: float = 5e-4
    time_limit_s: float = 1800.0
    eval_every_s: float = 300.0
    save_every_s: float = 120.0
    max_eval_sequences: int = 64
    seed: int = 0
    init_from: str = ""  # an EAGLE-3 drafter folder to warm-start from ("": a fresh drafter)
    init_from_target: bool = False  # fresh drafter: decoder layer from the target's last layer
    revocab: bool = False  # with init_from: the draft vocabulary re-picked from this run's data (draft_vocab tokens)
    threads: int = 0  # torch CPU threads (0: torch's default, the cores it sees or OMP_NUM_THREADS)

    def __post_init__(self) -> None:
        vocab = DEFAULT_DRAFT_VOCAB if self.draft_vocab is None else self.draft_vocab
        if self.ttt_steps < 1 or self.epochs < 1 or self.batch_size < 1 or vocab < 1 or self.max_len < 4:
            raise BuildSpecError("ttt_steps, epochs, batch_size, draft_vocab >= 1 and max_len >= 4")
        if self.lr <= 0 or self.time_limit_s <= 0 or not 0 < self.step_decay <= 1:
            raise BuildSpecError("lr and time_limit_s must be > 0, step_decay in (0, 1]")
        if not 0 <= self.threads <= 1024:
            raise BuildSpecError(f"threads must be between 0 (torch's default) and 1024, got {self.threads}")
        if self.init_from and self.init_from_target:
            raise BuildSpecError("--init-from (a drafter) and --init-from-target (a fresh drafter's layer from the "
                                 "target) exclude each other")
        if self.revocab and not self.init_from:
            raise BuildSpecError("--revocab re-picks a warm start's draft vocabulary: it needs --init-from "
                                 "(a fresh drafter picks its vocabulary from the data anyway)")

    def identity(self) -> dict[str, object]:
        """The settings a checkpoint must share to be resumed (threads may change)."""
        keep = ("target", "features_dir", "ttt_steps", "step_decay", "epochs", "batch_size", "max_len", "lr", "seed")
        ident: dict[str, object] = {k: v for k, v in asdict(self).items() if k in keep}
        if self.init_from:  # the draft vocabulary is the init's (checked to agree) or re-picked
            ident["init_from"] = str(Path(self.init_from).resolve())
            if self.revocab:
                ident["revocab"] = self.draft_vocab or "the init's size"
        else:
            ident["draft_vocab"] = DEFAULT_DRAFT_VOCAB if self.draft_vocab is None else self.draft_vocab
        if self.init_from_target:
            ident["init_from_target"] = True
        return ident


@dataclass
class CurvePoint:
    steps: int
    positions: int
    seconds: float
    acceptance: list[float]  # held-out chain acceptance at draft depth 1..S


@dataclass
class Eagle3Report:
    out: str
    train_positions: int
    heldout_positions: int
    steps: int
    seconds: float
    acceptance: list[float]  # of the drafter as saved (float16 weights)
    start_acceptance: list[float]  # at step 0: the untrained drafter's, or the init's ([]: unknown)
    draft_vocab: int
    draft_vocab_coverage: float  # share of training targets inside the draft vocabulary
    init_from: str | None = None  # the warm start's drafter folder (relative to the repository)
    threads: int = 0  # torch CPU threads the run used
    curve: list[CurvePoint] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # this run's first and last few step losses

    def summary(self) -> str:
        acc = ", ".join(f"{a:.3f}" for a in self.acceptance)
        start = (f"{self.start_acceptance[0]:.3f} at depth 1 at step 0" if self.start_acceptance else "step 0 unknown")
        origin = f"warm start from {self.init_from}" if self.init_from else "fresh start"
        return (f"EAGLE-3 drafter -> {self.out}: {self.train_positions} training positions, {self.steps} steps in "
                f"{self.seconds:.0f}s on {self.threads} thread(s); held-out chain acceptance by draft depth: {acc} "
                f"({origin}: {start})")


@dataclass
class _Seq:
    features: torch.Tensor  # [n, 3H] float16
    tokens: torch.Tensor  # [n] int64
    top1: torch.Tensor  # [n] int64: the target's greedy token after position j
    first: int  # first position whose prediction is trained / measured (the response's)


def training_sequence(features: torch.Tensor, tokens: torch.Tensor, top1: torch.Tensor, prompt_length: int,
                      max_len: int) -> _Seq:
    """One sequence as training reads it: cut to ``max_len`` positions, trained from the
    prediction of the prompt's last token on (``first``)."""
    n = min(len(tokens), max_len)
    return _Seq(features[:n], tokens[:n].long(), top1[:n].long(), max(0, prompt_length - 2))


def load_sequences(files: list[Path], max_len: int, limit: int | None = None,
                   layers: tuple[int, ...] | None = None) -> list[_Seq]:
    """The sequences of ``files``, each cut to ``max_len`` positions; every file must hold the
    capture ``layers`` (None: those of the first file)."""
    out: list[_Seq] = []
    for file in files:
        rec = torch.load(file, weights_only=True)
        layers = layers if layers is not None else tuple(rec["layers"])
        if tuple(rec["layers"]) != layers:
            raise BuildSpecError(f"{file} holds features of layers {tuple(rec['layers'])}, the others {layers}; "
                                 "make one corpus's features with one set of capture layers")
        for feats, toks, top1, plen in zip(rec["features"], rec["tokens"], rec["top1"], rec["prompt_lengths"].tolist()):
            out.append(training_sequence(feats, toks, top1, int(plen), max_len))
            if limit and len(out) >= limit:
                return out
    return out


def _batch(seqs: list[_Seq], net: Eagle3Net) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features ``[B, T, 3H]``, next tokens ``[B, T]`` (token_{j+1}) and draft labels ``[B, T]``
    (the target's top1 at ``j + 1`` in draft ids, ``-1``: not trained)."""
    t = max(len(s.tokens) for s in seqs)
    feats = torch.zeros(len(seqs), t, seqs[0].features.shape[-1])
    nxt = torch.zeros(len(seqs), t, dtype=torch.long)
    labels = torch.full((len(seqs), t), -1, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        feats[b, :n] = s.features.float()
        nxt[b, :n - 1] = s.tokens[1:]
        lab = net.target_to_draft(s.top1[1:])
        lab[:s.first] = -1
        labels[b, :n - 1] = lab
    return feats, nxt, labels


def ttt_mask(t: int, step: int) -> torch.Tensor:
    """Bool ``[T, (step + 1) T]``: query (``step``, j) sees step-0 keys at ``i <= j - step`` and the
    key of step ``s`` (1..step) at ``i = j - step + s`` (its own chain)."""
    j = torch.arange(t)[:, None]
    i = torch.arange(t)[None, :]
    blocks = [i <= j - step] + [i == j - step + s for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_hidden(net: Eagle3Net, embed: torch.Tensor, feats: torch.Tensor, nxt: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
    """The drafter's output ``g`` ``[B, T, H]`` of each training-time-test step (before norm and LM head)."""
    attn = net.midlayer.self_attn
    b, t, _ = feats.shape
    positions = torch.arange(t)[None].expand(b, t)
    emb = F.embedding(nxt, embed)
    hidden = net.fc(feats)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out = []
    for s in range(steps):
        q, k, v = attn.qkv(net.layer_input(hidden, emb), positions)
        keys.append(k)
        values.append(v)
        a = attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(t, s)[None])
        g = net.block_out(hidden, a)
        out.append(g)
        hidden = torch.cat((torch.zeros_like(g[:, :1]), g[:, :-1]), dim=1)  # position j reads g at j - 1
    return out


def ttt_forward(net: Eagle3Net, embed: torch.Tensor, feats: torch.Tensor, nxt: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """Logits ``[B, T, draft_vocab]`` of each training-time-test step."""
    return [net.logits(g) for g in ttt_hidden(net, embed, feats, nxt, steps)]


def ttt_loss(net: Eagle3Net, embed: torch.Tensor, feats: torch.Tensor, nxt: torch.Tensor, labels: torch.Tensor,
             steps: int, decay: float) -> torch.Tensor:
    """Sum over steps of ``decay^s`` x the mean cross-entropy of step ``s`` at its trained positions.
    The LM head (most of a step's work) runs only at those positions: prompt and padding
    positions are inputs to the attention, never predictions."""
    total = feats.new_zeros(())
    for s, g in enumerate(ttt_hidden(net, embed, feats, nxt, steps)):
        lab = labels.clone()
        lab[:, :s] = -1  # step s starts its chains s positions in
        keep = lab >= 0
        if bool(keep.any()):
            total = total + decay ** s * F.cross_entropy(net.logits(g[keep]), lab[keep])
    return total


@torch.no_grad()
def chain_acceptance(net: Eagle3Net, embed: torch.Tensor, seqs: list[_Seq], steps: int, batch_size: int = 8) -> list[float]:
    """Share of chain starts whose first ``d`` drafts all match the target's greedy tokens, d = 1..steps."""
    hits = [0] * steps
    starts = 0
    for lo in range(0, len(seqs), batch_size):
        chunk = seqs[lo:lo + batch_size]
        feats, nxt, labels = _batch(chunk, net)
        preds = [lg.argmax(-1) for lg in ttt_forward(net, embed, feats, nxt, steps)]
        for b, s in enumerate(chunk):
            n = len(s.tokens) - 1
            target = net.target_to_draft(s.top1[1:])
            for p in range(s.first, n):
                starts += 1
                for d in range(steps):
                    j = p + d
                    if j >= n or labels[b, j] < 0 or int(preds[d][b, j]) != int(target[j]):
                        break
                    hits[d] += 1
    return [h / max(1, starts) for h in hits]


def _start_net(cfg: Eagle3TrainConfig, train: list[_Seq], layers: tuple[int, ...],
               init: InitDrafter | None, parts: TargetParts) -> tuple[Eagle3Net, float]:
    """The drafter the run starts from (fresh, or the init's) and its draft vocabulary's coverage."""
    top1 = [s.top1[s.first:] for s in train]
    name = Path(cfg.target).name
    if init is not None and cfg.revocab:
        return revocab(warm_net(init, layers, name), parts, top1, cfg.draft_vocab or init.info.draft_vocab_size)
    if init is not None:
        net = warm_net(init, layers, name)
        coverage = coverage_of(net, top1)
        logger.info("warm start from %s: %d-token draft vocabulary kept, covering %.3f of the training targets",
                    repo_path(Path(cfg.init_from).absolute()), net.info.draft_vocab_size, coverage)
        return net, coverage
    return fresh_net(parts, top1, cfg.draft_vocab or DEFAULT_DRAFT_VOCAB, layers, name,
                     cfg.seed, from_target_layer=cfg.init_from_target)


def _as_saved(net: Eagle3Net) -> Eagle3Net:
    """A copy of ``net`` with its weights rounded as :func:`save_eagle3` stores them (float16):
    the drafter that serving (and a later warm start) loads."""
    import copy

    saved = copy.deepcopy(net).eval()
    with torch.no_grad():
        for p in saved.parameters():
            p.copy_(p.half().float())
    return saved


def _save_state(path: Path, cfg: Eagle3TrainConfig, net: Eagle3Net, opt: torch.optim.Optimizer, state: dict,
                curve: list[CurvePoint], seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"identity": cfg.identity(), "net": net.state_dict(), "opt": opt.state_dict(),
                "state": {**state, "seconds": seconds}, "curve": [asdict(p) for p in curve]}, tmp)
    tmp.replace(path)


def _resume(ckpt: Path, cfg: Eagle3TrainConfig, net: Eagle3Net,
            opt: torch.optim.Optimizer) -> tuple[dict, list[CurvePoint]]:
    """The saved progress (net and optimizer restored in place), or a fresh start."""
    if not ckpt.is_file():
        return {"steps": 0, "positions": 0, "seconds": 0.0}, []
    try:  # tensors and plain containers only: a checkpoint file never runs code when it loads
        saved = torch.load(ckpt, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise BuildSpecError(f"{ckpt} is not a training checkpoint this version can load safely ({exc}); "
                             "use another --out or delete it") from None
    if saved["identity"] != cfg.identity():
        raise BuildSpecError(f"{ckpt} was made with other settings; use another --out or delete it")
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    logger.info("resuming at step %d", saved["state"]["steps"])
    return saved["state"], [CurvePoint(**p) for p in saved["curve"]]


def length_batches(lengths: list[int], batch_size: int, rng: random.Random, pool: int = 16) -> list[list[int]]:
    """One epoch's batches: a random order cut into pools of ``pool`` batches, each pool sorted
    by length before it is cut into batches (little padding), the batches then shuffled.
    Every index appears once; ``ceil(len / batch_size)`` batches."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    span = batch_size * pool
    for lo in range(0, len(order), span):
        group = sorted(order[lo:lo + span], key=lambda i: lengths[i])
        batches.extend(group[i:i + batch_size] for i in range(0, len(group), batch_size))
    rng.shuffle(batches)
    return batches


def _step(cfg: Eagle3TrainConfig, net: Eagle3Net, embed: torch.Tensor, opt: torch.optim.Optimizer,
          chunk: list[_Seq]) -> tuple[float, int]:
    """One optimizer step on ``chunk``: ``(loss, trained positions)``."""
    feats, nxt, labels = _batch(chunk, net)
    loss = ttt_loss(net, embed, feats, nxt, labels, cfg.ttt_steps, cfg.step_decay)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    return float(loss.detach()), int((labels >= 0).sum())


def train_eagle3(cfg: Eagle3TrainConfig, *, progress: bool = True) -> Eagle3Report:
    """Train (or resume) and write the drafter folder with its report; see the module docstring.
    Runs on ``cfg.threads`` torch threads (0: as torch is set), restored afterwards."""
    previous = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, progress)
    finally:
        torch.set_num_threads(previous)


@dataclass
class _Run:
    net: Eagle3Net
    embed: torch.Tensor  # [V, H] the target's
    coverage: float
    train: list[_Seq]
    held: list[_Seq]


def _prepare(cfg: Eagle3TrainConfig) -> _Run:
    """Target, init (checked before the bulk of the features is read), features, starting drafter."""
    parts = target_parts(cfg.target)
    init = read_init(cfg.init_from, cfg.target, parts.config, cfg.draft_vocab, cfg.revocab) if cfg.init_from else None
    train_files = feature_files(cfg.target, cfg.features_dir)
    layers = tuple(torch.load(train_files[0], weights_only=True)["layers"])
    if init is not None:
        check_layers(init, layers)
    train = load_sequences(train_files, cfg.max_len, layers=layers)
    held = load_sequences(feature_files(cfg.target, cfg.heldout_dir), cfg.max_len, cfg.max_eval_sequences, layers)
    net, coverage = _start_net(cfg, train, layers, init, parts)
    return _Run(net, parts.embed, coverage, train, held)


def _train(cfg: Eagle3TrainConfig, progress: bool) -> Eagle3Report:
    run = _prepare(cfg)  # a refused setting leaves no folder behind
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    net, embed, held = run.net, run.embed, run.held
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.0)
    ckpt = out / STATE
    state, curve = _resume(ckpt, cfg, net, opt)  # a checkpoint wins over the init
    if state["steps"] == 0 and not curve:  # a new run: the curve starts at step 0
        state["start_acceptance"] = chain_acceptance(net, embed, held, cfg.ttt_steps)
        curve.append(CurvePoint(0, 0, 0.0, state["start_acceptance"]))
        logger.info("step 0: held-out chain acceptance %s", state["start_acceptance"])
    start_acceptance = state.get("start_acceptance") or (curve[0].acceptance if curve and curve[0].steps == 0 else [])
    per_epoch = -(-len(run.train) // cfg.batch_size)
    sched = TimedCosine(opt, cfg.epochs * per_epoch, cfg.time_limit_s)
    sched.steps, sched.start = state["steps"] - 1, sched.start - state["seconds"]
    sched.step()
    losses = _epochs(cfg, run, opt, sched, state, curve, ckpt, progress)
    seconds = time.monotonic() - sched.start
    final = chain_acceptance(_as_saved(net), embed, held, cfg.ttt_steps)
    curve.append(CurvePoint(state["steps"], state["positions"], seconds, final))
    _save_state(ckpt, cfg, net, opt, state, curve, seconds)
    init = repo_path(Path(cfg.init_from).absolute()) if cfg.init_from else None
    net.info.extra.update({"heldout_chain_acceptance": [round(a, 4) for a in final]})
    net.info.extra.pop("init_from", None)
    if init:
        net.info.extra["init_from"] = init
    save_eagle3(out, net)
    report = Eagle3Report(out=str(out), train_positions=sum(len(s.tokens) - 1 - s.first for s in run.train),
                          heldout_positions=sum(len(s.tokens) - 1 - s.first for s in held), steps=state["steps"],
                          seconds=seconds, acceptance=final, start_acceptance=list(start_acceptance),
                          draft_vocab=net.info.draft_vocab_size, draft_vocab_coverage=run.coverage, init_from=init,
                          threads=torch.get_num_threads(), curve=curve,
                          losses=losses[:5] + losses[-5:] if len(losses) > 10 else losses)
    written = replace(report, out=repo_path(out.absolute()))  # no machine paths in the file
    (out / REPORT).write_text(json.dumps(portable({"settings": asdict(cfg), "training": asdict(written),
                                                   "summary": written.summary()}), indent=2) + "\n")
    return report


def _epochs(cfg: Eagle3TrainConfig, run: _Run, opt: torch.optim.Optimizer, sched: TimedCosine, state: dict,
            curve: list[CurvePoint], ckpt: Path, progress: bool) -> list[float]:
    """The training steps left (curve points every ``eval_every_s``, checkpoints every
    ``save_every_s``); returns this call's step losses."""
    from tqdm.auto import tqdm

    net, embed, train = run.net, run.embed, run.train
    per_epoch = -(-len(train) // cfg.batch_size)
    last_eval = last_save = time.monotonic()
    losses: list[float] = []
    bar = tqdm(total=cfg.epochs * per_epoch, initial=state["steps"], desc="eagle3 steps", disable=not progress)
    lengths = [len(s.tokens) for s in train]
    for epoch in range(cfg.epochs):
        batches = length_batches(lengths, cfg.batch_size, random.Random(cfg.seed * 1000 + epoch))
        for index, members in enumerate(batches):
            if epoch * per_epoch + index < state["steps"] or sched.done:
                continue
            loss, positions = _step(cfg, net, embed, opt, [train[i] for i in members])
            sched.step()
            state["steps"] += 1
            state["positions"] += positions
            bar.update(1)
            losses.append(loss)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            now = time.monotonic()
            if now - last_eval >= cfg.eval_every_s:
                curve.append(CurvePoint(state["steps"], state["positions"], now - sched.start,
                                        chain_acceptance(net, embed, run.held, cfg.ttt_steps)))
                logger.info("step %d: held-out chain acceptance %s", state["steps"], curve[-1].acceptance)
                last_eval = time.monotonic()
            if now - last_save >= cfg.save_every_s:
                _save_state(ckpt, cfg, net, opt, state, curve, now - sched.start)
                last_save = now
    bar.close()
    return losses


__all__ = ["Eagle3Report", "Eagle3TrainConfig", "chain_acceptance", "length_batches", "load_sequences", "training_sequence",
           "train_eagle3", "ttt_forward", "ttt_hidden", "ttt_loss", "ttt_mask"]
