"""`specbuild build` end to end: real modelopt quantization and export, the compile stage with
trtllm-build absent (script + plain notice), present-but-failing and present-and-succeeding
(stand-in executables: TensorRT-LLM cannot run here), the manifest, the torch runtime's
weights, Medusa heads, and the rendered repository in a real Triton server."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from build_fixtures import check_checkpoint, make_tiny_llama
from builder.cli.main import main as cli_main
from builder.stages.compile import TRTLLM_BUILD
from builder.stages.manifest import verify_manifest

pytestmark = pytest.mark.slow

# the quality stage on small N/M: 2 held-out prompts x 8 tokens, perplexity on 128 tokens
CAL = ["--calibration-samples", "4", "--calibration-max-length", "64", "--no-progress", "--quality-prompts", "2",
       "--quality-tokens", "8", "--quality-text-tokens", "128"]


def path_without_trtllm_build() -> str:
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not (Path(d) / TRTLLM_BUILD).exists())


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def reference_dir() -> Path:
    from triton_backend.core.reference_model import ensure_reference_model

    return ensure_reference_model()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, reference_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-draft", reference_dir, seed=3)


@pytest.fixture(scope="module")
def full_build(tmp_path_factory, tiny_dir):
    """SmolLM2 target at FP8 + a tiny draft at INT4-AWQ, FP8 KV cache, no trtllm-build."""
    out = tmp_path_factory.mktemp("build") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", path_without_trtllm_build())
        code = cli_main(["build", "--target", "smollm2-135m-instruct", "--precision", "fp8", "--draft", str(tiny_dir),
                         "--draft-precision", "int4_awq", "--kv-cache-dtype", "fp8", "--max-batch-size", "4",
                         "--max-draft-len", "5", "-o", str(out), *CAL])
    assert code == 0
    return out, json.loads((out / "manifest.json").read_text())


def test_build_without_trtllm_build_writes_the_script_and_says_so(full_build, capsys):
    out, manifest = full_build
    assert manifest["engines_compiled"] is False and not (out / "engines").exists()
    for role in ("target", "draft"):
        engine = manifest["engines"][role]
        assert engine["status"] == "not compiled" and "trtllm-build is not on PATH" in engine["detail"]
    assert any("target engine NOT COMPILED" in n for n in manifest["notices"])
    script = (out / "build_engines.sh").read_text()
    assert os.access(out / "build_engines.sh", os.X_OK)
    target_cmd = ("trtllm-build \\\n    --checkpoint_dir checkpoints/target \\\n    --output_dir engines/target \\\n"
                  "    --gemm_plugin auto \\\n    --max_batch_size 4 \\\n    --max_input_len 2559 \\\n"
                  "    --max_seq_len 2560 \\\n    --max_num_tokens 8192 \\\n    --use_paged_context_fmha enable \\\n"
                  "    --gather_generation_logits \\\n    --speculative_decoding_mode draft_tokens_external \\\n"
                  "    --max_draft_len 5\n")
    assert target_cmd in script
    draft_part = script[script.index("--checkpoint_dir checkpoints/draft"):]
    assert "--use_paged_context_fmha enable" in draft_part and "--speculative_decoding_mode" not in draft_part
    assert manifest["engines"]["target"]["command"][:5] == ["trtllm-build", "--checkpoint_dir", "checkpoints/target",
                                                            "--output_dir", "engines/target"]


def test_manifest_records_precisions_checkpoints_hashes_and_versions(full_build):
    out, manifest = full_build
    assert manifest["format"] == "specbuild-manifest/1"
    assert manifest["precisions"] == {"target": {"weights": "fp8", "kv_cache": "fp8"},
                                      "draft": {"weights": "int4_awq", "kv_cache": "fp8"}}
    ck = manifest["checkpoints"]
    assert (ck["target"]["quant_algo"], ck["target"]["kv_cache_quant_algo"]) == ("FP8", "FP8")
    assert (ck["draft"]["quant_algo"], ck["draft"]["kv_cache_quant_algo"]) == ("W4A16_AWQ", "FP8")
    assert ck["target"]["calibration_samples"] == 4
    assert manifest["versions"]["nvidia-modelopt"] == "0.47.0" and manifest["versions"]["tensorrt_llm"] is None
    assert manifest["spec"]["limits"]["max_draft_len"] == 5 and manifest["plan"]["fits"] is True
    for rel in ("checkpoints/target/rank0.safetensors", "checkpoints/draft/config.json", "weights/target/model.safetensors",
                "model_repo/specdec/config.pbtxt", "model_repo/specdec/1/deployment.json", "build_engines.sh"):
        assert rel in manifest["files"] and len(manifest["files"][rel]["sha256"]) == 64
    assert verify_manifest(out) == []
    assert "torch runtime" in " ".join(manifest["notices"]) and manifest["torch_runtime"]["dtype"] == "float32"


def test_checkpoints_hold_the_torch_runtime_weights_quantized(full_build):
    """The float weights the torch runtime serves are the originals the checkpoint quantized
    (SmolLM2's FP8 checkpoint is checked the same way in test_build_checkpoints.py)."""
    out, _ = full_build
    check_checkpoint(out / "checkpoints" / "draft", load_state(out / "weights" / "draft"), 2, "int4_awq", 1, fp8_kv=True)


def test_the_torch_runtime_serves_the_checkpoints_as_exported(full_build):
    """The FP8 target's and the INT4-AWQ draft's deployment names their checkpoints, whose e4m3 and
    packed int4 tensors the slot engine serves (docs/quantized-weights.md); nothing is quantized at load."""
    out, manifest = full_build
    assert manifest["model_repo"]["torch_linear_weights"] == {"target": "fp8 from checkpoints/target",
                                                              "draft": "int4 from checkpoints/draft"}
    assert manifest["torch_runtime"]["linear_weights"] == {"target": "fp8", "draft": "int4"}
    deployment = json.loads((out / manifest["model_repo"]["deployment"]).read_text())
    assert deployment["draft_checkpoint"] == "../../../checkpoints/draft"
    assert deployment["target_checkpoint"] == "../../../checkpoints/target"
    assert deployment["runtime"]["weights"] == "float32"  # what a model without a checkpoint would be quantized to


def test_the_quality_stage_measures_the_served_checkpoints(full_build):
    """The INT4-AWQ draft and the FP8 target as the deployment serves them (their checkpoints'
    tensors) against float32: greedy agreement and perplexity in the manifest; a threshold warning
    is among the notices."""
    out, manifest = full_build
    draft = manifest["quality"]["draft"]
    assert draft["precision"] == "int4" and draft["served"] == "checkpoint checkpoints/draft"
    assert draft["method"]["prompts"] == 2 and draft["method"]["max_tokens"] == 8
    assert 0 <= draft["greedy_agreement"] <= 1 and draft["perplexity"]["float32"] > 1
    assert draft["perplexity"]["ratio"] == pytest.approx(draft["perplexity"]["served"] / draft["perplexity"]["float32"],
                                                         rel=1e-3)
    assert draft["thresholds"] == {"min_agreement": 0.9, "max_ppl_ratio": 1.1}
    assert all(w in manifest["notices"] for w in draft["warnings"])
    target = manifest["quality"]["target"]
    assert target["precision"] == "fp8" and target["served"] == "checkpoint checkpoints/target"
    assert 0 <= target["greedy_agreement"] <= 1 and target["perplexity"]["float32"] > 1
    assert [s["name"] for s in manifest["stages"]].index("quality") < [s["name"] for s in manifest["stages"]].index(
        "model repository")


def test_rendered_deployment_runs_in_process_and_matches_the_target_alone(full_build):
    from dataclasses import replace

    from triton_backend.core.config import DraftLengthConfig, FallbackConfig, SamplingParams, SpeculationConfig
    from triton_backend.deployment.torch_deployment import build_decoder
    from triton_backend.serving.service import load_deployment

    out, manifest = full_build
    deployment = load_deployment(out / manifest["model_repo"]["deployment"])
    assert Path(deployment.target) == (out / "weights" / "target").resolve() and deployment.draft is not None
    assert deployment.speculation.draft_length.num_draft_tokens == 5
    decoder = build_decoder(deployment)
    sampling = SamplingParams(max_tokens=8)
    # fallback off: this checks exactness while drafting; whether drafting pays is the gain rule's call
    spec = decoder.generate("The capital of France is", sampling,
                            SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=3),
                                              fallback=FallbackConfig(enabled=False)))
    plain = decoder.generate("The capital of France is", sampling, replace(deployment.speculation, method="off"))
    assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0


