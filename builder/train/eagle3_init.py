"""Where an EAGLE-3 training run's drafter starts.

- **Fresh** (the default): random weights, the reduced draft vocabulary computed from the
  training data (:func:`draft_vocabulary`), the LM head from the target's own rows for those
  tokens and the norm from the target's final norm.
- **Fresh from the target's last layer** (``init_from_target``): as fresh, and the decoder layer
  starts from the target's last decoder layer wherever the shapes allow (norms, ``o_proj``, the
  MLP whole; ``q/k/v`` read ``[embedding; fused hidden]`` (``2H``), so the target's weights go
  to the hidden half and the embedding half keeps its random start).
- **Warm** (``init_from``: an EAGLE-3 drafter folder, ``config.json`` + weights as
  :func:`~triton_backend.speculation.drafters.eagle3_model.save_eagle3` writes them): its weights
  and its draft-to-target vocabulary map, unchanged. The map is part of the drafter's weights
  (the LM head's rows are its tokens), so the vocabulary is never recomputed from the new data;
  the drafter must be for this target and read the features' capture layers.
- **Warm with a new vocabulary** (``init_from`` and ``revocab``): the init's body (fc, decoder
  layer, norm) and a draft vocabulary re-picked from this run's data (:func:`revocab`): the LM
  head keeps the init's rows for the tokens both vocabularies hold and starts the new tokens'
  rows from the target's head, as a fresh drafter does. For data unlike the init's (a drafter
  trained on templated prompts, now trained on users' requests) the old vocabulary covers less of
  what the target writes, and a token outside it can never be drafted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from builder.errors import BuildSpecError
from triton_backend.speculation.drafters.eagle3_model import Eagle3Info, Eagle3Net, load_eagle3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetParts:
    config: Any  # the target's Hugging Face config
    embed: torch.Tensor  # [V, H]
    head: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    last_layer: dict[str, torch.Tensor]  # the last decoder layer's weights, by their Llama names


def target_parts(target: str) -> TargetParts:
    """Frozen float32 copies of what a drafter borrows from the target."""
    from triton_backend.engines.torch.model_loading import load_model

    model = load_model(target).eval()
    last = {k: v.detach().float().clone() for k, v in model.model.layers[-1].state_dict().items()}
    return TargetParts(config=model.config, embed=model.get_input_embeddings().weight.detach().float().clone(),
                       head=model.get_output_embeddings().weight.detach().float().clone(),
                       norm=model.model.norm.weight.detach().float().clone(), last_layer=last)


def draft_vocabulary(top1: list[torch.Tensor], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` target ids the target writes most in ``top1`` (ascending) and the share they cover."""
    counts = token_counts(top1, vocab_size)
    size = min(size, vocab_size)
    ids = counts.topk(size).indices.sort().values
    return ids, float(counts[ids].sum()) / max(1, int(counts.sum()))


