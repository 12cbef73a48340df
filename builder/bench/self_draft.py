"""``specbuild bench --rows self-draft=int8,int4``: rows whose draft is the target itself at a cheaper
weight precision (:mod:`triton_backend.deployment.self_draft`), beside the other rows.

Each precision's draft engine is built over the bench decoder's own float32 target (its loaded
model quantized at load, no second load); its rows share the target engine with every other row,
so their outputs are checked identical to the same ``plain`` row. With n-gram lookup deployed (and
``config.auto``), each precision also gets an ``auto`` row drafting from the self draft or the
n-gram match per round. ``selfdraft_chat_x_plain`` is
the best self-draft row's chat speed-up over plain among those whose outputs were identical.
"""

from __future__ import annotations

import logging
from typing import Any

from builder.bench.config import BenchConfig
from builder.bench.rows import OursRow, Row
from triton_backend.core.config import DraftLengthConfig, SpeculationConfig, SpeculationMode
from triton_backend.core.runtime_config import WeightPrecision
from triton_backend.deployment.deployment_config import SelfDraftConfig
from triton_backend.deployment.self_draft import self_draft_engine, self_drafter
from triton_backend.speculation.drafters.protocol import Drafter
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.speculation.pass_cost import runtime_settings

logger = logging.getLogger(__name__)

HEADLINE_KEY = "selfdraft_chat_x_plain"


def self_draft_rows(config: BenchConfig, decoder: SpeculativeDecoder) -> list[Row]:
    """Per precision in ``config.self_draft`` and draft length in ``config.self_draft_k``: a row
    drafting with the target at that precision (the gain rule pausing it where it does not pay)."""
    rows: list[Row] = []
    target = decoder.target
    for precision in config.self_draft:
        self_draft = SelfDraftConfig(precision=WeightPrecision(precision))
        engine = self_draft_engine(target.model, target.runtime, self_draft, name=target.name,
                                   eos_token_ids=sorted(target.eos_token_ids))
        drafter = self_drafter(engine, target, self_draft, settings=runtime_settings(target.runtime))
        own = SpeculativeDecoder(target, decoder.tokenizer, drafters={SpeculationMode.DRAFT: drafter})
        info = {"kind": "ours", "precision": self_draft.precision.value, "draft_cost": round(drafter.relative_cost, 4),
                "context": self_draft.context.value}
        for k in config.self_draft_k:
            speculation = SpeculationConfig(method=SpeculationMode.DRAFT, draft_length=DraftLengthConfig(num_draft_tokens=k))
            rows.append(OursRow(f"self-{self_draft.precision.value} k={k}", own, speculation,
                                {**info, "method": "draft", "draft": "self", "k": k, "strategy": "chain"}))
        rows += _auto_rows(config, decoder, drafter, self_draft, info)
    return rows


def _auto_rows(config: BenchConfig, decoder: SpeculativeDecoder, drafter: Drafter, self_draft: SelfDraftConfig,
               info: dict[str, Any]) -> list[Row]:
    """Per self-draft length ``k``: ``auto self-<precision> k=K``, ``auto`` with the self draft as
    its model drafter beside the bench decoder's n-gram lookup (per round and per request: the
    match, the draft or plain; both drafting at most ``k``); none without ``config.auto`` or lookup."""
    ngram = decoder.drafters.get(SpeculationMode.NGRAM)
    if not config.auto or ngram is None:
        return []
    both = SpeculativeDecoder(decoder.target, decoder.tokenizer,
                              drafters={SpeculationMode.DRAFT: drafter, SpeculationMode.NGRAM: ngram})
    rows: list[Row] = []
    for k in config.self_draft_k:
        speculation = SpeculationConfig(method=SpeculationMode.AUTO, draft_length=DraftLengthConfig(num_draft_tokens=k),
                                        auto_drafter=SpeculationMode.DRAFT)
        rows.append(OursRow(f"auto self-{self_draft.precision.value} k={k}", both, speculation,
                            {**info, "method": "auto", "model_drafter": "draft", "self_draft": self_draft.precision.value,
                             "k": k, "strategy": "auto"}))
    return rows


def self_draft_headline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``selfdraft_chat_x_plain``: the best chat speed-up over plain of the self-draft rows whose
    outputs equal plain decoding's (none written when no such row ran)."""
    chat = [e for e in rows if e.get("draft") == "self" and e.get("method") == "draft" and e["workload"] == "chat"
            and e.get("speedup_vs_plain") is not None]
    differing = [e["row"] for e in chat if not e["identical_to_plain"]]
    if differing:
        logger.error("self-draft rows %s differ from plain decoding: not counted", differing)
    exact = [e for e in chat if e["identical_to_plain"]]
    if not exact:
        return {}
    best = max(exact, key=lambda e: e["speedup_vs_plain"])
    logger.info("%s from the %s row", HEADLINE_KEY, best["row"])
    return {HEADLINE_KEY: float(best["speedup_vs_plain"])}


__all__ = ["HEADLINE_KEY", "self_draft_headline", "self_draft_rows"]
