"""Trained Medusa heads onto the target, so modelopt exports them with it.

The heads come as one .safetensors file in either layout:

* TensorRT-LLM's: ``medusa_heads.<i>.medusa_layers.<j>.linear.{weight,bias}`` and
  ``medusa_heads.<i>.lm_head.weight``;
* modelopt's HF Medusa model: ``medusa_heads.<i>.<j>.linear.{weight,bias}`` and
  ``medusa_heads.<i>.<num_layers>.weight``.

``modelopt.torch.speculative`` converts the target into a Medusa model with that many heads
and layers; the tensors are then loaded strictly (every head tensor present, shapes equal).
The export writes ``MedusaForCausalLM`` with ``num_medusa_heads`` / ``num_medusa_layers``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from builder.errors import BuildError, BuildSpecError
from builder.spec import MedusaSpec

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
    tensors = normalise_head_names(load_file(str(path)), medusa.num_layers)
    mtsp.convert(model, [("medusa", {"medusa_num_heads": medusa.num_heads, "medusa_num_layers": medusa.num_layers})])
    heads = model.medusa_heads
    reference = heads.state_dict()
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
