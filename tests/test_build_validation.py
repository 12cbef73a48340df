"""Every plan-time validation, with a typed error and a message that says what to change;
the build spec's parsing; the `specbuild plan` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.plan.architecture import ModelArchitecture
from builder.errors import (BuildSpecError, DoesNotFitError, PlanError, PrecisionError, UnknownGpuError,
                            UnsupportedModelError)
from builder.plan.planner import int4_problems, plan_deployment
from builder.plan.spec import BuildSpec, GpuTarget, KVCacheDtype, Limits, MedusaSpec, ModelSpec, Parallelism, Precision
from triton_backend.core.errors import VocabMismatchError


def arch(**kw) -> ModelArchitecture:
    base = dict(model_type="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                intermediate_size=512, vocab_size=1000, tie_word_embeddings=False, max_position_embeddings=4096)
    base.update(kw)
    return ModelArchitecture(**base)


@pytest.fixture(scope="module")
def reference_dir() -> Path:
    from triton_backend.core.reference_model import ensure_reference_model

    return ensure_reference_model()


def config_only_dir(folder: Path, reference_dir: Path, *, swap_tokens: bool = False, hidden: int = 256) -> Path:
    """A model folder with a config and the reference tokenizer (optionally with two token ids
    swapped): all the planner reads."""
    from transformers import AutoTokenizer, LlamaConfig

    LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(folder)
    AutoTokenizer.from_pretrained(reference_dir).save_pretrained(folder)
    if swap_tokens:
        path = folder / "tokenizer.json"
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        a, b = "hello", "world"
        vocab[a], vocab[b] = vocab[b], vocab[a]
        path.write_text(json.dumps(data))
    return folder


# ---- vocabulary / tokenizer ---------------------------------------------------------------
def test_vocab_size_mismatch_is_refused():
    s = BuildSpec(target=ModelSpec("smollm2-135m-instruct"), draft=ModelSpec("llama-3.2-1b"))
    with pytest.raises(VocabMismatchError, match=r"vocabulary \(128256 logits\) differs from the target's \(49152\)"):
        plan_deployment(s)


def test_tokenizer_mismatch_with_equal_vocab_size_is_refused(tmp_path, reference_dir):
    draft = config_only_dir(tmp_path / "draft", reference_dir, swap_tokens=True)
    s = BuildSpec(target=ModelSpec("smollm2-135m-instruct"), draft=ModelSpec(str(draft)))
    with pytest.raises(VocabMismatchError, match="draft tokenizer differs from the target's"):
        plan_deployment(s)


def test_a_draft_sharing_the_tokenizer_is_accepted(tmp_path, reference_dir):
    draft = config_only_dir(tmp_path / "draft", reference_dir)
    plan = plan_deployment(BuildSpec(target=ModelSpec("smollm2-135m-instruct"), draft=ModelSpec(str(draft))))
    assert plan.model("draft") is not None and not any("tokenizers" in n for n in plan.notes)


# ---- INT4 block size ----------------------------------------------------------------------
def test_int4_awq_takes_groups_of_64_where_128_does_not_divide():
    """SmolLM2's hidden size 576 is not a multiple of 128 but is of 64: INT4-AWQ in groups of 64,
    in the plan, its table, the checkpoint config modelopt is asked for and the engine script."""
    from builder.plan.memory import int4_group_size, linear_weight_bytes
    from builder.plan.report import format_plan
    from builder.stages.compile import engine_builds, write_script
    from builder.stages.quantize import quant_config

    s = BuildSpec(target=ModelSpec("smollm2-135m-instruct", "int4_awq"))
    plan = plan_deployment(s)
    target = plan.model("target")
    assert target.int4_group_size == 64 and target.to_dict()["int4_group_size"] == 64
    assert "int4_awq g64" in format_plan(plan)
    assert int4_group_size(arch()) == 128 and int4_group_size(arch(hidden_size=192, num_heads=3)) == 64
    assert linear_weight_bytes(6400, 10, Precision.INT4_AWQ, 64) == 3200 + 2 * 100
    weight_entry = [e for e in quant_config(Precision.INT4_AWQ, KVCacheDtype.FP16, 64)["quant_cfg"]
                    if e.get("quantizer_name") == "*weight_quantizer"]
    assert weight_entry[0]["cfg"]["block_sizes"][-1] == 64
    import modelopt.torch.quantization as mtq

    assert mtq.INT4_AWQ_CFG["quant_cfg"][1]["cfg"]["block_sizes"][-1] == 128  # modelopt's own config untouched
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        text = write_script(engine_builds(s, plan), Path(tmp), plan).read_text()
    assert "# target: INT4-AWQ in groups of 64 input channels" in text


def test_int4_awq_is_refused_for_widths_not_divisible_by_64_before_any_calibration():
    problems = int4_problems(arch(hidden_size=96, num_heads=3, head_dim=32), tp=1)
    assert any("attention.qkv input size 96 is not divisible by 64" in p for p in problems)


def test_int4_block_size_rules():
    assert int4_problems(arch(), tp=1) == []
    assert int4_problems(arch(), tp=2) == []  # dense input 256/2 = 128, down input 512/2 = 256
    assert int4_problems(arch(hidden_size=128, num_heads=2, num_kv_heads=1), tp=2) == []  # dense 64 per GPU: groups of 64
    # hidden 64 with 2 heads: dense input 64/2 = 32 per GPU at TP 2
    assert any("attention.dense input size 32" in p
               for p in int4_problems(arch(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32), tp=2))
    odd = int4_problems(arch(intermediate_size=640 + 1), tp=1)
    assert any("mlp.proj input size 641" in p for p in odd) and any("output size 1282" not in p for p in odd)
    assert any("is odd" in p for p in int4_problems(arch(num_heads=1, num_kv_heads=1, head_dim=129, hidden_size=256), tp=1))


# ---- GPUs, precisions, parallelism ----------------------------------------------------------
def test_unknown_gpu():
    with pytest.raises(UnknownGpuError, match="unknown GPU 'v100'.*h100-80gb"):
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b"), gpu=GpuTarget("v100")))
    with pytest.raises(UnknownGpuError):  # 40 or 80 GB? refused rather than guessed
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b"), gpu=GpuTarget("a100")))


def test_does_not_fit_at_any_precision():
    s = BuildSpec(target=ModelSpec("llama-3-70b"), draft=ModelSpec("llama-3-8b"), gpu=GpuTarget("rtx4090-24gb"))
    with pytest.raises(DoesNotFitError, match=r"smallest combination \(target int4_awq, KV cache fp8, draft int4_awq, TP 1\)"):
        plan_deployment(s)


def test_fp8_needs_fp8_tensor_cores():
    with pytest.raises(PrecisionError, match="no FP8 tensor cores"):
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b", "fp8"), gpu=GpuTarget("a100-80gb")))
    with pytest.raises(PrecisionError, match="FP8 KV cache"):
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b"), gpu=GpuTarget("a100-80gb"), kv_cache_dtype="fp8"))
    plan = plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b", "fp8"), gpu=GpuTarget("l40s")))
    assert plan.precision_of("target") is Precision.FP8


def test_parallelism_validation():
    with pytest.raises(PlanError, match="needs 4 GPUs; the spec has 2"):
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-8b"), gpu=GpuTarget("h100", 2), parallel=Parallelism(4)))
    with pytest.raises(PlanError, match="9 attention heads do not split over TP 2"):
        plan_deployment(BuildSpec(target=ModelSpec("smollm2-135m-instruct"), gpu=GpuTarget("h100", 2), parallel=Parallelism(2)))
    with pytest.raises(PlanError, match="80 layers do not split over PP 3"):
        plan_deployment(BuildSpec(target=ModelSpec("llama-3-70b"), gpu=GpuTarget("h100", 3), parallel=Parallelism(1, 3)))


def test_context_longer_than_the_model_is_refused():
    s = BuildSpec(target=ModelSpec("llama-3-70b"), gpu=GpuTarget("h100", 8), limits=Limits(max_input_len=8000, max_output_len=512))
    with pytest.raises(PlanError, match="exceeds the model's context of 8192 tokens"):
        plan_deployment(s)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2}))
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' is not supported"):
        plan_deployment(BuildSpec(target=ModelSpec(str(tmp_path))))


# ---- the spec -------------------------------------------------------------------------------
def test_spec_from_yaml_and_toml(tmp_path):
    yaml_text = """
