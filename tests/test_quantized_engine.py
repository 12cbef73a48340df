"""The slot engine on compact weights (int8, int4, fp8, float16, bfloat16; engines/torch/compact_weights.py):
the same exactness as float32 on the row kernel -- every row bit-identical batched or alone, a verify
chain bit-identical to decoding step by step -- against plain decoding of the same precision; logits
equal a float reference on the decoded weights (int8, int4: within their 16-bit activations' 2e-4); torch's kernels where the compact kernel cannot run;
what the engine holds for its linears. Real SmolLM2 (slow) and a TensorRT-LLM checkpoint exported by
Model Optimizer (slow) too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_llama
from triton_backend.core.runtime_config import RuntimeConfig, WeightPrecision
from triton_backend.engines.batch import BatchRow
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.compact_weights import HEAD, int4_group
from triton_backend.engines.torch.llama_engine import LlamaEngine
from triton_backend.engines.torch.weight_gemm import dequantize

pytestmark = pytest.mark.skipif(row_gemm_module.cpu_isa() is None, reason="the CPU kernels need x86-64 with AVX2 + FMA")
COMPACT = [WeightPrecision.INT8, WeightPrecision.INT4, WeightPrecision.FP8, WeightPrecision.FLOAT16,
           WeightPrecision.BFLOAT16]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _tolerance(weights: WeightPrecision) -> float:
    """How close the engine's logits come to float32 on its decoded weights: int8 and int4 run on 16-bit
    activations (quantized per block, integer dot products), the others on float32 activations."""
    return 2e-4 if weights in (WeightPrecision.INT8, WeightPrecision.INT4) else 1e-5


def _decoded_reference(model: torch.nn.Module, engine: LlamaEngine) -> torch.nn.Module:
    """A copy of ``model`` whose linears hold the engine's decoded weights (input scales folded in)."""
    import copy

    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters(remove_duplicate=False))
    fwd = engine.forward_impl
    layers = {f"model.layers.{i}.": l for i, l in enumerate(fwd.layers)}
    parts = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
             "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}
    with torch.no_grad():
        for prefix, layer in layers.items():
            for name, attr in parts.items():
                lin = getattr(layer, attr)
                w = dequantize(lin.compact.weight)
                if lin.input_scale is not None:
                    w = w * lin.input_scale[None, :]
                params[f"{prefix}{name}.weight"].copy_(w)
        if fwd.head.compact is not None:
            ref.lm_head.weight = torch.nn.Parameter(dequantize(fwd.head.compact.weight))
    return ref


def _engine(model: torch.nn.Module, weights: WeightPrecision, **kwargs: object) -> LlamaEngine:
    return LlamaEngine(model, eos_token_ids=[], runtime=RuntimeConfig(weights=weights, max_batch_size=4, max_seq_len=96,
                                                                      **kwargs))


def _mixed_rows(engine: LlamaEngine, prompts: list[list[int]]) -> tuple[list[int], list[BatchRow]]:
    slots = [engine.allocate() for _ in range(4)]
    for s, ids in zip(slots, prompts[:3]):
        engine.forward([BatchRow(s, 0, ids)])
    a, b, c, d = prompts[:4]
    return slots, [BatchRow(slots[0], len(a), [a[-1]]),
                   BatchRow(slots[1], len(b), b[:5], num_logits=5),
                   BatchRow(slots[2], len(c) - 2, c[-2:] + c[:3], num_logits=4, tree_parents=[-1, 0, -1]),
                   BatchRow(slots[3], 0, d, num_logits=2)]


