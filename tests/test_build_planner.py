"""The memory planner against hand arithmetic, and the precision / TP choices it makes.

Architectures (public numbers, shipped as config-only models):
  Llama-3-70B : hidden 8192, 80 layers, 64 heads, 8 KV heads, head 128, MLP 28672, vocab 128256
  Llama-3-8B  : hidden 4096, 32 layers, 32 heads, 8 KV heads, head 128, MLP 14336, vocab 128256
  Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head 64,  MLP 8192,  vocab 128256, tied
Defaults: batch 8, input 2048, output 512, draft 4 -> 8 x 2564 = 20512 KV tokens; max_num_tokens
8192; workspace 2 GiB. GPUs: H100 81559 MiB, A100-40GB 40960 MiB (no FP8).
"""

from __future__ import annotations

import pytest

from builder.plan.architecture import load_architecture
from builder.errors import DoesNotFitError
from builder.plan.memory import weight_bytes
from builder.plan.planner import plan_deployment
from builder.plan.spec import BuildSpec, GpuTarget, KVCacheDtype, MedusaSpec, ModelSpec, Parallelism, Precision

GIB = 2**30
H100 = 81_559 * 2**20
A100_40 = 40_960 * 2**20
WORKSPACE = 2 * GIB
TOKENS = 8 * (2048 + 512 + 4)
MAX_NUM_TOKENS = 8192
LOGIT_ROWS = 8 * (4 + 1)  # batch x (draft + 1) positions

# ---- parameters, by hand ----------------------------------------------------------------
# 70B, per layer: qkv 8192 x (64 + 2*8)*128, dense 8192 x 8192, gate+up 8192 x 2*28672, down 28672 x 8192
L70_LINEAR = 80 * (8192 * 10240 + 8192 * 8192 + 8192 * 57344 + 28672 * 8192)
L70_EMBED = 128256 * 8192  # embedding; the LM head is as large
L70_NORMS = (2 * 80 + 1) * 8192
L70_OUT_CHANNELS = 80 * (10240 + 8192 + 57344 + 8192)
# 8B, per layer: qkv 4096 x (32 + 16)*128, dense 4096 x 4096, gate+up 4096 x 2*14336, down 14336 x 4096
L8_LINEAR = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096)
L8_EMBED = 128256 * 4096
L8_NORMS = (2 * 32 + 1) * 4096
# 1B, per layer: qkv 2048 x (32 + 16)*64, dense 2048 x 2048, gate+up 2048 x 2*8192, down 8192 x 2048
L1_LINEAR = 16 * (2048 * 3072 + 2048 * 2048 + 2048 * 16384 + 8192 * 2048)
L1_EMBED = 128256 * 2048
L1_NORMS = (2 * 16 + 1) * 2048


def spec(target: str, draft: str | None, gpu: str, count: int = 1, tp: int | None = None, **kw) -> BuildSpec:
    return BuildSpec(target=ModelSpec(target, kw.pop("precision", "auto")),
                     draft=ModelSpec(draft, kw.pop("draft_precision", "auto")) if draft else None,
                     gpu=GpuTarget(gpu, count), parallel=Parallelism(tp_size=tp), **kw)


def test_parameter_counts_match_hand_arithmetic():
    a70, a8, a1 = (load_architecture(n) for n in ("llama-3-70b", "llama-3-8b", "llama-3.2-1b"))
    assert a70.linear_params == L70_LINEAR == 68_451_041_280
    assert a70.total_params == L70_LINEAR + 2 * L70_EMBED + L70_NORMS == 70_553_706_496
    assert a8.total_params == L8_LINEAR + 2 * L8_EMBED + L8_NORMS == 8_030_261_248
    assert a1.total_params == L1_LINEAR + 2 * L1_EMBED + L1_NORMS == 1_498_482_688
    assert a1.hf_params == 1_235_814_400  # the tied LM head counted once, as HF does


def test_seed_arithmetic_70b_plus_8b_at_fp16_is_about_156_gb():
    a70, a8 = load_architecture("llama-3-70b"), load_architecture("llama-3-8b")
    both = weight_bytes(a70, Precision.FP16) + weight_bytes(a8, Precision.FP16)
    assert both == 2 * (70_553_706_496 + 8_030_261_248) == 157_167_935_488
    assert abs(both - 156e9) / 156e9 < 0.01  # the seed's 70B*2 + 8B*2 = 156 GB, within 1%
    assert both > H100  # weights alone exceed one 80 GB H100
    with pytest.raises(DoesNotFitError, match="does not fit"):
        plan_deployment(spec("llama-3-70b", "llama-3-8b", "h100-80gb", precision="fp16", draft_precision="fp16"))


