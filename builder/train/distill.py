"""``specbuild distill``: a small draft trained on the target's own outputs.

The draft is a :class:`~triton_backend.engines.torch.draft_arch.SubsetLlamaForCausalLM`: a few decoder
layers initialised from chosen target layers, the target's input embeddings (frozen) and
final norm, and an LM head over the ``draft_vocab`` tokens the target writes most often
(initialised from the target's head rows). It learns by knowledge distillation: at every
position, cross-entropy against the target's top-K distribution (from
:mod:`builder.train.target_data`, restricted to the draft vocabulary), plus a regression onto the
target's last hidden state when the data has it (the draft's head starts as the target's,
so matching the hidden state is matching the target's logits). The result is saved as a
Hugging Face folder with the target's tokenizer, loadable by ``specbuild run --draft``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from builder.errors import BuildSpecError
from builder.train.target_data import iter_records
from builder.report_paths import repo_path
from builder.train.schedule import TimedCosine
from triton_backend.engines.torch.draft_arch import SubsetLlamaConfig, SubsetLlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    target: str
    data_dir: str
    out_dir: str
    init_layers: tuple[int, ...] = (0, 1)
    draft_vocab: int = 8192
    epochs: int = 4
    batch_size: int = 16  # sequences
    lr: float = 5e-4
    time_limit_s: float = 900.0
    seed: int = 0
    save_dtype: str = "bfloat16"
    hidden_weight: float = 1.0  # weight of the hidden-state regression (when the data has hidden states)
    response_only: bool = False  # distil only at response positions (default: every position)

    def __post_init__(self) -> None:
        if not self.init_layers or any(i < 0 for i in self.init_layers):
            raise BuildSpecError("init_layers must name at least one target layer (>= 0)")
        if self.draft_vocab < 16 or self.epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.time_limit_s <= 0:
            raise BuildSpecError("need draft_vocab >= 16, epochs >= 1, batch_size >= 1, lr > 0, time_limit_s > 0")
        if self.save_dtype not in ("float32", "float16", "bfloat16"):
            raise BuildSpecError("save_dtype must be float32, float16 or bfloat16")


@dataclass
class DistillReport:
    out_dir: str
    draft_parameters: int
    target_parameters: int
    sequences: int
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)

    def summary(self) -> str:
        return (f"draft -> {repo_path(self.out_dir)}: {self.draft_parameters / 1e6:.1f}M parameters "
                f"(target {self.target_parameters / 1e6:.1f}M), {self.sequences} sequences, {self.steps} steps in "
                f"{self.seconds:.0f}s, final loss {self.losses[-1] if self.losses else float('nan'):.3f}")


def draft_vocabulary(records: list[dict[str, torch.Tensor]], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` tokens the target ranks first most often (sorted ids); special tokens
    it emits (end of sequence) are among them when it emits them."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for rec in records:
        counts += torch.bincount(rec["topk_ids"][:, 0].long(), minlength=vocab)
        counts += torch.bincount(rec["input_ids"], minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


def init_draft(target: Any, layers: tuple[int, ...], token_ids: torch.Tensor) -> SubsetLlamaForCausalLM:
    """A draft made of copies of the target's ``layers``, embeddings, final norm and head rows."""
    tc = target.config
    if max(layers) >= tc.num_hidden_layers:
        raise BuildSpecError(f"init_layers {layers} exceed the target's {tc.num_hidden_layers} layers")
    data = {k: v for k, v in tc.to_dict().items() if k not in ("architectures", "model_type", "transformers_version")}
    data.update(num_hidden_layers=len(layers), draft_vocab_size=int(token_ids.shape[0]))
    config = SubsetLlamaConfig(**data)
    config.architectures = ["SubsetLlamaForCausalLM"]
    draft = SubsetLlamaForCausalLM(config)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        for mine, theirs in zip(draft.model.layers, layers):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[token_ids])
        draft.lm_head.token_ids.copy_(token_ids)
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.generation_config = target.generation_config
    return draft