target: {source: llama-3-70b, precision: auto}
draft: llama-3-8b
gpu: {kind: h100-80gb, count: 2}
limits: {max_batch_size: 4, max_input_len: 1024, max_output_len: 256, max_draft_len: 5}
kv_cache_dtype: fp8
parallel: {tp_size: auto, pp_size: 1}
"""
    toml_text = """
kv_cache_dtype = "fp8"
[target]
source = "llama-3-70b"
[draft]
source = "llama-3-8b"
[gpu]
kind = "h100-80gb"
count = 2
[limits]
max_batch_size = 4
max_input_len = 1024
max_output_len = 256
max_draft_len = 5
[parallel]
tp_size = "auto"
"""
    (tmp_path / "s.yaml").write_text(yaml_text)
    (tmp_path / "s.toml").write_text(toml_text)
    a, b = BuildSpec.load(tmp_path / "s.yaml"), BuildSpec.load(tmp_path / "s.toml")
    assert a == b and a.parallel.tp_size is None and a.draft.source == "llama-3-8b" and a.limits.max_draft_len == 5
    assert BuildSpec.from_dict(a.to_dict()) == a


@pytest.mark.parametrize("data, message", [
    ({"target": "x", "gpus": 2}, "unknown build spec fields: \\['gpus'\\]"),
    ({"target": {"source": "x", "precision": "int3"}}, "precision: unknown value 'int3'"),
    ({"target": "x", "limits": {"max_batch_size": 0}}, "limits.max_batch_size must be a positive integer"),
    ({"target": "x", "parallel": {"tp_size": 3}}, "power of two"),
    ({"target": "x", "kv_cache_dtype": "fp4"}, "kv_cache_dtype: unknown value"),
    ({"draft": "x"}, "needs a target"),
    ({"target": "x", "draft": "y", "medusa": {"num_heads": 4}}, "not both"),
])
def test_bad_specs_get_typed_errors(data, message):
    with pytest.raises(BuildSpecError, match=message):
        BuildSpec.from_dict(data)


def test_spec_file_errors(tmp_path):
    with pytest.raises(BuildSpecError, match="not found"):
        BuildSpec.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("target: [unclosed")
    with pytest.raises(BuildSpecError, match="could not parse bad.yaml"):
        BuildSpec.load(tmp_path / "bad.yaml")


# ---- the command ----------------------------------------------------------------------------
def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    from builder.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--target", "llama-3-70b", "--draft", "llama-3-8b", "--gpu", "h100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int4_awq g128 (auto)" in text and "target bf16 would need" in text and "headroom" in text
    data = json.loads(out.read_text())
    assert data["precisions"] == {"target": "int4_awq", "draft": "bf16"} and data["fits"] is True
    assert data["total_per_gpu_bytes"] == 69_373_960_192


def test_plan_command_errors_are_short(capsys):
    from builder.cli.main import main

    assert main(["plan", "--target", "llama-3-8b", "--gpu", "v100", "--json", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specbuild: error: unknown GPU 'v100'") and "Traceback" not in err


def test_medusa_spec_needs_heads():
    with pytest.raises(BuildSpecError, match="medusa.num_heads must be a positive integer"):
        MedusaSpec(num_heads=0)


@pytest.mark.parametrize("name", ["llama3-70b-8b-h100.yaml", "smollm2-fp8.toml"])
def test_example_specs_plan(name):
    spec = BuildSpec.load(Path(__file__).resolve().parent.parent / "builder" / "examples" / name)
    assert plan_deployment(spec).fits


def test_draft_precision_needs_a_draft(capsys):
    from builder.cli.main import main

    assert main(["plan", "--target", "llama-3-8b", "--draft-precision", "fp8", "--json", ""]) == 2
    assert "--draft-precision needs a draft model" in capsys.readouterr().err