def test_70b_plus_8b_on_one_h100_needs_an_int4_awq_target():
    plan = plan_deployment(spec("llama-3-70b", "llama-3-8b", "h100-80gb"))
    assert (plan.precision_of("target"), plan.precision_of("draft"), plan.kv_cache_dtype, plan.tp) == (
        Precision.INT4_AWQ, Precision.BF16, KVCacheDtype.FP16, 1)
    target, draft = plan.model("target").footprint, plan.model("draft").footprint
    # int4: half a byte per linear weight + a 2-byte scale per 128 weights; embedding, head, norms in 16 bits
    assert target.weights == L70_LINEAR // 2 + 2 * (L70_LINEAR // 128) + 2 * (2 * L70_EMBED + L70_NORMS) == 39_500_398_592
    assert target.kv_cache == TOKENS * 2 * 80 * 8 * 128 * 2 == 6_721_372_160
    assert target.activations == MAX_NUM_TOKENS * (4 * 8192 + 2 * 28672) * 2 + LOGIT_ROWS * 128256 * 4
    assert draft.weights == 2 * 8_030_261_248
    assert draft.kv_cache == TOKENS * 2 * 32 * 8 * 128 * 2 == 2_688_548_864
    assert draft.activations == MAX_NUM_TOKENS * (4 * 4096 + 2 * 14336) * 2 + LOGIT_ROWS * 128256 * 4
    assert plan.total_per_gpu == target.total + draft.total + WORKSPACE == 69_373_960_192
    assert plan.headroom == H100 - 69_373_960_192 and plan.fits
    # why: an fp8 target (with the smallest KV cache and draft) would need 87.47 GB > 85.52 GB
    fp8_need = ((L70_LINEAR + 2 * (2 * L70_EMBED + L70_NORMS)) + TOKENS * 2 * 80 * 8 * 128 + target.activations
                + (L8_LINEAR // 2 + 2 * (L8_LINEAR // 128) + 2 * (2 * L8_EMBED + L8_NORMS))
                + TOKENS * 2 * 32 * 8 * 128 + draft.activations + WORKSPACE)
    assert fp8_need == 87_465_041_920 > H100
    assert f"target fp8 would need {fp8_need / GIB:.1f} GiB" in "\n".join(plan.reasons)


def test_70b_plus_8b_on_two_h100_tp2_keeps_the_target_16_bit():
    plan = plan_deployment(spec("llama-3-70b", "llama-3-8b", "h100-80gb", count=2, tp=2))
    assert (plan.precision_of("target"), plan.precision_of("draft"), plan.tp) == (Precision.BF16, Precision.FP8, 2)
    target, draft = plan.model("target").footprint, plan.model("draft").footprint
    assert target.weights == 2 * 70_553_706_496 // 2
    assert target.kv_cache == TOKENS * 2 * 80 * (8 // 2) * 128 * 2 == 3_360_686_080
    assert target.activations == MAX_NUM_TOKENS * (4 * 8192 + 2 * 28672 // 2) * 2 + LOGIT_ROWS * (128256 // 2) * 4
    assert draft.weights == (L8_LINEAR + 2 * (2 * L8_EMBED + L8_NORMS)) // 2  # fp8 linears, 16-bit rest
    assert draft.kv_cache == TOKENS * 2 * 32 * 4 * 128 * 2
    assert plan.total_per_gpu == target.total + draft.total + WORKSPACE == 83_477_221_376 <= H100
    # a bf16 draft would need 86.97 GB per GPU > 85.52 GB
    bf16_draft = plan.total_per_gpu - draft.weights + 2 * 8_030_261_248 // 2
    assert bf16_draft == 86_966_882_304 > H100
    assert f"draft bf16 would need {bf16_draft / GIB:.1f} GiB" in "\n".join(plan.reasons)


def test_tp_auto_picks_the_smallest_tp_that_keeps_everything_16_bit():
    plan = plan_deployment(spec("llama-3-70b", "llama-3-8b", "h100-80gb", count=4))
    assert (plan.tp, plan.precision_of("target"), plan.precision_of("draft")) == (4, Precision.BF16, Precision.BF16)
    assert any(r.startswith("TP 2 would need") for r in plan.reasons)


def test_8b_plus_1b_on_a100_40gb_tp1_all_16_bit():
    plan = plan_deployment(spec("llama-3-8b", "llama-3.2-1b", "a100-40gb"))
    assert (plan.precision_of("target"), plan.precision_of("draft"), plan.kv_cache_dtype, plan.tp) == (
        Precision.BF16, Precision.BF16, KVCacheDtype.FP16, 1)
    target, draft = plan.model("target").footprint, plan.model("draft").footprint
    assert draft.weights == 2 * (L1_LINEAR + 2 * L1_EMBED + L1_NORMS) == 2_996_965_376
    assert draft.kv_cache == TOKENS * 2 * 16 * 8 * 64 * 2 == 672_137_216
    assert draft.activations == MAX_NUM_TOKENS * (4 * 2048 + 2 * 8192) * 2 + LOGIT_ROWS * 128256 * 4
    assert plan.total_per_gpu == (16_060_522_496 + 2_688_548_864 + target.activations) + draft.total + WORKSPACE
    assert plan.total_per_gpu == 25_747_550_208 and plan.headroom == A100_40 - 25_747_550_208


def test_8b_plus_1b_on_a100_40gb_tp2():
    plan = plan_deployment(spec("llama-3-8b", "llama-3.2-1b", "a100-40gb", count=2, tp=2))
    target, draft = plan.model("target").footprint, plan.model("draft").footprint
    assert target.weights == 8_030_261_248 and draft.weights == 1_498_482_688
    assert target.kv_cache == TOKENS * 2 * 32 * 4 * 128 * 2 and draft.kv_cache == TOKENS * 2 * 16 * 4 * 64 * 2
    assert target.activations == MAX_NUM_TOKENS * (4 * 4096 + 14336) * 2 + LOGIT_ROWS * 64128 * 4
    assert draft.activations == MAX_NUM_TOKENS * (4 * 2048 + 8192) * 2 + LOGIT_ROWS * 64128 * 4
    assert plan.total_per_gpu == 14_148_843_520


def test_70b_plus_8b_on_a100_40gb():
    with pytest.raises(DoesNotFitError, match="A100 40GB has 40.0 GiB"):
        plan_deployment(spec("llama-3-70b", "llama-3-8b", "a100-40gb"))
    plan = plan_deployment(spec("llama-3-70b", "llama-3-8b", "a100-40gb", count=2))
    assert (plan.tp, plan.precision_of("target"), plan.precision_of("draft")) == (2, Precision.INT4_AWQ, Precision.BF16)
    assert any("fp8 skipped" in n and "no FP8 tensor cores" in n for n in plan.notes)
    int8 = (L70_LINEAR + 2 * L70_OUT_CHANNELS + 2 * (2 * L70_EMBED + L70_NORMS)) // 2  # int8 + 16-bit channel scales
    assert int8 == 36_334_903_296
    assert any(r.startswith("target int8_sq would need") for r in plan.reasons)


def test_fp8_kv_cache_halves_the_cache():
    plan = plan_deployment(spec("llama-3-70b", "llama-3-8b", "h100-80gb", kv_cache_dtype="fp8"))
    assert plan.model("target").footprint.kv_cache == TOKENS * 2 * 80 * 8 * 128 * 1


def test_medusa_heads_are_planned_with_the_target():
    s = BuildSpec(target=ModelSpec("llama-3-8b", "bf16"), medusa=MedusaSpec(num_heads=4, num_layers=1),
                  gpu=GpuTarget("h100-80gb"))
    plan = plan_deployment(s)
    heads = plan.model("medusa")
    assert heads.params == 4 * (1 * (4096 * 4096 + 4096) + 4096 * 128256) == 2_168_471_552
    assert heads.footprint.weights == 2 * heads.params and heads.footprint.kv_cache == 0
    assert heads.footprint.activations == 8 * 4 * 128256 * 4


def test_the_cpu_torch_runtime_note_counts_the_cpu_kernels_linear_weights():
    from builder.plan.spec import TorchRuntimeSpec

    cpu = plan_deployment(spec("llama-3.2-1b", None, "h100"))
    assert cpu.precision_of("target") is Precision.BF16
    packed = (L1_LINEAR + 128256 * 2048) * 2 / 2**30  # every decoder linear + the LM head, 16-bit (bf16 plan)
    assert f"+ {packed:.2f} GiB of bfloat16 linear weights for the CPU kernels" in " ".join(cpu.notes)
    fp8 = plan_deployment(spec("llama-3.2-1b", None, "h100", precision="fp8"))
    # fp8: a byte per decoder weight + a float32 scale per output row (16 layers: q, o, down 2048 rows, k, v 512,
    # gate, up 8192), the LM head 16-bit as the checkpoint keeps it
    packed = (L1_LINEAR + 4 * 16 * (3 * 2048 + 2 * 512 + 2 * 8192) + 128256 * 2048 * 2) / 2**30
    assert f"+ {packed:.2f} GiB of fp8 linear weights for the CPU kernels" in " ".join(fp8.notes)
    cuda = plan_deployment(spec("llama-3.2-1b", None, "h100", torch_runtime=TorchRuntimeSpec(device="cuda")))
    assert "CPU kernels" not in " ".join(cuda.notes)  # the row kernels run on CPU float32 only
