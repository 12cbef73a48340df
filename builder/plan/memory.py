"""GPU memory arithmetic: weights per precision, KV cache, activations, per GPU under TP/PP.

All figures are bytes on the GPU, as a TensorRT-LLM engine holds them:

* Weights. Decoder-block linears take the model precision: 2 bytes/param (fp16, bf16),
  1 (fp8), 1 + a 16-bit scale per output channel (int8_sq), 0.5 + a 16-bit scale per group
  of 128 inputs, or 64 where the widths do not split into 128 (int4_awq, :func:`int4_group_size`). Embedding, LM head, norms and biases stay 16-bit (modelopt keeps
  them unquantized). Per-tensor scalars and the AWQ/SmoothQuant per-input-channel vectors are
  left out (under 0.1%). Under TP x PP every GPU holds 1/(TP*PP) of the weights.
* KV cache: max_batch x (max_input + max_output + max_draft) tokens x 2 (K, V) x layers/PP x
  ceil(kv_heads/TP) x head_dim x (2 bytes fp16, 1 byte fp8/int8), for the target and for the draft.
* Activations of each engine: max_num_tokens x (4 x hidden + 2 x intermediate/TP) 16-bit
  values, plus float32 logits for max_batch x (max_draft + 1) positions x vocab/TP.
* Medusa heads: num_heads x (num_layers x (hidden^2 + hidden) + hidden x vocab) at the
  target's precision, and their logits (max_batch x num_heads x vocab/TP float32).
* EAGLE: ``num_eagle_layers`` EagleNets, each ``fc`` (2 hidden -> hidden) + one decoder layer of
  the target's shapes + its own copy of the embedding and LM head, 16-bit (the drafter is not
  quantized); one more KV-cache layer (the nets share it); float32 logits for max_batch x
  max_draft positions x vocab/TP.
* A fixed workspace per GPU (CUDA context, cuBLAS/TensorRT workspaces): ``workspace_gib``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from builder.plan.architecture import ModelArchitecture
from builder.plan.spec import EagleSpec, KVCacheDtype, Limits, MedusaSpec, Precision

if TYPE_CHECKING:
    from triton_backend.core.runtime_config import WeightPrecision

INT4_GROUP_SIZE = 128  # TensorRT-LLM's AWQ default; 64 where a width does not split into it
INT4_GROUP_SIZES = (128, 64)  # what the planner tries, in order
FLOAT_BYTES = 2  # fp16/bf16 for everything left unquantized
SCALE_BYTES = 2  # per-channel / per-group scales as the engine holds them
LOGIT_BYTES = 4  # logits are gathered in float32


def int4_group_size(arch: ModelArchitecture, tp: int = 1, *, medusa_heads: bool = False) -> int | None:
    """The AWQ group size for this model at this TP size: 128 where every linear's input width per
    GPU splits into groups of 128, else 64 where they split into 64, else ``None`` (INT4-AWQ impossible)."""
    widths = [lin.shard(tp).in_features for lin in arch.layer_linears()] + ([arch.hidden_size] if medusa_heads else [])
    return next((g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths)), None)


def linear_weight_bytes(params: int, out_channels: int, precision: Precision, group: int = INT4_GROUP_SIZE) -> int:
    """Bytes of linear weights holding ``params`` values over ``out_channels`` outputs (int4: in
    groups of ``group`` inputs)."""
    if precision.is_float:
        return FLOAT_BYTES * params
    if precision is Precision.FP8:
        return params
    if precision is Precision.INT8_SQ:
        return params + SCALE_BYTES * out_channels
    if precision is Precision.INT4_AWQ:
        return params // 2 + SCALE_BYTES * (params // group)
    raise ValueError(f"precision {precision.value} has no size; resolve auto first")


def weight_bytes(arch: ModelArchitecture, precision: Precision, tp: int = 1) -> int:
    """All of a model's weights at ``precision`` (whole model, before TP/PP; int4's group size as at ``tp``)."""
    group = int4_group_size(arch, tp) or INT4_GROUP_SIZE
    linears = linear_weight_bytes(arch.linear_params, arch.linear_out_channels, precision, group)
    return linears + FLOAT_BYTES * arch.unquantized_params


def medusa_params(arch: ModelArchitecture, medusa: MedusaSpec) -> int:
    h, v = arch.hidden_size, arch.vocab_size
    return medusa.num_heads * (medusa.num_layers * (h * h + h) + h * v)


def medusa_weight_bytes(arch: ModelArchitecture, medusa: MedusaSpec, precision: Precision) -> int:
    h, v, n, layers = arch.hidden_size, arch.vocab_size, medusa.num_heads, medusa.num_layers
    params = n * (layers * h * h + h * v)
    outs = n * (layers * h + v)
    return linear_weight_bytes(params, outs, precision) + FLOAT_BYTES * n * layers * h  # + biases


def eagle_params(arch: ModelArchitecture, eagle: EagleSpec) -> int:
    """Parameters of every EagleNet TensorRT-LLM builds (their embedding and LM-head copies included)."""
    h, d = arch.hidden_size, arch.head_dim
    attention = h * arch.num_heads * d * 2 + 2 * h * arch.num_kv_heads * d
    layer = 2 * h * h + h + attention + 3 * h * arch.intermediate_size + h
    return eagle.num_eagle_layers * (layer + 2 * h * arch.vocab_size)


def eagle_footprint(arch: ModelArchitecture, eagle: EagleSpec, kv: KVCacheDtype, limits: Limits,
                    tp: int, pp: int) -> Footprint:
    one_layer = kv_bytes_per_gpu(replace(arch, num_layers=1), kv, limits, tp, 1)
    logits = limits.max_batch_size * limits.max_draft_len * math.ceil(arch.vocab_size / tp) * LOGIT_BYTES
    return Footprint(weights=math.ceil(FLOAT_BYTES * eagle_params(arch, eagle) / tp), kv_cache=one_layer,
                     activations=logits)


def tokens_per_sequence(limits: Limits) -> int:
    return limits.max_input_len + limits.max_output_len + limits.max_draft_len


def kv_bytes_per_gpu(arch: ModelArchitecture, kv: KVCacheDtype, limits: Limits, tp: int, pp: int) -> int:
    heads_per_gpu = math.ceil(arch.num_kv_heads / tp)  # fewer KV heads than GPUs: replicated
    layers_per_gpu = math.ceil(arch.num_layers / pp)
    per_token = 2 * layers_per_gpu * heads_per_gpu * arch.head_dim * kv.bytes
    return limits.max_batch_size * tokens_per_sequence(limits) * per_token


def activation_bytes_per_gpu(arch: ModelArchitecture, limits: Limits, tp: int) -> int:
    hidden_states = limits.max_num_tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size // tp) * FLOAT_BYTES
    logits = limits.max_batch_size * (limits.max_draft_len + 1) * math.ceil(arch.vocab_size / tp) * LOGIT_BYTES
    return hidden_states + logits


def medusa_activation_bytes_per_gpu(arch: ModelArchitecture, medusa: MedusaSpec, limits: Limits, tp: int) -> int:
    return limits.max_batch_size * medusa.num_heads * math.ceil(arch.vocab_size / tp) * LOGIT_BYTES


@dataclass(frozen=True)
class Footprint:
    """One model's memory on each GPU of its TP x PP group."""

    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def model_footprint(arch: ModelArchitecture, precision: Precision, kv: KVCacheDtype, limits: Limits,
                    tp: int, pp: int) -> Footprint:
    return Footprint(weights=math.ceil(weight_bytes(arch, precision, tp) / (tp * pp)),
                     kv_cache=kv_bytes_per_gpu(arch, kv, limits, tp, pp),
                     activations=activation_bytes_per_gpu(arch, limits, tp))


