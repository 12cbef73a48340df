"""Serving an EAGLE-3 drafter (:mod:`triton_backend.speculation.drafters.eagle3_model`: the layout
``specbuild train-eagle3`` writes and published EAGLE-3 checkpoints use) on the slot engine.

The drafter reads the outputs of the target layers its config names
(``eagle_config.eagle_aux_hidden_state_layer_ids``), concatenated per position ``[3H]``,
which the target's verification pass returns from the same pass (``BatchRow.capture``,
:meth:`~triton_backend.engines.torch.llama_engine.SlotSession.tree_features`). Fed pairs are
``fc``-fused; every later step reads the drafter's own output ``g``, exactly as
``builder.train.eagle3``'s training-time test does. The head ranks the draft vocabulary;
draft id ``d`` is target id ``d + d2t[d]``, and ``q`` (exact sampling) is the drafter's
distribution over target ids, zero outside the draft vocabulary. Sessions, chains, trees and
batching are the EAGLE family's (:class:`~triton_backend.speculation.drafters.eagle.FeatureDrafter`).
"""

from __future__ import annotations

from typing import Any

import torch

from triton_backend.core.errors import ModelLoadError
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.speculation.drafters.eagle import FeatureDrafter, target_kernel
from triton_backend.speculation.drafters.eagle3_model import Eagle3Net, load_eagle3
from triton_backend.core.runtime_config import INT4_GROUP_SIZES, WeightPrecision
from triton_backend.engines.torch.compact_weights import compact_linear
from triton_backend.engines.torch.weight_gemm import load_weight_gemm
from triton_backend.speculation.drafters.eagle3_step import Eagle3Step
from triton_backend.speculation.drafters.eagle_model import EagleKV, TreeStep


_STORED = {torch.float16: WeightPrecision.FLOAT16, torch.bfloat16: WeightPrecision.BFLOAT16}


class Eagle3Drafter(FeatureDrafter):
    """An EAGLE-3 drafter over fused low/mid/high target features, with its own LM head over
    a reduced draft vocabulary (the target's embedding is shared)."""

    def __init__(self, net: Eagle3Net, target: Any, weights: WeightPrecision | None = None) -> None:
        """``target``: the slot engine (:class:`LlamaEngine`: its passes return the capture layers' outputs).
        ``weights``: what the linear weights are held in on the CPU kernels (None: as the file
        stores them; ``RuntimeConfig.drafter_weights``); float32 runs them on the target's row kernel."""
        info = net.info
        if not isinstance(target, LlamaEngine):
            raise ModelLoadError(f"an EAGLE-3 drafter needs the slot engine's target (its capture-layer outputs); "
                                 f"{target!r} is not one (runtime.torch_engine must not be hf)")
        config = target.model.config
        layers = int(config.num_hidden_layers)
        target_hidden = info.target_hidden_size or info.hidden_size
        if info.hidden_size != int(config.hidden_size) or info.vocab_size != target.vocab_size \
                or target_hidden != int(config.hidden_size):
            raise ModelLoadError(f"EAGLE-3 drafter (hidden {info.hidden_size}, target hidden {target_hidden}, vocab "
                                 f"{info.vocab_size}) does not fit the target (hidden {config.hidden_size}, vocab "
                                 f"{target.vocab_size})")
        if any(not 0 <= i < layers for i in info.capture_layers):
            raise ModelLoadError(f"EAGLE-3 capture layers {info.capture_layers} outside the target's {layers} layers")
        self.info = info
        self.capture_layers = tuple(info.capture_layers)
        self.feature_size, self.vocab_size = info.feature_size, info.vocab_size
        self.dtype, self.device = target.model.dtype, target.device
        self.net = net.to(device=self.device, dtype=self.dtype).eval()
        self.embed = target.model.get_input_embeddings().weight.detach()
        self.vocab = (torch.arange(info.draft_vocab_size, device=self.device) + self.net.d2t).to(torch.long)
        params = sum(p.numel() for p in self.net.parameters())
        self.relative_cost = params / max(1, target.num_parameters())
        self.nominal_cost = self.relative_cost  # the parameter ratio: seeded sampling is priced by it
        kernel = target_kernel(target) if (self.dtype == torch.float32 and self.device.type == "cpu") else None
        held = weights or _STORED.get(net.stored_dtype, WeightPrecision.FLOAT32)
        compact = load_weight_gemm() if kernel is not None and held is not WeightPrecision.FLOAT32 else None
        self._step: Eagle3Step | None = None  # the net's forward on a CPU kernel (eagle3_step.py)
        if compact is not None:  # 16-bit as stored (or rounded to it), fp8, int8 or int4: fewer bytes a step reads
            group = self._int4_group(net) if held is WeightPrecision.INT4 else 0
            self._step = Eagle3Step(self.net, lambda w: compact.bind(compact_linear(w, held, group).weight),
                                    f"{compact.name}:{held.value}")
        elif kernel is not None:
            self._step = Eagle3Step(self.net, kernel.bind, kernel.name)
        self.kernel_name = "torch" if self._step is None else f"{kernel.name}+step:{self._step.name}"

    @staticmethod
    def _int4_group(net: Eagle3Net) -> int:
        """The largest int4 group size that divides every linear's input width."""
        widths = {int(m.weight.shape[1]) for m in net.modules() if isinstance(m, torch.nn.Linear)}
        for group in sorted(INT4_GROUP_SIZES, reverse=True):
            if all(w % group == 0 for w in widths):
                return group
        raise ModelLoadError(f"no int4 group of {INT4_GROUP_SIZES} divides the EAGLE-3 drafter's input widths {sorted(widths)}")

    @classmethod
    def from_folder(cls, path: str, target: Any, weights: WeightPrecision | None = None) -> "Eagle3Drafter":
        layers = int(target.model.config.num_hidden_layers)
        return cls(load_eagle3(path, num_target_layers=layers), target, weights)

    def new_cache(self, rows: int, capacity: int = 256) -> EagleKV:
        return EagleKV.empty(self.info, rows, capacity, self.dtype, self.device)  # type: ignore[arg-type]  # same KV fields

    def cost_identity(self) -> str:
        return f"eagle3:{sum(p.numel() for p in self.net.parameters())}:{self.info.draft_vocab_size}:{self.kernel_name}"

    def _feed_net(self, features: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None) -> torch.Tensor:
        # features [B, T, 3H] -> fc -> [B, T, H]; the layer's output g [B, T, H]
        if self._step is not None:
            return self._step(self._step.fc(features), embeds, starts, kv, slots=slots)
        return self.net(self.net.fc(features), embeds, starts, kv, slots=slots)

    def _step_net(self, hidden: torch.Tensor, embeds: torch.Tensor, starts: torch.Tensor, kv: EagleKV,
                  slots: torch.Tensor | None, tree: TreeStep | None = None) -> torch.Tensor:
        if self._step is not None:
            return self._step(hidden, embeds, starts, kv, tree=tree, slots=slots)
        return self.net(hidden, embeds, starts, kv, tree=tree, slots=slots)  # [B, T, H] own outputs in

    def _small_logits(self, features: torch.Tensor) -> torch.Tensor:  # g [B, H] -> [B, draft_vocab]
        if self._step is not None:
            return self._step.logits(features.contiguous())
        return self.net.logits(features.contiguous()).float()


__all__ = ["Eagle3Drafter"]
