"""``ensemble`` as NVIDIA's layout renders it: a Triton ensemble (``platform: "ensemble"``) of
``preprocessing`` -> ``tensorrt_llm`` -> ``postprocessing`` (``ServingConfig.ensemble_mode``
``pipeline``).

Each ensemble request is then one request of each of the three models (and ``tensorrt_llm``
forwards it once to the serving model), as with tensorrtllm_backend r25.05, whose CI
(``ci/L0_backend_trtllm/base_metrics_verification_tests.py``) checks that every model reports
the same ``nv_inference_*`` counts after a run of ensemble requests. ``tensorrt_llm`` is
rendered to execute one request per call there (``preferred_batch_size`` 1), so its
``exec_count`` is its request count, as TensorRT-LLM's backend reports it.

The ensemble's inputs are those of r25.05's ensemble that the three models honour, with their
r25.05 names, types and dims (:mod:`triton_backend.serving.trtllm_interface`); the step maps
below say where each goes. What the ``forward`` ensemble adds on top of the text (chat
templates, text stop strings matched on the text, guides, incremental detokenization of a
stream) is not in this layout: ``postprocessing`` decodes each streamed chunk on its own, as
r25.05's does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from triton_backend.serving.interface import ServingConfig
from triton_backend.serving.tensors import TensorSpec
from triton_backend.serving.trtllm_interface import (
    ENSEMBLE_SERVED_INPUTS, PERF_OUTPUTS, TEXT_SERVED_OUTPUTS,
)

# ensemble input -> preprocessing input
TO_PREPROCESSING: tuple[tuple[str, str], ...] = (
    ("text_input", "QUERY"), ("max_tokens", "REQUEST_OUTPUT_LEN"), ("bad_words", "BAD_WORDS_DICT"),
    ("stop_words", "STOP_WORDS_DICT"), ("end_id", "END_ID"), ("pad_id", "PAD_ID"),
)
# preprocessing output -> the ensemble's internal tensor -> tensorrt_llm input
PREPROCESSED: tuple[tuple[str, str], ...] = (
    ("INPUT_ID", "input_ids"), ("REQUEST_INPUT_LEN", "input_lengths"), ("DECODER_INPUT_ID", "decoder_input_ids"),
    ("REQUEST_DECODER_INPUT_LEN", "decoder_input_lengths"), ("REQUEST_OUTPUT_LEN", "request_output_len"),
    ("STOP_WORDS_IDS", "stop_words_list"), ("BAD_WORDS_IDS", "bad_words_list"), ("OUT_END_ID", "end_id"),
    ("OUT_PAD_ID", "pad_id"),
)
# ensemble input -> tensorrt_llm input
TO_TENSORRT_LLM: tuple[tuple[str, str], ...] = (
    ("exclude_input_in_output", "exclude_input_in_output"), ("top_k", "runtime_top_k"), ("top_p", "runtime_top_p"),
    ("temperature", "temperature"), ("length_penalty", "len_penalty"), ("repetition_penalty", "repetition_penalty"),
    ("min_tokens", "min_tokens"), ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ("seed", "seed"), ("return_log_probs", "return_log_probs"), ("return_context_logits", "return_context_logits"),
    ("return_generation_logits", "return_generation_logits"), ("return_perf_metrics", "return_perf_metrics"),
    ("num_return_sequences", "num_return_sequences"), ("beam_width", "beam_width"), ("stream", "streaming"),
    ("guided_decoding_guide_type", "guided_decoding_guide_type"), ("guided_decoding_guide", "guided_decoding_guide"),
)
# tensorrt_llm output -> ensemble output (besides the tokens, which go to postprocessing)
FROM_TENSORRT_LLM: tuple[str, ...] = tuple(spec.name for spec in PERF_OUTPUTS)
TOKENS, LENGTHS = "_TOKENS_BATCH", "_SEQUENCE_LENGTH"


def _internal(name: str) -> str:
    return "_" + name


def _maps(kind: str, pairs: Sequence[tuple[str, str]]) -> str:
    return "\n".join(f'      {kind}_map {{\n        key: "{key}"\n        value: "{value}"\n      }}'
                     for key, value in pairs)


def _step(model: str, inputs: Sequence[tuple[str, str]], outputs: Sequence[tuple[str, str]]) -> str:
    return (f'    {{\n      model_name: "{model}"\n      model_version: -1\n'
            f'{_maps("input", inputs)}\n{_maps("output", outputs)}\n    }}')


REQUIRED = ("text_input", "max_tokens")  # as in r25.05's ensemble: preprocessing needs both


def pipeline_inputs() -> tuple[TensorSpec, ...]:
    """The ensemble's inputs: r25.05's specs of the names the steps take, in r25.05's order."""
    wanted = {name for name, _ in TO_PREPROCESSING + TO_TENSORRT_LLM}
    specs = {spec.name: spec for spec in ENSEMBLE_SERVED_INPUTS}
    missing = sorted(wanted - set(specs))
    if missing:
        raise ValueError(f"ensemble inputs without an r25.05 spec: {missing}")
    return tuple(replace(specs[name], optional=name not in REQUIRED) for name in specs if name in wanted)


def pipeline_outputs() -> tuple[TensorSpec, ...]:
    specs = {spec.name: spec for spec in TEXT_SERVED_OUTPUTS}
    return tuple(specs[name] for name in ("text_output", *FROM_TENSORRT_LLM))


def render_pipeline_ensemble(serving: ServingConfig, tensor_blocks) -> str:
    """config.pbtxt of the pipeline ``ensemble``; ``tensor_blocks(specs, is_input)`` renders tensors
    as every other config of the repository does."""
    names = serving.trtllm_models
    assert names is not None and names.ensemble and names.tokens and names.preprocessing and names.postprocessing
    pre = _step(names.preprocessing, [(model, ours) for ours, model in TO_PREPROCESSING],
                [(out, _internal(out)) for out, _ in PREPROCESSED])
    tokens = _step(names.tokens,
                   [(model, _internal(out)) for out, model in PREPROCESSED] + [(m, o) for o, m in TO_TENSORRT_LLM],
                   [("output_ids", TOKENS), ("sequence_length", LENGTHS)] + [(n, n) for n in FROM_TENSORRT_LLM])
    post = _step(names.postprocessing, [("TOKENS_BATCH", TOKENS), ("SEQUENCE_LENGTH", LENGTHS)],
                 [("OUTPUT", "text_output")])
    return (f'# Rendered by specbuild from a typed ServingConfig (ensemble_mode "pipeline"): change the config, '
            f'not this file.\nname: "{names.ensemble}"\nplatform: "ensemble"\nmax_batch_size: {serving.max_batch_size}\n'
            f'input [\n{tensor_blocks(pipeline_inputs(), True)}\n]\n'
            f'output [\n{tensor_blocks(pipeline_outputs(), False)}\n]\n'
            f'ensemble_scheduling {{\n  step [\n{pre},\n{tokens},\n{post}\n  ]\n}}\n')


ONE_REQUEST_PER_EXECUTION = "  preferred_batch_size: [ 1 ]\n"

__all__ = ["ONE_REQUEST_PER_EXECUTION", "pipeline_inputs", "pipeline_outputs", "render_pipeline_ensemble"]