def check_exactness(engine: LlamaEngine, prompts: list[list[int]]) -> None:
    """Rows batched == alone (a ragged pass, then an all-decode pass), and a verify chain == the
    same positions decoded one by one, bit for bit."""
    assert engine.forward_impl.row_invariant
    slots, rows = _mixed_rows(engine, prompts)
    together = engine.forward(rows)
    for row, out in zip(rows, together):
        assert torch.equal(engine.forward([row])[0].logits, out.logits)
    decode = [BatchRow(s, r.start + len(r.tokens), [r.tokens[-1]]) for s, r in zip(slots, rows)]
    for row, out in zip(decode, engine.forward(decode)):
        assert torch.equal(engine.forward([row])[0].logits, out.logits)
    for s in slots:
        engine.release(s)
    ids, drafts = prompts[1], [3, 1, 4, 1]
    plain_slot, spec_slot = engine.allocate(), engine.allocate()
    engine.forward([BatchRow(plain_slot, 0, ids)])
    engine.forward([BatchRow(spec_slot, 0, ids)])
    seq = [ids[-1]] + drafts
    plain = [engine.forward([BatchRow(plain_slot, len(ids) + i - 1, [seq[i]])])[0].logits[0] for i in range(len(seq))]
    chain = engine.forward([BatchRow(spec_slot, len(ids) - 1, seq, num_logits=len(seq))])[0].logits
    for i, step in enumerate(plain):
        assert torch.equal(chain[i], step), i
    engine.release(plain_slot)
    engine.release(spec_slot)


@pytest.mark.parametrize("weights", COMPACT)
def test_tiny_model_is_exact_and_equals_its_decoded_weights(weights):
    model = tiny_llama(4, hidden=64, vocab=40)
    engine = _engine(model, weights)
    assert engine.weights is weights and "weight_gemm" in engine.kernel_name
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (9, 14, 7, 11)]
    check_exactness(engine, prompts)
    ref = _decoded_reference(model, engine)
    slot = engine.allocate()
    got = engine.forward([BatchRow(slot, 0, prompts[1], num_logits=len(prompts[1]))])[0].logits
    with torch.inference_mode():
        want = ref(torch.tensor([prompts[1]])).logits[0]
    assert _rel(got, want) < _tolerance(weights)


def test_compact_weights_without_the_kernel_run_decoded_on_torch():
    """Two torch threads: no row kernels; the same quantized values on torch's kernels."""
    model = tiny_llama(5, hidden=64, vocab=40)
    fast, slow = _engine(model, WeightPrecision.INT4), _engine(model, WeightPrecision.INT4, num_threads=2)
    torch.set_num_threads(1)
    assert not slow.forward_impl.row_invariant and slow.kernel_name == "torch" and slow.weights is WeightPrecision.INT4
    ids = list(range(3, 20))
    a, b = fast.allocate(), slow.allocate()
    assert _rel(slow.forward([BatchRow(b, 0, ids)])[0].logits, fast.forward([BatchRow(a, 0, ids)])[0].logits) < \
        _tolerance(WeightPrecision.INT4)


