"""Loading a model whose linears the slot engine serves in compact weights without its float32 copy.

The full load (Hugging Face ``from_pretrained``) materialises every float32 parameter before the
engine quantizes the linears and :meth:`LlamaEngine.release_float_linears` frees them: its peak is
the float32 model plus the compact copies, so a model whose float32 copy exceeds memory cannot load
although its compact weights fit. Here the module is built with its parameters on the meta device
(no storage) and the folder's safetensors are read one tensor at a time:

- a decoder linear's weight (and the LM head's, where it is served compact and no drafter reads it
  in float) is read, quantized to ``runtime.weights`` by the same code as the full load
  (:func:`~triton_backend.engines.torch.compact_weights.compact_linear`, same float32 values, same
  int4 group) and dropped: its parameter stays meta, as after ``release_float_linears``;
- with a TensorRT-LLM checkpoint, the linears are the checkpoint's own tensors and the decoder
  linears' float weights are not read at all; the embedding and norms are the checkpoint's;
- everything else (embedding, norms, biases, a float LM head, buffers the file holds) is read into
  float32 as the full load reads it.

The peak is then the compact weights plus the float parts plus one tensor's float32 copy and its
quantization temporaries. The engine's logits are bit-identical to the full load's. Where the folder
cannot be read this way (a GGUF file, no safetensors, tensor names other than the module's, an
architecture the slot engine does not cover) :func:`stream_compact_model` returns ``None`` with the
reason logged, and the caller loads in full.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.compact_weights import (HEAD, CompactLinear, compact_linear, head_precision, int4_group,
                                                          linear_names)
from triton_backend.engines.torch.heap import trim_heap
from triton_backend.engines.torch.llama_forward import unsupported_reason
from triton_backend.engines.torch.trtllm_weights import CheckpointWeights, apply_checkpoint, read_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamedModel:
    """A module whose compact-served linears have no float storage (meta), and those linears."""

    model: PreTrainedModel
    compact: dict[str, CompactLinear]


def weight_files(folder: Path) -> dict[str, Path] | None:
    """Each tensor name of the folder's safetensors -> its file; ``None`` when the folder has none.
    A file that is missing, or whose header does not match its size, raises :class:`ModelLoadError` naming it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            files = sorted({folder / file for file in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"weight index {index} is unreadable: {exc}") from None
    if not files:
        return None
    names: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"weight file {path} is missing" + (f" (named in {index.name})" if index.is_file() else ""))
        try:
            with safe_open(str(path), framework="pt") as handle:
                names.update((name, path) for name in handle.keys())
        except Exception as exc:  # safetensors raises its own error types for bad headers / sizes
            raise ModelLoadError(f"weight file {path} is corrupt or truncated ({path.stat().st_size} bytes): {exc}") from None
    return names