def _batch(records: list[dict[str, torch.Tensor]], table: torch.Tensor, response_only: bool) -> dict[str, torch.Tensor]:
    """Right-padded inputs, KD targets mapped into the draft vocabulary (zero weight where not
    trained), and the target's hidden states when the data has them."""
    width = max(r["input_ids"].shape[0] for r in records)
    k = records[0]["topk_ids"].shape[1]
    ids = torch.zeros(len(records), width, dtype=torch.long)
    attn = torch.zeros(len(records), width, dtype=torch.long)
    tgt_ids = torch.zeros(len(records), width, k, dtype=torch.long)
    tgt_p = torch.zeros(len(records), width, k)
    with_hidden = all("hidden" in r for r in records)
    tgt_h = torch.zeros(len(records), width, records[0]["hidden"].shape[1]) if with_hidden else None
    for b, r in enumerate(records):
        n = r["input_ids"].shape[0]
        ids[b, :n] = r["input_ids"]
        attn[b, :n] = 1
        if tgt_h is not None:
            tgt_h[b, :n - 1] = r["hidden"].float()
        start = int(r["prompt_length"]) - 1 if response_only else 0
        mapped = table[r["topk_ids"][start:].long()]  # [m, k], -1 outside the draft vocabulary
        p = torch.softmax(r["topk_logits"][start:].float(), -1) * (mapped >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        tgt_ids[b, start:n - 1] = mapped.clamp(min=0)
        tgt_p[b, start:n - 1] = p
    out = {"input_ids": ids, "attention_mask": attn, "target_ids": tgt_ids, "target_p": tgt_p}
    if tgt_h is not None:
        out["target_hidden"] = tgt_h
    return out


def kd_loss(draft: SubsetLlamaForCausalLM, batch: dict[str, torch.Tensor], hidden_weight: float = 0.0) -> torch.Tensor:
    """Cross-entropy against the target's top-K distribution, plus ``hidden_weight`` x the mean
    squared error to the target's last hidden state (a dense signal that speeds learning up)."""
    hidden = draft.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    logq = torch.log_softmax(draft.lm_head.subset_logits(hidden).float(), -1)  # [B, T, V']
    picked = logq.gather(-1, batch["target_ids"])  # [B, T, K]
    per_pos = -(batch["target_p"] * picked).sum(-1)  # [B, T]
    weight = batch["target_p"].sum(-1)  # 1 at trained positions, 0 elsewhere
    loss = (per_pos * weight).sum() / weight.sum().clamp_min(1.0)
    if hidden_weight > 0 and "target_hidden" in batch:
        err = ((hidden.float() - batch["target_hidden"]) ** 2).mean(-1)  # [B, T]
        loss = loss + hidden_weight * (err * weight).sum() / weight.sum().clamp_min(1.0)
    return loss


def _batches(records: list[dict[str, torch.Tensor]], size: int, gen: torch.Generator) -> list[list[int]]:
    """Length-sorted batches (little padding), in random order."""
    order = sorted(range(len(records)), key=lambda i: records[i]["input_ids"].shape[0])
    chunks = [order[i:i + size] for i in range(0, len(order), size)]
    return [chunks[i] for i in torch.randperm(len(chunks), generator=gen).tolist()]


def distill(cfg: DistillConfig, *, progress: bool = True) -> DistillReport:
    """Train the draft and save it to ``cfg.out_dir`` (a loadable HF folder)."""
    from tqdm.auto import tqdm

    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer

    start = time.monotonic()
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target)
    records = [r for r in iter_records(cfg.data_dir) if r["input_ids"].shape[0] > int(r["prompt_length"])]
    if not records:
        raise BuildSpecError(f"{cfg.data_dir} holds no responses to learn from")
    vocab = int(target.config.vocab_size)
    token_ids = draft_vocabulary(records, cfg.draft_vocab, vocab)
    table = torch.full((vocab,), -1, dtype=torch.long)
    table[token_ids] = torch.arange(token_ids.shape[0])
    draft = init_draft(target, tuple(cfg.init_layers), token_ids).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    total = cfg.epochs * math.ceil(len(records) / cfg.batch_size)
    sched = TimedCosine(opt, total, cfg.time_limit_s - (time.monotonic() - start))
    losses: list[float] = []
    with tqdm(total=total, desc="distill", unit="step", disable=not progress) as bar:
        for _ in range(cfg.epochs):
            for chunk in _batches(records, cfg.batch_size, gen):
                if sched.done:
                    break
                loss = kd_loss(draft, _batch([records[i] for i in chunk], table, cfg.response_only), cfg.hidden_weight)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                bar.update()
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if len(losses) < total:
            logger.warning("time limit of %.0fs reached after %d of %d steps", cfg.time_limit_s, len(losses), total)
    save_draft(draft.eval(), load_tokenizer(cfg.target), Path(cfg.out_dir), cfg.save_dtype)
    return DistillReport(out_dir=cfg.out_dir, draft_parameters=sum(p.numel() for p in draft.parameters()),
                         target_parameters=sum(p.numel() for p in target.parameters()), sequences=len(records),
                         steps=len(losses), seconds=time.monotonic() - start, losses=losses[-20:])


def save_draft(draft: SubsetLlamaForCausalLM, tokenizer: Any, out: Path, dtype: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("saved the draft to %s", out)