def test_what_the_engine_holds_for_its_linears():
    model = tiny_llama(6, hidden=64, vocab=40)  # 2 layers: q, o 64x64; k, v 32x64; gate, up 128x64; down 64x128; head 40x64
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)] * 2 + [(40, 64)]
    padded = lambda n: -(-n // 32) * 32  # noqa: E731  (panels of 32 output columns)
    want = {WeightPrecision.FLOAT32: sum(padded(n) * k * 4 for n, k in shapes),
            WeightPrecision.FLOAT16: sum(padded(n) * k * 2 for n, k in shapes),
            WeightPrecision.INT8: sum(padded(n) * k + n * 4 for n, k in shapes),
            WeightPrecision.FP8: sum(padded(n) * k + n * 4 for n, k in shapes),
            WeightPrecision.INT4: sum(padded(n) * k // 2 + padded(n) * (k // 64) * 4 for n, k in shapes)}
    for weights, nbytes in want.items():
        assert _engine(model, weights).linear_weight_bytes() == nbytes, weights


@pytest.mark.parametrize("weights", [WeightPrecision.INT8, WeightPrecision.INT4])
def test_released_float_linears_are_freed_and_the_output_is_unchanged(weights):
    """After ``release_float_linears`` the float weights of the compact linears (decoder and head)
    are gone -- nothing holds them -- the embedding and norms stay, what the engine holds is the
    plan's figure (float32 embedding and norms + the compact linears), and the engine's logits are
    bit for bit what they were, still exact batched or alone."""
    import gc
    import weakref

    from builder.plan.architecture import ModelArchitecture
    from builder.plan.memory import torch_float_bytes, torch_linear_bytes

    model = tiny_llama(8, hidden=64, vocab=40)
    engine = _engine(model, weights)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (9, 14, 7, 11)]
    slot = engine.allocate()
    before = engine.forward([BatchRow(slot, 0, prompts[0], num_logits=len(prompts[0]))])[0].logits
    engine.release(slot)
    gone = [weakref.ref(model.model.layers[1].mlp.down_proj.weight), weakref.ref(model.lm_head.weight)]
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    freed = engine.release_float_linears()
    gc.collect()
    assert all(ref() is None for ref in gone)
    arch = ModelArchitecture.from_config(model.config)
    kept = sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)
    assert kept == torch_float_bytes(arch, compact=True) == float_bytes - freed == (40 * 64 + 5 * 64) * 4
    assert engine.resident_weight_bytes() == kept + torch_linear_bytes(arch, weights, head=weights, group=64)
    slot = engine.allocate()
    after = engine.forward([BatchRow(slot, 0, prompts[0], num_logits=len(prompts[0]))])[0].logits
    engine.release(slot)
    assert torch.equal(before, after) and engine.release_float_linears() == 0
    check_exactness(engine, prompts)


def test_a_drafter_reading_the_float_head_keeps_it_and_float32_engines_release_nothing():
    from builder.plan.architecture import ModelArchitecture
    from builder.plan.memory import torch_float_bytes

    model = tiny_llama(9, hidden=64, vocab=40)
    engine = _engine(model, WeightPrecision.INT8)
    engine.release_float_linears(keep_head=True)
    assert not model.lm_head.weight.is_meta and model.model.layers[0].self_attn.q_proj.weight.is_meta
    arch = ModelArchitecture.from_config(model.config)
    assert sum(p.numel() * 4 for p in model.parameters() if not p.is_meta) == torch_float_bytes(arch, compact=True,
                                                                                                 float_head=True)
    plain = tiny_llama(9, hidden=64, vocab=40)
    assert _engine(plain, WeightPrecision.FLOAT32).release_float_linears() == 0
    assert not any(p.is_meta for p in plain.parameters())


def test_group_size_rule_and_refusals():
    assert int4_group([576, 1536]) == 64 and int4_group([1024, 4096]) == 128 and int4_group([576], 32) == 32
    with pytest.raises(ValueError, match="do not divide"):
        int4_group([96])
    with pytest.raises(ValueError, match="do not divide"):
        int4_group([576], 128)
    from triton_backend.core.errors import ConfigError

    with pytest.raises(ConfigError, match="int4_group_size"):
        RuntimeConfig(int4_group_size=48)
    with pytest.raises(ConfigError, match="dtype must be float32"):
        RuntimeConfig(weights="int8", dtype="float16")
    with pytest.raises(ConfigError, match="weights must be one of"):
        RuntimeConfig(weights="int3")
    assert RuntimeConfig(weights="int4").weights is WeightPrecision.INT4


# -- real weights --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_prompts(reference, reference_prompts):
    _, tokenizer = reference
    return [tokenizer.encode(p, add_special_tokens=False) for p in reference_prompts]


@pytest.mark.slow
@pytest.mark.parametrize("weights", [WeightPrecision.INT8, WeightPrecision.INT4, WeightPrecision.FP8,
                                     WeightPrecision.BFLOAT16])
def test_smollm2_quantized_is_exact_against_itself(reference, smol_prompts, weights):
    base, _ = reference
    engine = LlamaEngine(base.model, eos_token_ids=[], runtime=RuntimeConfig(weights=weights, max_batch_size=4,
                                                                             max_seq_len=512))
    assert engine.weights is weights
    if weights is WeightPrecision.INT4:
        assert engine.forward_impl.layers[0].q.compact.weight.group == 64  # 576 does not split into groups of 128
    check_exactness(engine, smol_prompts)
    # the quantized model still predicts like the float one most of the time (teacher-forced)
    slot, fslot = engine.allocate(), base.allocate()
    ids = smol_prompts[0]
    got = engine.forward([BatchRow(slot, 0, ids, num_logits=len(ids))])[0].logits.argmax(-1)
    want = base.forward([BatchRow(fslot, 0, ids, num_logits=len(ids))])[0].logits.argmax(-1)
    engine.release(slot)
    base.release(fslot)
    floor = {WeightPrecision.INT8: 0.85, WeightPrecision.INT4: 0.4, WeightPrecision.FP8: 0.85,
             WeightPrecision.BFLOAT16: 0.85}[weights]
    assert float((got == want).float().mean()) > floor  # a prompt's positions, the early ones hard (measured: 0.54 int4)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int4_awq", "int8_sq", "fp8", "fp16"])
def test_engine_serves_a_model_optimizer_checkpoint(tmp_path_factory, precision):
    """The tensors ``specbuild build`` exports (modelopt, TensorRT-LLM layout) served as they are:
    logits equal a float model holding the checkpoint's decoded weights, and the engine is exact."""
    sys.path.insert(0, str(Path(__file__).parent))
    from build_fixtures import make_tiny_llama
    from builder.plan.spec import KVCacheDtype, Precision
    from test_build_checkpoints import quantize_and_export
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.engines.torch.model_loading import load_model
    from triton_backend.engines.torch.trtllm_weights import apply_checkpoint, read_checkpoint

    work = tmp_path_factory.mktemp("ckpt")
    tiny = make_tiny_llama(work / "tiny", ensure_reference_model())
    _, folder, config = quantize_and_export(str(tiny), Precision(precision), KVCacheDtype.FP16, work / precision)
    model = load_model(str(tiny))
    checkpoint = read_checkpoint(folder, model.config)
    engine = LlamaEngine(model, eos_token_ids=[], runtime=RuntimeConfig(max_batch_size=4, max_seq_len=128),
                         compact=apply_checkpoint(model, checkpoint))
    want_precision = {"int4_awq": WeightPrecision.INT4, "int8_sq": WeightPrecision.INT8, "fp8": WeightPrecision.FP8,
                      "fp16": WeightPrecision.FLOAT16}
    assert engine.weights is want_precision[precision] and checkpoint.linears[HEAD].weight.format.name == "FLOAT16"
    has_pre = precision in ("int4_awq", "int8_sq")
    assert (engine.forward_impl.layers[0].q.input_scale is not None) == has_pre
    ref = _decoded_reference(model, engine)
    ids = list(range(300, 340))
    slot = engine.allocate()
    got = engine.forward([BatchRow(slot, 0, ids, num_logits=len(ids))])[0].logits
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    # integer weights run on 16-bit activations with exact integer block sums (weight_gemm.cpp): within 2e-4 of
    # float arithmetic on the decoded weights; float formats keep the float path
    assert _rel(got, want) < (2e-4 if has_pre else 1e-5)
    engine.release(slot)
    check_exactness(engine, [list(range(10 + i, 30 + 3 * i)) for i in range(4)])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int4_awq", "int8_sq", "fp8"])
def test_a_tp2_checkpoint_merges_into_the_tp1_checkpoint(tmp_path, precision):
    """One quantized model exported at TP 1 and TP 2 (Model Optimizer): the TP 2 ranks merged back equal
    the TP 1 file tensor for tensor, bit for bit, and the engines on both give the same logits and tokens."""
    sys.path.insert(0, str(Path(__file__).parent))
    from safetensors.torch import load_file

    from build_fixtures import make_tiny_llama
    from builder.plan.architecture import load_architecture
    from builder.plan.spec import KVCacheDtype, Precision
    from builder.stages.calibration import load_calibration_texts, make_forward_loop
    from builder.stages.checkpoint_export import export_checkpoint
    from builder.stages.quantize import quantize_model
    from test_build_checkpoints import CALIBRATION
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.engines.torch.model_loading import load_model, load_tokenizer
    from triton_backend.engines.torch.trtllm_shards import merge_ranks
    from triton_backend.engines.torch.trtllm_weights import apply_checkpoint, read_checkpoint

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model())
    torch.set_num_threads(1)
    model = load_model(str(tiny)).eval()
    loop = make_forward_loop(load_tokenizer(str(tiny)), load_calibration_texts(CALIBRATION), CALIBRATION.max_length)
    quantize_model(model, Precision(precision), KVCacheDtype.FP16, loop)
    for tp in (1, 2):
        export_checkpoint(model, load_architecture(str(tiny)), Precision(precision), KVCacheDtype.FP16,
                          tmp_path / f"tp{tp}", tp, 1)
    one = load_file(str(tmp_path / "tp1" / "rank0.safetensors"))
    ranks = [load_file(str(tmp_path / "tp2" / f"rank{r}.safetensors")) for r in range(2)]
    fc = "transformer.layers.0.mlp.fc.weight"
    assert 2 * ranks[0][fc].shape[0] == one[fc].shape[0]  # split: the gate rows over 2 ranks
    merged = merge_ranks(ranks, json.loads((tmp_path / "tp2" / "config.json").read_text()), model.config)
    assert set(merged) == set(one)
    for name, want in one.items():
        got = merged[name]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    engines = []
    for tp in (1, 2):
        fresh = load_model(str(tiny))
        engines.append(LlamaEngine(fresh, eos_token_ids=[], runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64),
                                   compact=apply_checkpoint(fresh, read_checkpoint(tmp_path / f"tp{tp}", fresh.config))))
    assert engines[1].weights is engines[0].weights is {"int4_awq": WeightPrecision.INT4, "int8_sq": WeightPrecision.INT8,
                                                         "fp8": WeightPrecision.FP8}[precision]
    tokens = []
    for engine in engines:
        slot, ids = engine.allocate(), list(range(300, 312))
        logits = engine.forward([BatchRow(slot, 0, ids)])[0].logits
        steps = [logits]
        for i in range(8):
            ids.append(int(logits[-1].argmax()))
            logits = engine.forward([BatchRow(slot, len(ids) - 1, [ids[-1]])])[0].logits
            steps.append(logits)
        tokens.append((ids, torch.cat(steps)))
    assert tokens[0][0] == tokens[1][0] and torch.equal(tokens[0][1], tokens[1][1])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int4_awq", "int8_sq", "fp8", "bf16"])
