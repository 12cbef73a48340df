"""Trained Medusa heads onto the target, so modelopt exports them with it.

The heads come as one .safetensors file in either layout:

* TensorRT-LLM's: ``medusa_heads.<i>.medusa_layers.<j>.linear.{weight,bias}`` and
  ``medusa_heads.<i>.lm_head.weight``;
* modelopt's HF Medusa model: ``medusa_heads.<i>.<j>.linear.{weight,bias}`` and
  ``medusa_heads.<i>.<num_layers>.weight``.

``modelopt.torch.speculative`` converts the target into a Medusa model with that many heads
and layers; the tensors are then loaded strictly (every head tensor present, shapes equal).
The export writes ``MedusaForCausalLM`` with ``num_medusa_heads`` / ``num_medusa_layers``.

Heads trained by ``specbuild train-medusa`` (:mod:`triton_backend.speculation.drafters.medusa_model`) share the
target's LM head and store none: each head's ``lm_head`` is filled from the target's here,
so the TensorRT-LLM checkpoint has every ``medusa_heads.<i>.lm_head.weight``. Their
runtime-only ``medusa_candidate_vocab`` tensor is not exported.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from builder.errors import BuildError, BuildSpecError
from builder.plan.spec import MedusaSpec
from triton_backend.speculation.drafters.medusa_model import CANDIDATE_VOCAB

logger = logging.getLogger(__name__)

_TRTLLM_LAYER = re.compile(r"^medusa_heads\.(\d+)\.medusa_layers\.(\d+)\.linear\.(weight|bias)$")
_TRTLLM_HEAD = re.compile(r"^medusa_heads\.(\d+)\.lm_head\.weight$")
_PREFIX = "medusa_heads."


def normalise_head_names(tensors: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Tensor names in modelopt's layout, relative to ``medusa_heads`` (``<i>.<j>.linear.weight``)."""
    out = {}
    for name, tensor in tensors.items():
        layer, head = _TRTLLM_LAYER.match(name), _TRTLLM_HEAD.match(name)
        if layer:
            key = f"{layer[1]}.{layer[2]}.linear.{layer[3]}"
        elif head:
            key = f"{head[1]}.{num_layers}.weight"
        elif name.startswith(_PREFIX):
            key = name[len(_PREFIX):]
        else:
            raise BuildError(f"unexpected tensor {name!r} in the Medusa heads file")
        out[key] = tensor
    return out


def _check_trained_info(path: Path, medusa: MedusaSpec) -> None:
    """Heads files with specbuild metadata must match the spec's head and layer counts."""
    from safetensors import safe_open

    from triton_backend.speculation.drafters.medusa_model import MedusaHeadsInfo

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if not meta.get("format"):
        return
    info = MedusaHeadsInfo.from_metadata(meta)
    if (info.num_heads, info.num_layers) != (medusa.num_heads, medusa.num_layers):
        raise BuildSpecError(f"{path.name} holds {info.num_heads} heads x {info.num_layers} layers; the build spec "
                             f"asks for {medusa.num_heads} x {medusa.num_layers} (set medusa.num_heads/num_layers)")


def attach_medusa_heads(model: Any, medusa: MedusaSpec) -> None:
    """Convert ``model`` into a modelopt Medusa model and load the trained heads into it."""
    import modelopt.torch.speculative as mtsp
    from safetensors.torch import load_file

    if medusa.source is None:
        raise BuildSpecError("building Medusa needs trained heads: set medusa.source to their .safetensors file "
                             "(untrained heads would propose noise)")
    path = Path(medusa.source)
    if not path.is_file():
        raise BuildSpecError(f"Medusa heads file {path} not found")
    raw = load_file(str(path))
    _check_trained_info(path, medusa)
    raw.pop(CANDIDATE_VOCAB, None)
    tensors = normalise_head_names(raw, medusa.num_layers)
    mtsp.convert(model, [("medusa", {"medusa_num_heads": medusa.num_heads, "medusa_num_layers": medusa.num_layers})])
    heads = model.medusa_heads
    reference = heads.state_dict()
    shared = model.get_output_embeddings().weight.detach()
    for i in range(medusa.num_heads):  # heads that share the target's LM head get a copy of it
        tensors.setdefault(f"{i}.{medusa.num_layers}.weight", shared.clone())
    missing = sorted(set(reference) - set(tensors))
    unexpected = sorted(set(tensors) - set(reference))
    wrong = sorted(k for k in set(reference) & set(tensors) if tuple(reference[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or wrong:
        raise BuildError(f"Medusa heads in {path.name} do not match {medusa.num_heads} heads x {medusa.num_layers} "
                         f"layers on this target: missing {missing[:4]}, unexpected {unexpected[:4]}, "
                         f"wrong shape {wrong[:4]}")
    dtype = next(model.parameters()).dtype
    heads.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    logger.info("attached %d Medusa heads (%d layers each) from %s", medusa.num_heads, medusa.num_layers, path)


def record_medusa_tree(checkpoint_dir: Path, medusa: MedusaSpec) -> dict[str, Any]:
    """Set the checkpoint's ``max_draft_len`` to the trained tree's size (modelopt writes 63)
    and return what the manifest records: heads, layers, tree size and ``medusa_choices``
    (TensorRT-LLM's runtime takes the choices at run time, e.g. ``--medusa_choices``)."""
    import json

    from safetensors import safe_open

    from triton_backend.speculation.drafters.medusa_model import MedusaHeadsInfo

    config_path = checkpoint_dir / "config.json"
    config = json.loads(config_path.read_text())
    out: dict[str, Any] = {"num_medusa_heads": config.get("num_medusa_heads"),
                           "num_medusa_layers": config.get("num_medusa_layers"), "max_draft_len": config.get("max_draft_len")}
    with safe_open(str(medusa.source), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format"):
        choices = MedusaHeadsInfo.from_metadata(meta).medusa_choices
        config["max_draft_len"] = out["max_draft_len"] = len(choices)
        config_path.write_text(json.dumps(config, indent=4) + "\n")
        out["medusa_choices"] = [list(c) for c in choices]
    return out


def copy_runtime_heads(source: Path, out_dir: Path) -> Path | None:
    """Copy heads trained by ``specbuild train-medusa`` for the torch runtime; None for a heads
    file the torch runtime cannot load (no specbuild metadata)."""
    import shutil

    from triton_backend.core.errors import ModelLoadError
    from triton_backend.speculation.drafters.medusa_model import load_medusa

    try:
        load_medusa(source)
    except ModelLoadError as exc:
        logger.warning("the torch runtime will not serve Medusa: %s", exc)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "heads.safetensors"
    shutil.copy2(source, target)
    return target