class _TensorReader:
    """One tensor at a time from the folder's files. Each read maps the file only while it copies that
    tensor out, so the pages of the file read so far do not stay in the process's memory."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return list(handle.get_slice(name).get_shape())

    def read(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The tensor on ``device``; floating tensors in ``dtype`` (as ``from_pretrained`` casts them)."""
        from safetensors import safe_open

        try:
            with safe_open(str(self.files[name]), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except Exception as exc:  # a missing file or a truncated one: safetensors' own error types
            raise ModelLoadError(f"cannot read tensor {name} from {self.files[name]}: {exc}") from None
        # the tensor safetensors returns views the file's mapping, which lives as long as it does: copy
        # it out (cast, moved or cloned), so a kept tensor holds its own bytes and the mapping goes now
        out = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        return out.clone() if out.data_ptr() == tensor.data_ptr() else out


def _empty_module(folder: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The model's module with every parameter on the meta device (buffers real), float32, eval."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        setattr(module, leaf, torch.nn.Parameter(value, requires_grad=False))
    else:
        module._buffers[leaf] = value


def _not_streamable(config: PretrainedConfig, runtime: RuntimeConfig, files: dict[str, Path] | None) -> str | None:
    if runtime.torch_engine == "hf":
        return "runtime.torch_engine = hf"
    if files is None:
        return "no safetensors weights"
    reason = unsupported_reason(config)
    return None if reason is None else f"the slot engine does not cover it ({reason})"


def stream_compact_model(folder: Path, gguf: str | None, runtime: RuntimeConfig, *,
                         checkpoint: str | Path | None = None, keep_float_head: bool = False) -> StreamedModel | None:
    """The model in ``folder`` with its linears in ``runtime.weights`` (quantized tensor by tensor) or
    the TensorRT-LLM checkpoint's in the folder ``checkpoint`` (its own tensors), the
    float weights of those linears never materialised; ``keep_float_head``: the LM head's float weight
    is read too (a Medusa or EAGLE drafter reads it). ``None`` (reason logged) where the folder cannot
    be streamed, or nothing is compact (float32 weights, no checkpoint)."""
    if runtime.weights is WeightPrecision.FLOAT32 and checkpoint is None:
        return None
    if gguf:
        logger.info("%s: loading the float32 model in full (no streamed load: transformers dequantizes GGUF whole)", gguf)
        return None
    config = AutoConfig.from_pretrained(folder)
    files = weight_files(folder)
    reason = _not_streamable(config, runtime, files)
    if reason is None:
        assert files is not None
        model = _empty_module(folder, config)
        wanted = dict(model.state_dict(keep_vars=True))
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        head = model.get_output_embeddings()
        if tied and isinstance(head, torch.nn.Linear):
            wanted.pop("lm_head.weight", None)
        missing = sorted(n for n, t in wanted.items() if n not in files and isinstance(t, torch.nn.Parameter))
        if missing:
            reason = f"its weight files do not name {len(missing)} of the module's parameters (e.g. {missing[0]})"
    if reason is not None:
        logger.info("%s: loading the float32 model in full (no streamed load: %s)", folder, reason)
        return None
    weights = None
    if checkpoint is not None:
        weights = read_checkpoint(checkpoint, model.config)
    compact = _fill(model, _TensorReader(files), wanted, runtime, checkpoint=weights, keep_float_head=keep_float_head)
    return StreamedModel(model, compact)


def _fill(model: PreTrainedModel, reader: _TensorReader, wanted: dict[str, torch.Tensor], runtime: RuntimeConfig, *,
          checkpoint: CheckpointWeights | None, keep_float_head: bool) -> dict[str, CompactLinear]:
    """Read ``wanted`` into ``model`` (float parts) or into compact linears (returned)."""
    device = torch.device(runtime.device)
    num_layers = len(model.base_model.layers)
    decoder = linear_names(num_layers, head=False)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is not None and bool(getattr(model.config, "tie_word_embeddings", False))
    linear_head = isinstance(head, torch.nn.Linear)
    if checkpoint is not None:
        head_compact = HEAD in checkpoint.linears
        group = 0
    else:
        head_compact = linear_head
        group = (int4_group((reader.shape(f"{n}.weight")[1] for n in decoder), runtime.int4_group_size)
                 if runtime.weights is WeightPrecision.INT4 else 0)
    never_float = {f"{n}.weight" for n in decoder}
    if head_compact and linear_head and not tied and not keep_float_head:
        never_float.add(f"{HEAD}.weight")
    from_checkpoint = set(checkpoint.floats) if checkpoint is not None else set()
    compact: dict[str, CompactLinear] = {}
    with torch.no_grad():
        for name, tensor in wanted.items():
            if name in from_checkpoint:  # filled from the checkpoint below: no need to read the folder's
                _set_tensor(model, name, torch.empty(tensor.shape, dtype=torch.float32, device=device))
                continue
            if checkpoint is not None and name in never_float:
                continue
            if name not in reader.files:  # a buffer the file does not hold keeps its value from the module's init
                continue
            value = reader.read(name, device, torch.float32)
            if name in never_float:
                precision = head_precision(runtime) if name == f"{HEAD}.weight" else runtime.weights
                compact[name.removesuffix(".weight")] = compact_linear(value, precision, group)
                del value
                trim_heap(collect=False)  # the float tensor's pages go back before the next is read
            else:
                _set_tensor(model, name, value)
        if tied and linear_head:
            head.weight = model.get_input_embeddings().weight
        if checkpoint is not None:
            return apply_checkpoint(model, checkpoint)
        if linear_head and HEAD not in compact:  # the head's float weight is kept (tied, or a drafter reads it)
            compact[HEAD] = compact_linear(head.weight.detach(), head_precision(runtime), group)
    total = sum(c.nbytes() for c in compact.values())
    logger.info("streamed load: %d linear layers in %s%s read tensor by tensor: %.1f MiB", len(compact),
                runtime.weights.value, f" (groups of {group})" if group else "", total / 2**20)
    return compact