def test_plan_memory_figure_is_what_the_engine_allocates(tmp_path, precision):
    """``specbuild plan``'s torch-runtime figure for the linears (``torch_cpu_linear_bytes``) equals
    what the slot engine holds after loading the checkpoint the build stage exports from that plan
    (a 192-wide model: INT4-AWQ in the planner's groups of 64, written into the checkpoint config)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from build_fixtures import make_tiny_llama
    from builder.plan.architecture import load_architecture
    from builder.plan.planner import plan_deployment
    from builder.plan.spec import BuildSpec, CalibrationSpec, ModelSpec
    from builder.stages.checkpoint import build_checkpoint
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.engines.torch.model_loading import load_engine, load_model
    from triton_backend.engines.torch.trtllm_weights import apply_checkpoint, read_checkpoint

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model(), hidden=192, heads=3, kv_heads=1, intermediate=384)
    spec = BuildSpec(target=ModelSpec(str(tiny), precision), calibration=CalibrationSpec(num_samples=4, max_length=64))
    plan = plan_deployment(spec)
    planned = plan.model("target")
    assert planned.int4_group_size == (64 if precision == "int4_awq" else None)
    record = build_checkpoint(spec, plan, "target", spec.target, load_architecture(str(tiny)), tmp_path / "out")
    folder = tmp_path / "out" / record["dir"]
    model = load_model(str(tiny))
    checkpoint = read_checkpoint(folder, model.config)
    assert checkpoint.group_size == (64 if precision == "int4_awq" else 0)
    torch.set_num_threads(1)
    engine = LlamaEngine(model, eos_token_ids=[], runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64),
                         compact=apply_checkpoint(model, checkpoint))
    assert engine.linear_weight_bytes() == planned.torch_linear_bytes > 0
    # the deployment's loading path releases the float linears: the process holds the plan's figure
    served, _ = load_engine(str(tiny), RuntimeConfig(max_batch_size=2, max_seq_len=64), checkpoint=folder)
    assert served.resident_weight_bytes() == planned.torch_linear_bytes + planned.torch_float_bytes
    assert planned.torch_float_bytes == (49152 * 192 + 5 * 192) * 4  # tied embedding + LM head once, 5 norms


@pytest.mark.slow
def test_a_deployment_serves_the_checkpoint_and_speculation_stays_exact(tmp_path):
    """deployment.json's ``target_checkpoint``: the torch runtime serves the exported INT8 linears
    (paths relative to the file), and n-gram speculation gives plain decoding's tokens."""
    import json
    from dataclasses import replace

    sys.path.insert(0, str(Path(__file__).parent))
    from build_fixtures import make_tiny_llama
    from builder.plan.spec import KVCacheDtype, Precision
    from test_build_checkpoints import quantize_and_export
    from triton_backend.core.config import SamplingParams, SpeculationConfig
    from triton_backend.core.reference_model import ensure_reference_model
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.serving.service import load_deployment

    tiny = make_tiny_llama(tmp_path / "tiny", ensure_reference_model())
    quantize_and_export(str(tiny), Precision.INT8_SQ, KVCacheDtype.FP16, tmp_path / "ckpt")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "deployment.json").write_text(json.dumps(
        {"target": "../tiny", "target_checkpoint": "../ckpt", "runtime": {"max_batch_size": 2, "max_seq_len": 256}}))
    deployment = load_deployment(tmp_path / "repo" / "deployment.json")
    assert Path(deployment.target_checkpoint) == (tmp_path / "ckpt").resolve()
    decoder = build_decoder(deployment)
    torch.set_num_threads(1)
    assert decoder.target.weights is WeightPrecision.INT8 and decoder.target.forward_impl.layers[0].q.input_scale is not None
    prompt = "one two three one two three one two three one two"
    sampling = SamplingParams(max_tokens=12)
    spec = decoder.generate(prompt, sampling, SpeculationConfig(method="ngram"))
    plain = decoder.generate(prompt, sampling, replace(deployment.speculation, method="off"))
    assert spec.token_ids == plain.token_ids


