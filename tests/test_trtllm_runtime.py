"""The trtllm runtime (compiled TensorRT-LLM engines through the Executor API), checked here
without TensorRT-LLM, which cannot be installed on these machines:

- the deployment's typed runtime selection and engine folders (JSON round trip, old files);
- the clear, typed error where TensorRT-LLM is absent: through build_decoder, serving's load
  path, a real Triton server loading the repository, and deploy's pre-flight check;
- the contract of every request and executor setting built from SamplingParams /
  SpeculationConfig / TrtllmConfig (keyword names as TensorRT-LLM's bindings document them);
- the speculative loop against the request contract, computed with a torch model
  (``TorchRequestEngine``): greedy output identical to plain decoding;
- `specbuild build` with a stand-in trtllm-build renders a deployment that selects trtllm.

Tests that need the real library carry ``@pytest.mark.trtllm`` and skip with the reason."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_engine
from trtllm_fixtures import TorchRequestEngine, stand_in_trtllm_build, write_engine_dir
from triton_backend.core.config import (
    DraftLengthConfig, FallbackConfig, FinishReason, SamplingParams, SpeculationConfig, SpeculationMode,
)
from triton_backend.deployment.torch_deployment import build_decoder
from triton_backend.deployment.deployment_config import DeploymentConfig
from triton_backend.speculation.drafters.ngram import NgramDrafter
from triton_backend.engines.trtllm.trtllm_config import EngineRuntime, TrtllmConfig
from triton_backend.engines.trtllm.engine import TRTLLM_MISSING, read_engine_info
from triton_backend.engines.trtllm.requests import (
    NO_END_ID, SeedRole, count_accepted, draft_request, end_ids, executor_spec, plain_request, request_seed,
    sampling_spec, target_request,
)
from triton_backend.core.errors import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError
from triton_backend.speculation.torch_decoder import SpeculativeDecoder
from triton_backend.serving.service import load_deployment
from triton_backend.speculation.trtllm_loop import EngineDrafter, EngineMedusa, TargetInfo, TrtllmSpeculativeDecoder

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
needs_no_trtllm = pytest.mark.skipif(HAVE_TRTLLM, reason="TensorRT-LLM is installed: the absent-library path does not apply")

# Keyword arguments of tensorrt_llm.bindings.executor as its Python bindings declare them
# (cpp/tensorrt_llm/pybind/executor/request.cpp and executorConfig.cpp, TensorRT-LLM 1.x).
DOCUMENTED = {
    "Request": {"input_token_ids", "max_tokens", "streaming", "sampling_config", "output_config", "end_id", "pad_id",
                "position_ids", "bad_words", "stop_words", "embedding_bias", "external_draft_tokens_config",
                "prompt_tuning_config", "lora_config", "lookahead_config", "logits_post_processor_name",
                "client_id", "return_all_generated_tokens", "priority", "type"},
    "SamplingConfig": {"beam_width", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay", "seed",
                       "temperature", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                       "length_penalty", "early_stopping", "no_repeat_ngram_size", "num_return_sequences", "min_p"},
    "OutputConfig": {"return_log_probs", "return_context_logits", "return_generation_logits",
                     "exclude_input_from_output", "return_encoder_output", "return_perf_metrics"},
    "ExternalDraftTokensConfig": {"tokens", "logits", "acceptance_threshold", "fast_logits"},
    "KvCacheConfig": {"enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
                      "free_gpu_memory_fraction", "host_cache_size", "onboard_blocks"},
    "ExecutorConfig": {"max_beam_width", "scheduler_config", "kv_cache_config", "decoding_config",
                       "parallel_config", "max_batch_size", "max_num_tokens"},
}
GREEDY = SamplingParams(max_tokens=24)
SAMPLING = SamplingParams(max_tokens=24, temperature=0.8, top_k=0, top_p=1.0, seed=7)


# -- the deployment's runtime selection ------------------------------------------------------
def test_deployment_json_round_trips_the_trtllm_runtime_and_old_files_load_as_torch() -> None:
    for trt in (TrtllmConfig(target_engine="../engines/target", draft_engine="../engines/draft"),
                TrtllmConfig(target_engine="/e/target", target_kind="medusa", kv_cache_free_gpu_memory_fraction=0.3,
                             use_draft_logits=False, response_timeout_s=30)):
        config = DeploymentConfig(target="weights/target", engine_runtime="trtllm", trtllm=trt, medusa_choices=[[0], [1]])
        data = json.loads(config.to_json())
        assert data["engine_runtime"] == "trtllm" and data["trtllm"]["target_kind"] == trt.target_kind.value
        again = DeploymentConfig.from_dict(data)
        assert again == config and again.engine_runtime is EngineRuntime.TRTLLM
        assert isinstance(again.trtllm, TrtllmConfig) and again.trtllm.target_kind is trt.target_kind
    old = json.loads(DeploymentConfig(target="weights/target").to_json())
    del old["engine_runtime"], old["trtllm"]  # a deployment.json written before the trtllm runtime existed
    loaded = DeploymentConfig.from_dict(old)
    assert loaded.engine_runtime is EngineRuntime.TORCH and loaded.trtllm is None


@pytest.mark.parametrize("data,message", [
    ({"engine_runtime": "tensorrt"}, "unknown engine runtime"),
    ({"engine_runtime": "trtllm"}, "needs a trtllm section"),
    ({"engine_runtime": "trtllm", "trtllm": {"target_engine": "t", "engines": 2}}, "unknown trtllm fields"),
    ({"engine_runtime": "trtllm", "trtllm": {"draft_engine": "d"}}, "needs target_engine"),
    ({"engine_runtime": "trtllm", "trtllm": {"target_engine": "t", "target_kind": "eagle"}}, "target_kind must be"),
    ({"engine_runtime": "trtllm", "trtllm": {"target_engine": "t", "target_kind": "medusa", "draft_engine": "d"}},
     "takes no draft engine"),
    ({"engine_runtime": "trtllm", "trtllm": {"target_engine": "t", "kv_cache_free_gpu_memory_fraction": 1.5}},
     "kv_cache_free_gpu_memory_fraction"),
    ({"engine_runtime": "trtllm", "trtllm": ["t"]}, "trtllm must be an object"),
])
def test_bad_runtime_settings_get_a_clear_typed_error(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeploymentConfig.from_dict(data)


def test_load_deployment_resolves_engine_folders_from_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "repo" / "specdec" / "1"
    folder.mkdir(parents=True)
    config = DeploymentConfig(target="smollm2-135m-instruct", engine_runtime="trtllm",
                              trtllm=TrtllmConfig(target_engine="../../../engines/target", draft_engine="/abs/draft"))
    (folder / "deployment.json").write_text(config.to_json())
    loaded = load_deployment(folder / "deployment.json")
    assert loaded.trtllm is not None and loaded.trtllm.target_engine == str((tmp_path / "engines" / "target").resolve())
    assert loaded.trtllm.draft_engine == "/abs/draft" and loaded.target == "smollm2-135m-instruct"


# -- absent TensorRT-LLM: a typed error, never an ImportError traceback ------------------------
def test_engine_folders_are_checked_before_tensorrt_llm_is_needed(tmp_path: Path) -> None:
    config = DeploymentConfig(engine_runtime="trtllm", trtllm=TrtllmConfig(target_engine=str(tmp_path / "none")))
    with pytest.raises(ModelLoadError, match="target engine folder .* does not exist"):
        build_decoder(config)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    config = DeploymentConfig(engine_runtime="trtllm", trtllm=TrtllmConfig(target_engine=str(tmp_path / "half")))
    with pytest.raises(ModelLoadError, match="no rank0.engine; it is not a finished trtllm-build output"):
        build_decoder(config)


@needs_no_trtllm
def test_absent_tensorrt_llm_is_a_model_load_error_through_build_decoder_and_serving(tmp_path: Path) -> None:
    target = write_engine_dir(tmp_path / "engines" / "target")
    draft = write_engine_dir(tmp_path / "engines" / "draft", hidden=64, layers=2)
    folder = tmp_path / "model_repo" / "specdec" / "1"
    folder.mkdir(parents=True)
    config = DeploymentConfig(target="smollm2-135m-instruct", engine_runtime="trtllm",
                              trtllm=TrtllmConfig(target_engine=os.path.relpath(target, folder),
                                                  draft_engine=os.path.relpath(draft, folder)))
    (folder / "deployment.json").write_text(config.to_json())
    for deployment in (DeploymentConfig.from_dict(json.loads(config.to_json())),  # relative to the cwd: wrong folder
                       load_deployment(folder / "deployment.json")):  # as triton_model.initialize loads it
        with pytest.raises(ModelLoadError) as info:
            build_decoder(deployment)
        if deployment.trtllm.target_engine.startswith("/"):
            assert str(info.value) == TRTLLM_MISSING and info.value.code == "model_load"
            assert info.value.__suppress_context__ and info.value.__cause__ is None  # no ImportError chained
        else:
            assert "does not exist" in str(info.value)


def test_engine_config_is_read_as_trtllm_build_writes_it(tmp_path: Path) -> None:
    info = read_engine_info(write_engine_dir(tmp_path / "t", tp=2, max_input_len=900, max_seq_len=1000,
                                             max_draft_len=5, medusa_heads=3), "target")
    assert (info.vocab_size, info.world_size, info.max_input_len, info.max_seq_len) == (49152, 2, 900, 1000)
    assert (info.max_draft_len, info.num_medusa_heads, info.architecture) == (5, 3, "MedusaForCausalLM")
    with pytest.raises(ModelLoadError, match=r"lacks \['rank1.engine'\] for its 2 ranks"):
        read_engine_info(write_engine_dir(tmp_path / "u", tp=2, ranks_written=1), "target")
    (tmp_path / "u" / "config.json").write_text(json.dumps({"pretrained_config": {}, "build_config": {}}))
    with pytest.raises(ModelLoadError, match="has no integer 'vocab_size'"):
        read_engine_info(tmp_path / "u", "target")


# -- the contract of what is sent to the Executor --------------------------------------------
def test_sampling_settings_follow_the_request() -> None:
    assert sampling_spec(GREEDY, None).kwargs() == {"beam_width": 1, "top_k": 1}
    assert sampling_spec(SamplingParams(temperature=0.9, top_k=1), 5).kwargs() == {"beam_width": 1, "top_k": 1}
    spec = sampling_spec(SamplingParams(temperature=0.7, top_k=0, top_p=1.0), 11).kwargs()
    assert spec == {"beam_width": 1, "top_k": 0, "top_p": 1.0, "temperature": 0.7, "seed": 11}  # both set: not greedy
    assert sampling_spec(SamplingParams(temperature=1.3, top_k=40, top_p=0.9), 3).kwargs()["top_k"] == 40
    with pytest.raises(ValueError, match="needs a seed"):
        sampling_spec(SAMPLING, None)


def test_end_ids_follow_eos_and_ignore_eos() -> None:
    assert end_ids(GREEDY, [2, 7]) == end_ids(GREEDY, {7, 2}) and end_ids(GREEDY, [7, 2]).end_id == 2
    assert end_ids(SamplingParams(ignore_eos=True), [2]).end_id == NO_END_ID
    assert end_ids(GREEDY, []).end_id == NO_END_ID


def test_verification_and_draft_requests_carry_what_the_round_needs() -> None:
    ids = end_ids(SAMPLING, [2])
    logits = torch.randn(3, 50)
    target = target_request([5, 6, 7], [8, 9, 10], SAMPLING, ids, 99, logits)
    assert target.kwargs() == {"input_token_ids": [5, 6, 7], "max_tokens": 4, "streaming": False, "end_id": 2, "pad_id": 2}
    assert target.draft is not None and target.draft.kwargs()["tokens"] == [8, 9, 10]
    assert target.draft.kwargs()["logits"] is logits and "acceptance_threshold" not in target.draft.kwargs()
    assert target.output.kwargs() == {"exclude_input_from_output": True, "return_generation_logits": False}
    assert target.sampling.seed == 99
    plain_step = target_request([5], [], GREEDY, end_ids(GREEDY, [2]), None)
    assert plain_step.max_tokens == 1 and plain_step.draft is None
    draft = draft_request([5, 6], 4, SAMPLING, ids, 100, want_logits=True)
    assert draft.max_tokens == 4 and draft.output.return_generation_logits and draft.draft is None
    assert not draft_request([5], 2, GREEDY, ids, None, want_logits=False).output.return_generation_logits
    stream = plain_request([5, 6], 30, GREEDY, ids, None)
    assert stream.streaming and stream.max_tokens == 30 and stream.draft is None
    with pytest.raises(ValueError, match="len\\(draft tokens\\) \\+ 1"):
        type(target)(target.input_token_ids, 2, target.sampling, 2, 2, draft=target.draft)


def test_every_keyword_is_one_the_bindings_document() -> None:
    ids = end_ids(SAMPLING, [2])
    specs = [target_request([1, 2], [3, 4], SAMPLING, ids, 1, torch.zeros(2, 8)), draft_request([1], 3, SAMPLING, ids, 2, True),
             plain_request([1], 9, GREEDY, ids, None)]
    for spec in specs:
        assert set(spec.kwargs()) | {"sampling_config", "output_config", "external_draft_tokens_config"} <= DOCUMENTED["Request"]
        assert set(spec.sampling.kwargs()) <= DOCUMENTED["SamplingConfig"]
        assert set(spec.output.kwargs()) <= DOCUMENTED["OutputConfig"]
        if spec.draft is not None:
            assert set(spec.draft.kwargs()) <= DOCUMENTED["ExternalDraftTokensConfig"]
    executor = executor_spec(TrtllmConfig(target_engine="t", kv_cache_free_gpu_memory_fraction=0.3), 4, [[0], [0, 1]])
    assert set(executor.kwargs()) <= DOCUMENTED["ExecutorConfig"] and set(executor.kv_cache.kwargs()) <= DOCUMENTED["KvCacheConfig"]
    assert executor.kv_cache.kwargs() == {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.3}
    assert executor.orchestrator and executor.medusa_choices == ((0,), (0, 1))
    assert not executor_spec(TrtllmConfig(target_engine="t"), 1).orchestrator


def test_each_request_gets_its_own_seed() -> None:
    seeds = {request_seed(7, i, role) for i in range(200) for role in SeedRole}
    assert len(seeds) == 400 and all(0 <= s < 2**64 for s in seeds)
    assert request_seed(7, 3, SeedRole.DRAFT) == request_seed(7, 3, SeedRole.DRAFT) != request_seed(8, 3, SeedRole.DRAFT)


@pytest.mark.parametrize("drafts,output,accepted", [
    ([4, 5, 6], [4, 5, 6, 7], 3), ([4, 5, 6], [4, 9], 1), ([4, 5, 6], [1], 0), ([], [3], 0), ([4, 2, 6], [4, 2], 2),
])
def test_accepted_drafts_are_the_common_prefix(drafts, output, accepted) -> None:
    assert count_accepted(drafts, output) == accepted


# -- the loop against the request contract (torch-computed, greedy) ---------------------------
@pytest.fixture(scope="module")
def tiny():
    target, draft = tiny_engine(0), tiny_engine(1)
    plain = SpeculativeDecoder(target, None)
    return target, draft, plain


def make_decoder(tiny, *, max_input_len: int = 128, eos: frozenset[int] = frozenset(), return_end_token: bool = True,
                 speculation: SpeculationConfig | None = None, draft_is_target: bool = False):
    target, draft, _ = tiny
    target_engine = TorchRequestEngine(target, "target", return_end_token=return_end_token)
    draft_engine = TorchRequestEngine(target if draft_is_target else draft, "draft")
    info = TargetInfo("tiny0", target.vocab_size, target.max_context, max_input_len, eos)
    decoder = TrtllmSpeculativeDecoder(target_engine, info, None, draft=EngineDrafter(draft_engine, 0.1),
                                       ngram=NgramDrafter(1, 3), speculation=speculation)
    return decoder, target_engine, draft_engine


PROMPT = [3, 17, 5, 9, 3, 17, 5]


@pytest.mark.parametrize("mode,k,draft_is_target", [("draft", 1, False), ("draft", 4, False), ("draft", 4, True),
                                                   ("ngram", 3, False), ("off", 4, False)])
def test_greedy_output_is_plain_decoding_and_requests_fit_the_rounds(tiny, mode, k, draft_is_target) -> None:
    decoder, target_engine, draft_engine = make_decoder(tiny, draft_is_target=draft_is_target)
    spec = SpeculationConfig(method=mode, draft_length=DraftLengthConfig(num_draft_tokens=k),
                             fallback=FallbackConfig(enabled=False))
    result = decoder.generate(PROMPT, GREEDY, spec)
    plain = tiny[2].generate(PROMPT, GREEDY, SpeculationConfig(method="off"))
    assert result.token_ids == plain.token_ids and result.finish_reason is FinishReason.LENGTH
    assert result.stats.method == mode and result.stats.generated_tokens == GREEDY.max_tokens
    if mode == "off":
        assert [r.streaming for r in target_engine.requests] == [True] and not draft_engine.requests
        return
    assert result.stats.drafted_tokens > 0 and result.stats.target_passes == len(target_engine.requests)
    full = PROMPT + result.token_ids
    lengths = [len(r.input_token_ids) for r in target_engine.requests]
    assert lengths[0] == len(PROMPT) and lengths == sorted(set(lengths))  # every round starts after the last commit
    for request in target_engine.requests:  # ... from exactly the committed tokens
        assert list(request.input_token_ids) == full[:len(request.input_token_ids)]
        assert request.max_tokens == (len(request.draft.tokens) if request.draft else 0) + 1 <= k + 1
    if draft_is_target:  # draft == target: every draft accepted, k + 1 tokens per target pass (bonus tokens)
        assert result.stats.acceptance_rate == 1.0 and result.stats.target_passes == -(-GREEDY.max_tokens // (k + 1))
    if mode == "draft":
        assert len(draft_engine.requests) == result.stats.speculative_rounds
        assert all(r.max_tokens <= k and not r.output.return_generation_logits for r in draft_engine.requests)


def test_streamed_chunks_add_up_to_the_result(tiny) -> None:
    decoder, _, _ = make_decoder(tiny)
    spec = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=3),
                             fallback=FallbackConfig(enabled=False))
    chunks = list(decoder.stream(PROMPT, GREEDY, spec))
    assert chunks[-1].finished and chunks[-1].stats is not None and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == decoder.generate(PROMPT, GREEDY, spec).token_ids


@pytest.mark.parametrize("return_end_token", [True, False])
def test_end_token_stops_with_eos_whether_or_not_the_engine_returns_it(tiny, return_end_token) -> None:
    plain = tiny[2].generate(PROMPT, GREEDY, SpeculationConfig(method="off")).token_ids
    eos = plain[10]
    expected = plain[:plain.index(eos)]
    for mode in ("draft", "off"):
        decoder, _, _ = make_decoder(tiny, eos=frozenset({eos}), return_end_token=return_end_token)
        result = decoder.generate(PROMPT, GREEDY, SpeculationConfig(method=mode,
                                                                    draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
        assert result.token_ids == expected and result.finish_reason is FinishReason.EOS, mode


def test_fallback_and_the_input_limit_continue_as_one_plain_stream(tiny) -> None:
    plain = tiny[2].generate(PROMPT, GREEDY, SpeculationConfig(method="off")).token_ids
    always_falls_back = SpeculationConfig(method="draft", draft_length=DraftLengthConfig(num_draft_tokens=2),
                                          fallback=FallbackConfig(threshold=1.0, min_drafted=1, window=2))
    decoder, target_engine, _ = make_decoder(tiny)
    result = decoder.generate(PROMPT, GREEDY, always_falls_back)
    if result.stats.accepted_tokens < result.stats.drafted_tokens:  # a rejection happened: the window fell below 1.0
        assert result.stats.fallback and target_engine.requests[-1].streaming
    assert result.token_ids == plain
    decoder, target_engine, _ = make_decoder(tiny, max_input_len=len(PROMPT) + 8)
    result = decoder.generate(PROMPT, GREEDY, SpeculationConfig(method="draft",
                                                                draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
    assert result.token_ids == plain and target_engine.requests[-1].streaming
    assert max(len(r.input_token_ids) for r in target_engine.requests) <= len(PROMPT) + 8
    with pytest.raises(ContextLengthError, match="at most 8 input tokens"):
        make_decoder(tiny, max_input_len=8)[0].generate(list(range(9)), GREEDY)


def test_a_medusa_engine_always_speculates_and_refuses_inexact_sampling(tiny) -> None:
    target, _, plain = tiny
    engine = TorchRequestEngine(target, "medusa-target")
    info = TargetInfo("tiny0", target.vocab_size, target.max_context, 128, frozenset())
    decoder = TrtllmSpeculativeDecoder(engine, info, medusa=EngineMedusa(depth=3))
    assert decoder.resolve(SpeculationMode.OFF)[0] is SpeculationMode.MEDUSA
    assert decoder.resolve(SpeculationMode.AUTO)[0] is SpeculationMode.MEDUSA
    result = decoder.generate(PROMPT, GREEDY, SpeculationConfig(method="off"))
    assert result.stats.method == "medusa" and result.token_ids == plain.generate(PROMPT, GREEDY).token_ids
    with pytest.raises(InvalidRequestError, match="Medusa engine verifies its tree with its own acceptance rule"):
        decoder.generate(PROMPT, SAMPLING)
    with pytest.raises(InvalidRequestError, match="not available"):
        decoder.generate(PROMPT, GREEDY, SpeculationConfig(method="ngram"))
    with pytest.raises(ValueError, match="only its own tree"):
        TrtllmSpeculativeDecoder(engine, info, ngram=NgramDrafter(), medusa=EngineMedusa(depth=3))


# -- build and deploy ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stand_in_build(tmp_path_factory):
    """`specbuild build` of a tiny target + tiny draft with a stand-in trtllm-build on PATH."""
    from build_fixtures import make_tiny_llama
    from builder.cli.main import main as cli_main
    from builder.stages.compile import TRTLLM_BUILD
    from triton_backend.core.reference_model import ensure_reference_model

    work = tmp_path_factory.mktemp("trtllm-build")
    reference = ensure_reference_model()
    target = make_tiny_llama(work / "models" / "target", reference, seed=1)
    draft = make_tiny_llama(work / "models" / "draft", reference, seed=2, layers=1)
    stand_in_trtllm_build(work / "bin")
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / TRTLLM_BUILD).exists()]
    out = work / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", os.pathsep.join([str(work / "bin"), *path]))
        code = cli_main(["build", "--target", str(target), "--draft", str(draft), "--precision", "fp16",
                         "--draft-precision", "fp16", "--kv-cache-dtype", "fp16", "--max-draft-len", "3",
                         "--calibration-samples", "2", "--calibration-max-length", "32", "--no-progress", "-o", str(out)])
    assert code == 0
    yield out, json.loads((out / "manifest.json").read_text())
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
def test_compiled_engines_render_a_deployment_that_selects_trtllm(stand_in_build) -> None:
    out, manifest = stand_in_build
    assert manifest["engines_compiled"] and {e["status"] for e in manifest["engines"].values()} == {"compiled"}
    file = out / manifest["model_repo"]["deployment"]
    raw = json.loads(file.read_text())
    assert raw["engine_runtime"] == "trtllm" and raw["trtllm"]["target_kind"] == "draft_tokens_external"
    deployment = load_deployment(file)
    assert deployment.trtllm is not None
    assert Path(deployment.trtllm.target_engine) == (out / "engines" / "target").resolve()
    assert Path(deployment.trtllm.draft_engine) == (out / "engines" / "draft").resolve()
    assert Path(deployment.target) == (out / "weights" / "target").resolve()  # tokenizer (and torch fallback)
    info = read_engine_info(deployment.trtllm.target_engine, "target")
    assert info.max_draft_len == 3 and info.vocab_size == 49152
    assert any("serves the compiled TensorRT-LLM engines" in n for n in manifest["notices"])


@pytest.mark.slow
@needs_no_trtllm
def test_serving_the_build_without_tensorrt_llm_fails_clearly_at_load(stand_in_build, tmp_path) -> None:
    from builder.ops.deploy import DeployError, check_engines_servable
    from triton_backend.serving.launch.triton_server import ServerConfig, ServerError, TritonServer

    out, manifest = stand_in_build
    with pytest.raises(ModelLoadError, match="TensorRT-LLM is not installed"):
        build_decoder(load_deployment(out / manifest["model_repo"]["deployment"]))
    with pytest.raises(DeployError, match="TensorRT-LLM is not installed here: run the GPU image"):
        check_engines_servable(out)
    server = TritonServer(ServerConfig(out / "model_repo", exit_timeout_s=5, startup_timeout_s=120,
                                       log_file=tmp_path / "tritonserver.log"))
    with pytest.raises(ServerError) as info:  # the real Triton Python backend loading the model
        server.start()
    server.stop()
    log = (tmp_path / "tritonserver.log").read_text()
    assert "TensorRT-LLM is not installed" in str(info.value) + log
    assert "ModuleNotFoundError" not in log and "ImportError" not in log


def test_deploy_refuses_a_trtllm_build_whose_manifest_does_not_mark_the_engines_compiled(tmp_path) -> None:
    from builder.ops.deploy import DeployError, check_engines_servable, deployment_runtimes
    from builder.stages.model_repository import render_model_repository

    deployment = DeploymentConfig(engine_runtime="trtllm", trtllm=TrtllmConfig(target_engine="../../../engines/target"))
    render_model_repository(deployment, tmp_path / "model_repo")
    assert deployment_runtimes(tmp_path / "model_repo") == {EngineRuntime.TRTLLM}
    (tmp_path / "manifest.json").write_text(json.dumps({"engines": {"target": {"status": "failed"}}}))
    with pytest.raises(DeployError, match="does not mark them all compiled"):
        check_engines_servable(tmp_path)
    render_model_repository(DeploymentConfig(), tmp_path / "torch" / "model_repo")
    check_engines_servable(tmp_path / "torch")  # torch deployments need no engines


def test_a_trtllm_deployment_launches_one_triton_process_whose_executor_spawns_the_ranks(tmp_path, caplog) -> None:
    import logging

    from builder.ops.deploy import launch_world_size
    from builder.stages.model_repository import render_model_repository

    (tmp_path / "plan.json").write_text(json.dumps({"tp_size": 2, "pp_size": 1}))
    deployment = DeploymentConfig(engine_runtime="trtllm", trtllm=TrtllmConfig(target_engine="../../../engines/target"))
    repository = render_model_repository(deployment, tmp_path / "model_repo")
    with caplog.at_level(logging.INFO, logger="builder.ops.deploy"):
        assert launch_world_size(repository, None) == (1, ())
    assert "spawns them itself (orchestrator mode)" in caplog.text and "has no TensorRT-LLM model" not in caplog.text
    assert executor_spec(deployment.trtllm, 2).orchestrator


# -- with the real library --------------------------------------------------------------------
@pytest.mark.trtllm
def test_real_engines_speculate_exactly(tmp_path) -> None:
    """On the GPU image: compile a tiny target and draft with the real trtllm-build, serve them
    with the trtllm runtime, and compare speculative with plain greedy output."""
    if not HAVE_TRTLLM or shutil.which("trtllm-build") is None or not torch.cuda.is_available():
        pytest.skip("needs TensorRT-LLM, its trtllm-build and a CUDA GPU (not installable here)")
    from build_fixtures import make_tiny_llama
    from builder.cli.main import main as cli_main
    from triton_backend.core.reference_model import ensure_reference_model

    reference = ensure_reference_model()
    target = make_tiny_llama(tmp_path / "target", reference, seed=1)
    draft = make_tiny_llama(tmp_path / "draft", reference, seed=1, layers=1)
    assert cli_main(["build", "--target", str(target), "--draft", str(draft), "--precision", "fp16",
                     "--draft-precision", "fp16", "--max-draft-len", "3", "--calibration-samples", "2",
                     "--no-progress", "-o", str(tmp_path / "out")]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    deployment = load_deployment(tmp_path / "out" / manifest["model_repo"]["deployment"])
    assert deployment.engine_runtime is EngineRuntime.TRTLLM
    decoder = build_decoder(deployment)
    assert isinstance(decoder, TrtllmSpeculativeDecoder)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        spec = decoder.generate(prompt, GREEDY, SpeculationConfig(method="draft",
                                                                  draft_length=DraftLengthConfig(num_draft_tokens=3), fallback=FallbackConfig(enabled=False)))
        plain = decoder.generate(prompt, GREEDY, SpeculationConfig(method="off"))
        assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0


@pytest.mark.trtllm
def test_real_executor_accepts_the_requests_as_built() -> None:
    if not HAVE_TRTLLM:
        pytest.skip("needs TensorRT-LLM (not installable here)")
    from triton_backend.engines.trtllm.engine import executor_bindings, to_executor_request

    try:
        bindings = executor_bindings()
    except ModelLoadError as exc:  # installed, but its CUDA libraries cannot load here
        pytest.skip(str(exc))
    ids = end_ids(SAMPLING, [2])
    request = to_executor_request(bindings, target_request([1, 2, 3], [4, 5], SAMPLING, ids, 9, None))
    assert request.max_tokens == 3 and list(request.external_draft_tokens_config.tokens) == [4, 5]
    assert request.sampling_config.seed == 9 and request.output_config.exclude_input_from_output