def test_rendered_repository_loads_in_real_triton(full_build, tmp_path):
    from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate
    from triton_backend.serving.launch.triton_server import ServerConfig, TritonServer

    out, _ = full_build
    server = TritonServer(ServerConfig(out / "model_repo", exit_timeout_s=5, startup_timeout_s=300,
                                       log_file=tmp_path / "tritonserver.log"))
    endpoints = server.start()
    try:
        result = generate(ClientConfig(endpoints.http_url, ClientProtocol.HTTP),
                          GenerateRequest(prompt="The capital of France is", max_tokens=6, speculation="draft"))
    finally:
        server.stop()
    # the draft was chosen; whether a round drafts is the gain rule's call (this tiny draft rarely pays)
    assert result.text and result.stats["num_output_tokens"] == 6 and result.stats["speculation_method"] == "draft"


# ---- compile stage with a trtllm-build on PATH (stand-ins: TensorRT-LLM cannot run here) ----------
def fake_trtllm_build(bin_dir: Path, *, succeed: bool) -> Path:
    """An executable named trtllm-build that records its argv; on success it writes what a real
    build leaves (config.json + rank0.engine), on failure it exits 1 with an error line."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / TRTLLM_BUILD
    body = ("import json, pathlib, sys\n"
            "args = sys.argv[1:]\n"
            "out = pathlib.Path(args[args.index('--output_dir') + 1])\n"
            "pathlib.Path('calls.jsonl').open('a').write(json.dumps(args) + '\\n')\n")
    body += ("out.mkdir(parents=True, exist_ok=True)\n(out / 'config.json').write_text('{}')\n"
             "(out / 'rank0.engine').write_bytes(b'engine')\n" if succeed else
             "print('[TRT-LLM] [E] no CUDA device'); sys.exit(1)\n")
    tool.write_text(f"#!{sys.executable}\n" + body)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


@pytest.mark.parametrize("succeed", [False, True])
def test_compile_stage_records_what_trtllm_build_did(tiny_dir, tmp_path, monkeypatch, succeed):
    fake_trtllm_build(tmp_path / "bin", succeed=succeed)
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + path_without_trtllm_build())
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny_dir), "--precision", "fp16", "--kv-cache-dtype", "fp16",
                     "-o", str(out), *CAL]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    engine = manifest["engines"]["target"]
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls == [engine["command"][1:]]  # run exactly as recorded, from the output folder
    if succeed:
        assert engine["status"] == "compiled" and manifest["engines_compiled"] is True
        assert "engines/target/rank0.engine" in manifest["files"]
    else:
        assert engine["status"] == "failed" and manifest["engines_compiled"] is False
        assert "exited 1" in engine["detail"] and "no CUDA device" in engine["detail"]
        assert any("target engine FAILED" in n for n in manifest["notices"])


@pytest.mark.trtllm
def test_real_trtllm_build_compiles_the_checkpoint(tiny_dir, tmp_path):
    if shutil.which(TRTLLM_BUILD) is None or not torch.cuda.is_available():
        pytest.skip("needs TensorRT-LLM's trtllm-build and a CUDA GPU (not installable here)")
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny_dir), "--precision", "fp16", "-o", str(out), *CAL]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engines"]["target"]["status"] == "compiled", manifest["engines"]["target"]["detail"]


# ---- other build modes and refusals -----------------------------------------------------------
def test_torch_only_build(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny_dir), "--torch-only", "-o", str(out), "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checkpoints"] == {} and manifest["engines"] == {} and not (out / "checkpoints").exists()
    assert (out / "weights" / "target" / "model.safetensors").is_file()
    assert any("torch-only build" in n for n in manifest["notices"])
    assert "engines: NOT compiled" in capsys.readouterr().out
    # the output folder now holds a build: a second build needs --force
    assert cli_main(["build", "--target", str(tiny_dir), "--torch-only", "-o", str(out), "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["build", "--target", str(tiny_dir), "--torch-only", "-o", str(out), "--no-progress", "--force"]) == 0


def test_refusals_happen_before_any_model_is_loaded(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["build", "--target", "smollm2-135m-instruct", "--precision", "fp8", "--gpu", "a100-80gb",
                     "-o", str(out)]) == 2
    assert "has no FP8 tensor cores" in capsys.readouterr().err
    assert list(out.iterdir()) == []  # refused at the plan stage: nothing loaded, calibrated or written
    assert cli_main(["build", "--target", "llama-3-70b", "-o", str(tmp_path / "o2")]) == 2
    assert "architecture-only config" in capsys.readouterr().err


def test_medusa_heads_are_exported_with_the_target(tiny_dir, tmp_path):
    from safetensors.torch import save_file

    hidden, vocab, heads = 256, 49152, 3
    torch.manual_seed(0)
    tensors = {}
    for i in range(heads):  # TensorRT-LLM's layout, as `specbuild train-medusa` exports it
        tensors[f"medusa_heads.{i}.medusa_layers.0.linear.weight"] = torch.randn(hidden, hidden) * 0.02
        tensors[f"medusa_heads.{i}.medusa_layers.0.linear.bias"] = torch.zeros(hidden)
        tensors[f"medusa_heads.{i}.lm_head.weight"] = torch.randn(vocab, hidden) * 0.02
    save_file(tensors, str(tmp_path / "heads.safetensors"))
    out = tmp_path / "out"
    assert cli_main(["build", "--target", str(tiny_dir), "--precision", "fp8", "--medusa-heads", str(heads),
                     "--medusa-source", str(tmp_path / "heads.safetensors"), "-o", str(out), "--no-compile", *CAL]) == 0
    config = json.loads((out / "checkpoints" / "target" / "config.json").read_text())
    assert config["architecture"] == "MedusaForCausalLM" and config["num_medusa_heads"] == heads
    script = (out / "build_engines.sh").read_text()
    assert "--speculative_decoding_mode medusa" in script and "--max_draft_len" not in script
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["precisions"] == {"target": "fp8", "medusa": "fp8"}
    assert manifest["engines"]["target"]["detail"].startswith("compile was not asked for")
