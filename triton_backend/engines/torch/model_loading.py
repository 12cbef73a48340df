"""Loading causal LMs for the torch runtime: a reference name, a HF directory or a GGUF file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import triton_backend.engines.torch.draft_arch  # noqa: F401  (registers the reduced-vocabulary draft architecture)
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.engines.torch.compact_weights import CompactLinear
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.llama_forward import unsupported_reason
from triton_backend.engines.torch.hf_engine import TorchEngine
from triton_backend.engines.torch.streamed_loading import StreamedModel, stream_compact_model
from triton_backend.core.eos import eos_token_ids
from triton_backend.core.errors import ModelLoadError
from triton_backend.core.reference_model import REFERENCE_MODELS, ensure_reference_model, fetch_gguf

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(source: str | Path) -> tuple[Path, str | None]:
    """``(directory, gguf_file or None)`` for a reference model name, a directory or a .gguf path."""
    text = str(source)
    if text in REFERENCE_MODELS:
        return ensure_reference_model(text), None
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
        return path, None
    raise ModelLoadError(
        f"model {text!r} not found: give a reference model name ({', '.join(sorted(REFERENCE_MODELS))}), "
        "a Hugging Face model directory or a .gguf file"
    )


def gguf_source(source: str | Path) -> Path | None:
    """The GGUF file ``source``'s float32 weights are the dequantization of: a reference model's
    (fetched, verified), a ``.gguf`` path itself; ``None`` for a Hugging Face directory."""
    text = str(source)
    if text in REFERENCE_MODELS:
        return fetch_gguf(REFERENCE_MODELS[text])
    path = Path(text).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def gguf_compact(source: str | Path, config: Any, runtime: RuntimeConfig) -> dict[str, CompactLinear] | None:
    """The linears of ``source``'s GGUF file from its own blocks where they serve ``runtime.weights``
    (Q4_0 / Q4_1 decoder linears: int4; Q8_0: int8; :mod:`~triton_backend.engines.torch.gguf_blocks`):
    the very float32 weights the dequantized model holds, not a requantization of them. The LM head
    from its blocks too where ``runtime.quantize_lm_head`` (else the engine quantizes it as usual);
    ``None`` where there is no GGUF, its blocks are of other types, or an int4 group size other than the
    blocks' 32 was asked for."""
    from triton_backend.engines.torch.gguf_blocks import BLOCK, gguf_compact_linears, gguf_precision

    if runtime.weights not in (WeightPrecision.INT4, WeightPrecision.INT8) or runtime.torch_engine == "hf":
        return None
    if runtime.weights is WeightPrecision.INT4 and runtime.int4_group_size not in (0, BLOCK):
        return None
    path = gguf_source(source)
    if path is None or gguf_precision(path, config) is not runtime.weights:
        return None
    return gguf_compact_linears(path, config, head=runtime.quantize_lm_head)


def load_config(source: str | Path) -> Any:
    folder, gguf = resolve_model_path(source)
    kwargs = {"gguf_file": gguf} if gguf else {}
    return AutoConfig.from_pretrained(folder, **kwargs)


def load_tokenizer(source: str | Path) -> Any:
    folder, gguf = resolve_model_path(source)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as exc:  # transformers raises many types; report ours with the cause
        raise ModelLoadError(f"could not load a tokenizer from {folder}: {exc}") from exc
    # byte-level BPE: the WordPiece clean-up would strip spaces before punctuation
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def load_model(source: str | Path, runtime: RuntimeConfig | None = None) -> PreTrainedModel:
    runtime = runtime or RuntimeConfig()
    folder, gguf = resolve_model_path(source)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[runtime.dtype], **kwargs)
    except Exception as exc:  # missing/corrupt weights surface as several exception types
        problem = None if gguf else weight_file_problem(folder)
        raise ModelLoadError(problem or f"could not load model weights from {folder}: {exc}") from exc
    return model