def token_counts(top1: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for t in top1:
        counts += torch.bincount(t, minlength=vocab_size)
    return counts


def coverage_of(net: Eagle3Net, top1: list[torch.Tensor]) -> float:
    """Share of the trained targets ``top1`` inside ``net``'s draft vocabulary."""
    counts = token_counts(top1, net.info.vocab_size)
    return float(counts[net.t2d].sum()) / max(1, int(counts.sum()))


def fresh_net(parts: TargetParts, top1: list[torch.Tensor], draft_vocab: int, layers: tuple[int, ...], target_name: str,
              seed: int, from_target_layer: bool = False) -> tuple[Eagle3Net, float]:
    """A new drafter over the ``draft_vocab`` tokens the target writes most; its coverage."""
    ids, coverage = draft_vocabulary(top1, draft_vocab, int(parts.config.vocab_size))
    info = Eagle3Info.from_target_config(parts.config, len(ids), layers, target=target_name)
    torch.manual_seed(seed)
    net = Eagle3Net(info)
    net.set_vocab(ids)
    with torch.no_grad():  # start from the target's own LM head rows and final norm
        net.lm_head.weight.copy_(parts.head[ids])
        net.norm.weight.copy_(parts.norm)
    if from_target_layer:
        copy_target_layer(net, parts.last_layer)
    return net, coverage


def copy_target_layer(net: Eagle3Net, layer: dict[str, torch.Tensor]) -> list[str]:
    """Start ``net``'s decoder layer from the target's decoder ``layer``; returns the drafter
    tensors set. A tensor whose shape does not fit is left as it is (logged)."""
    h = net.info.hidden_size
    own = dict(net.midlayer.named_parameters())
    plan = {name: name for name in own if not name.startswith("self_attn.") or name.startswith("self_attn.o_proj")}
    plan["hidden_norm.weight"] = "input_layernorm.weight"  # the target's layer norms the hidden stream
    done: list[str] = []
    with torch.no_grad():
        for mine, theirs in plan.items():
            src = layer.get(theirs)
            if src is not None and src.shape == own[mine].shape:
                own[mine].copy_(src)
                done.append(mine)
        for proj in ("q_proj", "k_proj", "v_proj"):  # [out, 2H]: the hidden half reads what the target's reads
            mine, src = own[f"self_attn.{proj}.weight"], layer.get(f"self_attn.{proj}.weight")
            if src is not None and src.shape == (mine.shape[0], h):
                mine[:, h:].copy_(src)
                done.append(f"self_attn.{proj}.weight[:, H:]")
    skipped = sorted(set(own) - {d.split("[")[0] for d in done})
    logger.info("decoder layer from the target's last layer: %d tensors set, kept random: %s", len(done), skipped)
    return done


@dataclass(frozen=True)
class InitDrafter:
    """A drafter folder to warm-start from, its config checked against the run's settings."""

    folder: Path
    info: Eagle3Info
    num_target_layers: int  # the target's depth (the capture layers of a config that names none)


def read_init(folder: str, target: str, config: Any, draft_vocab: int | None, revocab: bool = False) -> InitDrafter:
    """Check the drafter folder's config against the target (name, vocabulary, widths) and the
    asked draft vocabulary size (None: the folder's; any size with ``revocab``); BuildSpecError on
    a mismatch."""
    root = Path(folder)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise BuildSpecError(f"--init-from {folder}: no config.json (an EAGLE-3 drafter folder is expected)")
    try:
        info = Eagle3Info.from_config_json(json.loads(cfg_file.read_text()), int(config.num_hidden_layers))
    except (ValueError, KeyError, TypeError) as exc:
        raise BuildSpecError(f"--init-from {folder}: not an EAGLE-3 drafter config ({exc})") from None
    name = Path(target).name
    if info.target and info.target != name:
        raise BuildSpecError(f"--init-from {folder} is a drafter for target {info.target!r}, this run's target is "
                             f"{name!r}; warm-start from a drafter of the same target")
    widths = {"vocab_size": (info.vocab_size, int(config.vocab_size)),
              "hidden_size": (info.hidden_size, int(config.hidden_size)),
              "target_hidden_size": (info.target_hidden_size or info.hidden_size, int(config.hidden_size))}
    bad = {k: v for k, v in widths.items() if v[0] != v[1]}
    if bad:
        raise BuildSpecError(f"--init-from {folder} does not fit target {name!r}: "
                             + ", ".join(f"{k} {a} (target {b})" for k, (a, b) in bad.items()))
    if draft_vocab is not None and draft_vocab != info.draft_vocab_size and not revocab:
        raise BuildSpecError(f"--draft-vocab {draft_vocab} disagrees with --init-from {folder} "
                             f"({info.draft_vocab_size} tokens, its vocabulary map is kept); leave --draft-vocab out")
    return InitDrafter(root, info, int(config.num_hidden_layers))


def check_layers(init: InitDrafter, layers: tuple[int, ...]) -> None:
    """BuildSpecError unless the init drafter reads the capture ``layers`` the features hold."""
    if tuple(init.info.capture_layers) != tuple(layers):
        raise BuildSpecError(f"--init-from {init.folder} reads target layers {tuple(init.info.capture_layers)}, the "
                             f"training features hold layers {tuple(layers)}; make features with "
                             f"--capture-layers {','.join(map(str, init.info.capture_layers))}")


def warm_net(init: InitDrafter, layers: tuple[int, ...], target_name: str) -> Eagle3Net:
    """The drafter of ``init`` (float32, trainable), after checking it reads the features' ``layers``."""
    check_layers(init, layers)
    net = load_eagle3(init.folder, torch.float32, num_target_layers=init.num_target_layers)
    if not net.info.target:  # a published drafter names no target: it is this one's now
        net.info = replace(net.info, target=target_name)
    net.train()
    return net


def mapped_head_rows(target_head: torch.Tensor, draft_head: torch.Tensor, ids: torch.Tensor,
                     old_index: torch.Tensor) -> torch.Tensor:
    """Head rows for the draft vocabulary ``ids``: the drafter's own row where it has one
    (``old_index`` >= 0), else the target's row carried into the drafter's space by the linear
    map that best takes the target's rows to the drafter's on the tokens both have (least
    squares). Trained head rows drift from the target's; a raw target row then scores on another
    scale and a new token wins (or never wins) the draft's argmax for the wrong reason."""
    kept = old_index >= 0
    rows = target_head[ids].clone()
    if int(kept.sum()) >= target_head.shape[1]:  # enough shared rows to fit the map
        mapping = torch.linalg.lstsq(target_head[ids[kept]].double(), draft_head[old_index[kept]].double()).solution
        rows[~kept] = (target_head[ids[~kept]].double() @ mapping).to(rows.dtype)
    rows[kept] = draft_head[old_index[kept]]
    return rows


def revocab(net: Eagle3Net, parts: TargetParts, top1: list[torch.Tensor], size: int) -> tuple[Eagle3Net, float]:
    """``net`` over a new draft vocabulary: the ``size`` tokens the target writes most in ``top1``.
    The body is ``net``'s; head rows of tokens ``net`` already drafts are kept, the others start
    from the target's head. Returns the new drafter and its coverage of ``top1``."""
    ids, coverage = draft_vocabulary(top1, size, net.info.vocab_size)
    new = Eagle3Net(replace(net.info, draft_vocab_size=len(ids)))
    body = {k: v for k, v in net.state_dict().items() if not k.startswith("lm_head.") and k not in ("d2t", "t2d")}
    missing, unexpected = new.load_state_dict(body, strict=False)
    if unexpected or set(missing) != {"lm_head.weight", "d2t", "t2d"}:
        raise BuildSpecError(f"re-picking the draft vocabulary: weights do not carry over (missing {missing}, "
                             f"unexpected {unexpected})")
    new.set_vocab(ids)
    old_index = net.target_to_draft(ids)
    kept = old_index >= 0
    with torch.no_grad():
        rows = mapped_head_rows(parts.head, net.lm_head.weight, ids, old_index)
        new.lm_head.weight.copy_(rows)
    logger.info("draft vocabulary re-picked: %d tokens (%d kept from the init's %d), covering %.3f of the training "
                "targets (the init's: %.3f)", len(ids), int(kept.sum()), net.info.draft_vocab_size, coverage,
                coverage_of(net, top1))
    new.train()
    return new, coverage


__all__ = ["InitDrafter", "revocab", "TargetParts", "check_layers", "copy_target_layer", "coverage_of", "draft_vocabulary", "fresh_net",
           "mapped_head_rows", "read_init", "target_parts", "token_counts", "warm_net"]