def test_a_torch_only_build_layout_matches_the_plan_but_for_input_factors():
    """Quantized at load with the head in float16 (``quantize_lm_head`` false, as a build renders it):
    what the engine holds is the plan's figure less the AWQ input factors a checkpoint adds."""
    from builder.plan.architecture import ModelArchitecture
    from builder.plan.memory import torch_checkpoint_linear_bytes
    from builder.plan.spec import Precision

    model = tiny_llama(7, hidden=64, vocab=40)
    engine = _engine(model, WeightPrecision.INT4, quantize_lm_head=False)
    assert engine.forward_impl.head.compact.weight.format.name == "FLOAT16"
    arch = ModelArchitecture.from_config(model.config)
    factors = 2 * 4 * (6 * 64 + 128)  # 2 layers: a float32 factor per input of each linear (down_proj: 128 wide)
    assert engine.linear_weight_bytes() == torch_checkpoint_linear_bytes(arch, Precision.INT4_AWQ, 64) - factors


def test_fp8_shards_with_their_own_scales_merge_per_row_or_are_refused():
    """TP ranks whose FP8 scales differ: a column-parallel linear keeps each rank's scale on its rows
    (qkv: q of every rank, then k, then v); a row-parallel one has no per-output scale: refused."""
    from types import SimpleNamespace

    from triton_backend.core.errors import ModelLoadError
    from triton_backend.engines.torch.trtllm_shards import merge_ranks

    model_config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2, hidden_size=4, vocab_size=6)
    gen = torch.Generator().manual_seed(9)
    w = lambda n, k: (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn)  # noqa: E731
    ranks = [{"transformer.layers.0.attention.qkv.weight": w(6, 4),  # a rank: 1 q head, 1 k, 1 v of width 2
              "transformer.layers.0.attention.qkv.weights_scaling_factor": torch.tensor([s]),
              "transformer.layers.0.mlp.proj.weight": w(4, 3),
              "transformer.layers.0.mlp.proj.weights_scaling_factor": torch.tensor([0.5]),
              "lm_head.weight": torch.randn(3, 4, generator=gen)} for s in (1.0, 2.0)]
    merged = merge_ranks(ranks, {}, model_config)
    assert torch.equal(merged["transformer.layers.0.attention.qkv.weights_scaling_factor"],
                       torch.tensor([1.0, 1, 2, 2] * 3))
    qkv = [r["transformer.layers.0.attention.qkv.weight"].float() for r in ranks]
    assert torch.equal(merged["transformer.layers.0.attention.qkv.weight"].float(),
                       torch.cat([qkv[0][0:2], qkv[1][0:2], qkv[0][2:4], qkv[1][2:4], qkv[0][4:], qkv[1][4:]]))
    assert merged["transformer.layers.0.mlp.proj.weight"].shape == (4, 6) and merged["lm_head.weight"].shape == (6, 4)
    ranks[1]["transformer.layers.0.mlp.proj.weights_scaling_factor"] = torch.tensor([0.25])
    with pytest.raises(ModelLoadError, match="row-parallel FP8"):
        merge_ranks(ranks, {}, model_config)