def weight_file_problem(folder: Path) -> str | None:
    """What is wrong with a model folder's safetensors weights, naming the file; ``None`` if
    every file the folder (or its index) names is present and its header matches its size."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            return f"weight index {index} is unreadable: {exc}"
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors")) or ["model.safetensors"]
        if names == ["model.safetensors"] and not (folder / names[0]).exists():
            if any((folder / n).exists() for n in ("pytorch_model.bin", "model.gguf")):
                return None
    for name in names:
        path = folder / name
        if not path.is_file():
            return f"weight file {path} is missing" + (f" (named in {index.name})" if index.is_file() else "")
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types for bad headers / sizes
            return f"weight file {path} is corrupt or truncated ({path.stat().st_size} bytes): {exc}"
    return None


def eos_ids(model: PreTrainedModel, tokenizer: Any) -> list[int]:
    """The model's EOS ids (its generation config and config, else its tokenizer's)."""
    return sorted(eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer=tokenizer))


def make_torch_engine(model: PreTrainedModel, *, name: str = "model", runtime: RuntimeConfig | None = None,
                      eos_token_ids: Sequence[int] | None = None, max_context: int | None = None,
                      checkpoint: str | Path | None = None) -> LlamaEngine | TorchEngine:
    """The torch runtime's engine for ``model``: the slot engine (compact Llama forward, static
    KV cache) where it covers the architecture, else the Hugging Face-wrapped engine (logged).
    ``runtime.torch_engine`` forces one (``llama`` refuses a model it does not cover). ``checkpoint``:
    a TensorRT-LLM checkpoint whose linear weights the slot engine serves (its float tensors are
    copied into ``model``); compact weights (a checkpoint, ``runtime.weights``) need the slot engine."""
    runtime = runtime or RuntimeConfig()
    reason = unsupported_reason(model.config) if runtime.torch_engine != "hf" else "runtime.torch_engine = hf"
    if reason is None:
        compact = None
        if checkpoint is not None:
            from triton_backend.engines.torch.trtllm_weights import apply_checkpoint, read_checkpoint

            compact = apply_checkpoint(model, read_checkpoint(checkpoint, model.config))
        return LlamaEngine(model, name=name, runtime=runtime, eos_token_ids=eos_token_ids, max_context=max_context,
                           compact=compact)
    if runtime.torch_engine == "llama":
        raise ModelLoadError(f"runtime.torch_engine = llama, but the compact forward does not cover {name}: {reason}")
    if checkpoint is not None or runtime.weights is not WeightPrecision.FLOAT32:
        raise ModelLoadError(f"{name}: {runtime.weights.value} weights / a checkpoint's weights run on the slot engine "
                             f"only, which does not cover this model: {reason}")
    logger.info("%s runs on the Hugging Face-wrapped engine (%s)", name, reason)
    return TorchEngine(model, name=name, runtime=runtime, eos_token_ids=eos_token_ids, max_context=max_context)


def load_engine(source: str | Path, runtime: RuntimeConfig | None = None, *, name: str | None = None,
                checkpoint: str | Path | None = None, keep_float: bool = False, keep_float_head: bool = False,
                eos_token_ids: Sequence[int] | None = None) -> tuple[LlamaEngine | TorchEngine, Any]:
    """A torch engine (see :func:`make_torch_engine`) and its tokenizer. The model is this engine's
    alone, so where the engine holds compact linears their float weights are never kept: the load
    streams (:mod:`~triton_backend.engines.torch.streamed_loading`: the float32 copy of those linears
    is never materialised, one tensor at a time is read) or, where the folder cannot be streamed, loads
    in full and releases them (:meth:`LlamaEngine.release_float_linears`). Unless ``keep_float``
    (the caller builds on the model's float layers, e.g. a layer-skip draft: loads in full, keeps
    them) or, for the LM head, ``keep_float_head`` (a drafter reads the float head: Medusa, EAGLE).
    ``eos_token_ids``: the engine's EOS ids (default: the model's own)."""
    runtime = runtime or RuntimeConfig()
    tokenizer = load_tokenizer(source)
    name = name or Path(str(source)).name
    blocks = _gguf_blocks(source, runtime) if checkpoint is None else None
    streamed = None if keep_float or blocks is not None else _streamed(source, runtime, checkpoint, keep_float_head)
    if blocks is not None:
        model = load_model(source, runtime)
        eos = eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids
        engine = LlamaEngine(model, name=name, runtime=runtime, eos_token_ids=eos, compact=with_head(model, blocks, runtime))
        if not keep_float:
            engine.release_float_linears(keep_head=keep_float_head)
    elif streamed is not None:
        eos = eos_ids(streamed.model, tokenizer) if eos_token_ids is None else eos_token_ids
        engine: LlamaEngine | TorchEngine = LlamaEngine(streamed.model, name=name, runtime=runtime, eos_token_ids=eos,
                                                        compact=streamed.compact)
    else:
        model = load_model(source, runtime)
        eos = eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids
        engine = make_torch_engine(model, name=name, runtime=runtime, eos_token_ids=eos, checkpoint=checkpoint)
        if isinstance(engine, LlamaEngine) and not keep_float:
            engine.release_float_linears(keep_head=keep_float_head)
    logger.info("loaded %r", engine)
    return engine, tokenizer


def _gguf_blocks(source: str | Path, runtime: RuntimeConfig) -> dict[str, CompactLinear] | None:
    """:func:`gguf_compact` where the slot engine covers the model (logged when used)."""
    config = load_config(source)
    if unsupported_reason(config) is not None:
        return None
    compact = gguf_compact(source, config, runtime)
    if compact is not None:
        logger.info("%s: %s linears from the GGUF file's own blocks (the float32 model's exact weights)", source,
                    runtime.weights.value)
    return compact


def with_head(model: PreTrainedModel, compact: dict[str, CompactLinear], runtime: RuntimeConfig) -> dict[str, CompactLinear]:
    """``compact`` (e.g. :func:`gguf_compact`'s) with the LM head in the precision a load quantizes it to where the blocks left it out."""
    from triton_backend.engines.torch.compact_weights import HEAD, compact_linear, head_precision

    head = model.get_output_embeddings()
    if HEAD in compact or not isinstance(head, torch.nn.Linear):
        return compact
    with torch.no_grad():
        return {**compact, HEAD: compact_linear(head.weight.detach(), head_precision(runtime))}


def _streamed(source: str | Path, runtime: RuntimeConfig, checkpoint: str | Path | None,
              keep_float_head: bool) -> StreamedModel | None:
    """The streamed load of ``source`` where it applies (see :func:`stream_compact_model`)."""
    folder, gguf = resolve_model_path(source)
    return stream_compact_model(folder, gguf, runtime, checkpoint=checkpoint, keep_float_head=keep_float_head)


def layer_skip_draft(model: PreTrainedModel, keep_layers: Sequence[int]) -> PreTrainedModel:
    """A self-speculative draft: the target with only ``keep_layers`` of its decoder layers
    (layer 0 always among them), sharing the target's parameters (no copy), its final norm
    and LM head. It shares the tokenizer by construction: the cheapest real draft for a
    model with no packaged sibling. Each kept layer keeps its own slot in the draft's KV
    cache, so the draft's cache is independent of the target's."""
    config = model.config
    total = int(config.num_hidden_layers)
    keep = sorted(set(int(i) for i in keep_layers))
    if not keep or keep[0] != 0 or keep[-1] >= total or len(keep) >= total:
        raise ValueError(f"keep_layers must include layer 0, lie in [0, {total}) and drop at least one layer; got {keep}")
    with torch.device("meta"):
        draft = type(model)(config)
    base, dbase = model.base_model, draft.base_model
    dbase.embed_tokens = base.embed_tokens
    dbase.layers = torch.nn.ModuleList([base.layers[i] for i in keep])
    dbase.norm = base.norm
    dbase.rotary_emb = base.rotary_emb
    draft.lm_head = model.lm_head
    draft.generation_config = model.generation_config
    return draft.eval()
