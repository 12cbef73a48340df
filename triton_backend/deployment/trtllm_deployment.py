"""Building the ``trtllm`` runtime's decoder from a deployment (``engine_runtime: trtllm``).

Order of checks, so that each failure names its cause on any machine: the engine folders
exist and look like ``trtllm-build`` output; TensorRT-LLM can be imported (else
:data:`~triton_backend.engines.trtllm.engine.TRTLLM_MISSING`); the engines' ``config.json``
agree with each other; then the tokenizer is loaded and the executors start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.engines.trtllm.trtllm_config import TrtllmConfig, TrtllmTargetKind
from triton_backend.engines.trtllm.engine import (
    EngineInfo, TrtllmEngine, check_engine_dir, executor_bindings, read_engine_info,
)
from triton_backend.engines.trtllm.requests import executor_spec
from triton_backend.core.eos import eos_token_ids as read_eos
from triton_backend.core.errors import ModelLoadError, VocabMismatchError
from triton_backend.engines.torch.model_loading import load_tokenizer, resolve_model_path
from triton_backend.speculation.trtllm_loop import EngineDrafter, EngineMedusa, TargetInfo, TrtllmSpeculativeDecoder

logger = logging.getLogger(__name__)


def eos_token_ids(source: str, tokenizer: Any) -> frozenset[int]:
    """The target's end-of-sequence ids: its config, its generation config and its tokenizer."""
    folder, _ = resolve_model_path(source)
    files = [folder / name for name in ("config.json", "generation_config.json")]
    return read_eos(*(json.loads(path.read_text()) for path in files if path.is_file()), tokenizer=tokenizer)


def _check_pair(target: EngineInfo, draft: EngineInfo | None, config: TrtllmConfig) -> None:
    if draft is not None and draft.vocab_size != target.vocab_size:
        raise VocabMismatchError(f"the draft engine's vocabulary ({draft.vocab_size}) differs from the target "
                                 f"engine's ({target.vocab_size}); a draft must share the target's tokenizer")
    if config.target_kind is TrtllmTargetKind.MEDUSA and target.num_medusa_heads < 1:
        raise ModelLoadError(f"the target engine {target.engine_dir} has no Medusa heads (num_medusa_heads), but the "
                             "deployment says it is a Medusa engine")


def build_trtllm_decoder(config: DeploymentConfig) -> TrtllmSpeculativeDecoder:
    trt = config.trtllm
    if trt is None:
        raise ModelLoadError("the trtllm runtime needs the deployment's trtllm section (the engine folders)")
    check_engine_dir(trt.target_engine, "target")
    if trt.draft_engine is not None:
        check_engine_dir(trt.draft_engine, "draft")
    executor_bindings()  # TensorRT-LLM present and loadable, or a ModelLoadError saying so
    target_info = read_engine_info(trt.target_engine, "target")
    draft_info = read_engine_info(trt.draft_engine, "draft") if trt.draft_engine is not None else None
    _check_pair(target_info, draft_info, trt)
    tokenizer = load_tokenizer(config.target)
    medusa = trt.target_kind is TrtllmTargetKind.MEDUSA
    choices = config.medusa_choices if medusa else None
    target = TrtllmEngine(trt.target_engine, "target", executor_spec(trt, target_info.world_size, choices),
                          timeout_s=trt.response_timeout_s)
    info = TargetInfo(name=Path(trt.target_engine).name, vocab_size=target_info.vocab_size,
                      max_context=target_info.max_seq_len, max_input_len=target_info.max_input_len,
                      eos_token_ids=eos_token_ids(config.target, tokenizer))
    draft = None
    if draft_info is not None:
        assert trt.draft_engine is not None
        engine = TrtllmEngine(trt.draft_engine, "draft", executor_spec(trt, draft_info.world_size),
                              timeout_s=trt.response_timeout_s)
        draft = EngineDrafter(engine, relative_cost=draft_info.cost / target_info.cost)
    elif config.draft is not None:
        logger.warning("the deployment names a draft model but no draft engine: the trtllm runtime drafts without it")
    ngram = None
    if config.ngram and not medusa:
        ngram = NgramDrafter(config.speculation.ngram.min_n, config.speculation.ngram.max_n)
    elif config.ngram:
        logger.info("n-gram lookup is not offered: the Medusa engine verifies only its own tree")
    heads = None
    if medusa:
        heads = EngineMedusa(depth=max(len(c) for c in choices) if choices else target_info.num_medusa_heads)
    logger.info("trtllm deployment ready: target engine %s, drafters: %s", target_info.engine_dir,
                ", ".join(d.name for d in (draft, ngram, heads) if d is not None) or "none")
    return TrtllmSpeculativeDecoder(target, info, tokenizer, draft=draft, ngram=ngram, medusa=heads,
                                    speculation=config.speculation, use_draft_logits=trt.use_draft_logits)


__all__ = ["build_trtllm_decoder", "eos_token_ids"]