def medusa_footprint(arch: ModelArchitecture, medusa: MedusaSpec, precision: Precision, limits: Limits,
                     tp: int, pp: int) -> Footprint:
    return Footprint(weights=math.ceil(medusa_weight_bytes(arch, medusa, precision) / (tp * pp)), kv_cache=0,
                     activations=medusa_activation_bytes_per_gpu(arch, medusa, limits, tp))


def decode_step_ms(weights_per_gpu: int, bandwidth_gbps: float) -> float:
    """Lower bound of one decode step when memory-bound: every weight byte is read once."""
    return weights_per_gpu / (bandwidth_gbps * 1e9) * 1e3


def row_kernel_packed_bytes(arch: ModelArchitecture) -> int:
    """The CPU row kernel's copy of the weights (float32, one thread: the torch runtime's default
    on CPU, :mod:`triton_backend.engines.torch.row_gemm`): every decoder linear and the LM head, packed
    once into panels and held beside the weights."""
    return (arch.linear_params + arch.lm_head_params) * 4


def torch_linear_bytes(arch: ModelArchitecture, weights: "WeightPrecision", *, head: "WeightPrecision",
                       group: int = 0, input_scales: bool = False) -> int:
    """What the torch runtime's slot engine holds for its decoder linears and LM head on the CPU
    kernels (one thread), beside the model's float parameters: the float32 row kernel's panels, or
    the compact weights of :mod:`triton_backend.engines.torch.weight_gemm` -- values in panels of 32
    output columns (padded), float32 scales per output channel (int8, fp8) or per group of ``group``
    inputs and padded column (int4). ``head``: the LM head's precision (a checkpoint's is 16-bit);
    ``input_scales``: every decoder linear holds a float32 factor per input (AWQ / SmoothQuant checkpoints)."""
    from triton_backend.core.runtime_config import WeightPrecision

    def one(n: int, k: int, precision: WeightPrecision) -> int:
        padded = -(-n // 32) * 32
        if precision in (WeightPrecision.INT8, WeightPrecision.FP8):
            return padded * k + 4 * n
        if precision is WeightPrecision.INT4:
            return padded * k // 2 + 4 * padded * (k // group)
        return padded * k * (4 if precision is WeightPrecision.FLOAT32 else 2)

    def layer(n: int, k: int) -> int:
        return one(n, k, weights) + (4 * k if input_scales else 0)

    h, d = arch.hidden_size, arch.head_dim
    shapes = [(arch.num_heads * d, h), (arch.num_kv_heads * d, h), (arch.num_kv_heads * d, h), (h, arch.num_heads * d),
              (arch.intermediate_size, h), (arch.intermediate_size, h), (h, arch.intermediate_size)]
    return arch.num_layers * sum(layer(n, k) for n, k in shapes) + one(arch.vocab_size, h, head)


def torch_weight_precision(precision: Precision) -> "WeightPrecision":
    """What the torch runtime's CPU slot engine holds a plan's linears in: 16-bit for fp16/bf16,
    int8 (weight-only) for int8_sq, int4 for int4_awq, fp8 e4m3 (weight-only) for fp8 (float32 for an
    unresolved ``auto``)."""
    from triton_backend.core.runtime_config import WeightPrecision

    return {Precision.FP16: WeightPrecision.FLOAT16, Precision.BF16: WeightPrecision.BFLOAT16,
            Precision.INT8_SQ: WeightPrecision.INT8, Precision.INT4_AWQ: WeightPrecision.INT4,
            Precision.FP8: WeightPrecision.FP8}.get(precision, WeightPrecision.FLOAT32)


def torch_checkpoint_linear_bytes(arch: ModelArchitecture, precision: Precision, group: int | None) -> int:
    """:func:`torch_linear_bytes` of the torch runtime serving this precision's exported checkpoint
    (linears as exported, the LM head 16-bit, AWQ / SmoothQuant input factors).
    A ``--torch-only`` build quantizes at load instead (the head 16-bit too): this less the input factors."""
    from triton_backend.core.runtime_config import WeightPrecision

    weights = torch_weight_precision(precision)
    if weights is WeightPrecision.FLOAT32:
        return torch_linear_bytes(arch, weights, head=weights)
    return torch_linear_bytes(arch, weights, head=WeightPrecision.FLOAT16, group=group or 0,
                              input_scales=precision in (Precision.INT4_AWQ, Precision.INT8_SQ))


def torch_float_bytes(arch: ModelArchitecture, *, compact: bool, float_head: bool = False) -> int:
    """The float32 parameters the torch runtime's CPU slot engine keeps (a tied LM head once). With
    compact linears the loader releases their float weights (``LlamaEngine.release_float_linears``):
    the embedding, norms and biases stay, and the LM head where it is the embedding or ``float_head``
    (a Medusa or EAGLE drafter reads it). Else every parameter."""
    if not compact:
        return arch.hf_params * 4
    kept = arch.embedding_params + arch.norm_params + arch.bias_params
    if float_head and not arch.tie_word_embeddings:
        kept += arch.lm_head_params
    return kept * 4


def torch_runtime_bytes(arch: ModelArchitecture, dtype_bytes: int, slots: int, max_seq_len: int) -> tuple[int, int]:
    """``(weights, kv_cache)`` bytes the torch runtime's slot engine holds for one model (CPU or
    CUDA): every parameter at ``dtype_bytes`` and the static KV cache of ``slots`` x
    ``max_seq_len`` positions (:mod:`triton_backend.engines.torch.kv_cache`)."""
    from triton_backend.engines.torch.kv_cache import kv_cache_bytes

    kv = kv_cache_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim, slots, max_seq_len, dtype_bytes)
    return arch.total_params * dtype_bytes, kv

