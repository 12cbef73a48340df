"""The tensorrtllm_backend interface (branch r25.05, ``all_models/inflight_batcher_llm``), as
specbuild serves it: the text-level models (``ensemble``, ``tensorrt_llm_bls``), the token-level
model (``tensorrt_llm``) and the tokenizer models (``preprocessing``, ``postprocessing``).

Names, data types and dims are those of r25.05's ``config.pbtxt`` files, so NVIDIA's clients
and documented requests reach specbuild unchanged. Every input is either honoured (see
:mod:`triton_backend.serving.trtllm_inputs`) or listed in :data:`REFUSED` with the only value accepted
and the reason: a request that sets it otherwise is refused with a short error naming it.
No torch here (the renderer imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from triton_backend.serving.interface import (
    ACCEPTANCE_RATE, BAD_WORDS, CHAT, END_ID, EXCLUDE_INPUT, FINISH_REASON, GUIDE, GUIDE_TYPE, IGNORE_EOS, INPUTS,
    MAX_TOKENS,
    NUM_DRAFT_TOKENS, OUTPUTS, RANDOM_SEED, SPECULATION, STOP_WORDS, STREAM, TEMPERATURE, TEXT_INPUT, TEXT_OUTPUT, TOP_K, TOP_P,
    TOTAL_ACCEPTED, TOTAL_DRAFT,
)
from triton_backend.serving.tensors import TensorSpec
from triton_backend.serving.tensors import TritonType as T


def _in(name: str, dtype: T, dims: tuple[int, ...] = (1,), doc: str = "") -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True, doc=doc)


def _out(name: str, dtype: T, dims: tuple[int, ...] = (1,), doc: str = "") -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=False, doc=doc)


# -- inputs shared by the text and token levels ---------------------------------------------
PAD_ID = _in("pad_id", T.INT32, doc="pads output_ids; checked to be a token id")
BEAM_WIDTH = _in("beam_width", T.INT32, doc="1 only (speculation verifies one sequence)")
NUM_RETURN_SEQUENCES = _in("num_return_sequences", T.INT32, doc="1 only")
LENGTH_PENALTY = _in("length_penalty", T.FP32, doc="beam search only: no effect at beam_width 1")
REPETITION_PENALTY = _in("repetition_penalty", T.FP32, doc="1 = off; > 1 discourages seen tokens")
MIN_TOKENS = _in("min_tokens", T.INT32, doc="end tokens are masked until this many are generated")
PRESENCE_PENALTY = _in("presence_penalty", T.FP32, doc="0 = off; subtracted once from a seen token's logit")
FREQUENCY_PENALTY = _in("frequency_penalty", T.FP32, doc="0 = off; subtracted per occurrence")
SEED = _in("seed", T.UINT64, doc="seed of the sampler (r25.05 name; random_seed also accepted)")
RETURN_LOG_PROBS = _in("return_log_probs", T.BOOL, doc="add cum_log_probs and output_log_probs")
RETURN_CONTEXT_LOGITS = _in("return_context_logits", T.BOOL)
RETURN_GENERATION_LOGITS = _in("return_generation_logits", T.BOOL)
RETURN_PERF_METRICS = _in("return_perf_metrics", T.BOOL, doc="add timing, KV-cache and acceptance outputs")
PROMPT_EMBEDDING_TABLE = _in("prompt_embedding_table", T.FP16, (-1, -1))
PROMPT_VOCAB_SIZE = _in("prompt_vocab_size", T.INT32)
LORA_TASK_ID = _in("lora_task_id", T.UINT64)
LORA_WEIGHTS = _in("lora_weights", T.FP16, (-1, -1))
LORA_CONFIG = _in("lora_config", T.INT32, (-1, 3))

# -- text level -----------------------------------------------------------------------------
DECODER_TEXT_INPUT = _in("decoder_text_input", T.STRING)
PROMPT_TABLE_EXTRA_ID = _in("prompt_table_extra_id", T.UINT64)
EMBEDDING_BIAS_WORDS = _in("embedding_bias_words", T.STRING, (-1,))
EMBEDDING_BIAS_WEIGHTS = _in("embedding_bias_weights", T.FP32, (-1,))
USE_DRAFT_LOGITS = _in("use_draft_logits", T.BOOL, doc="true only: drafts are always verified with their probabilities")

ENSEMBLE_INPUTS: tuple[TensorSpec, ...] = (
    TEXT_INPUT, DECODER_TEXT_INPUT, MAX_TOKENS, NUM_RETURN_SEQUENCES, BAD_WORDS, STOP_WORDS, EXCLUDE_INPUT, END_ID,
    PAD_ID, TOP_K, TOP_P, TEMPERATURE, LENGTH_PENALTY, REPETITION_PENALTY, MIN_TOKENS, PRESENCE_PENALTY,
    FREQUENCY_PENALTY, SEED, RETURN_LOG_PROBS, RETURN_CONTEXT_LOGITS, RETURN_GENERATION_LOGITS, RETURN_PERF_METRICS,
    BEAM_WIDTH, STREAM, PROMPT_EMBEDDING_TABLE, PROMPT_TABLE_EXTRA_ID, PROMPT_VOCAB_SIZE, EMBEDDING_BIAS_WORDS,
    EMBEDDING_BIAS_WEIGHTS, LORA_TASK_ID, LORA_WEIGHTS, LORA_CONFIG, GUIDE_TYPE, GUIDE,
)
BLS_INPUTS: tuple[TensorSpec, ...] = ENSEMBLE_INPUTS + (
    _in("image_input", T.FP16, (-1, 3, -1, -1)), _in("image_bytes_input", T.UINT8, (-1, -1, -1, -1)),
    _in("image_url_input", T.STRING), _in("video_bytes_input", T.UINT8, (-1, -1, -1, -1)),
    NUM_DRAFT_TOKENS, USE_DRAFT_LOGITS,
)
# ours, on the text-level models too (all optional)
TEXT_EXTRAS: tuple[TensorSpec, ...] = (RANDOM_SEED, NUM_DRAFT_TOKENS, SPECULATION, CHAT, IGNORE_EOS)

# ours, on the serving model only: the most likely tokens per output position (the OpenAI front's top_logprobs)
TOP_LOG_PROBS = _in("top_log_probs", T.INT32, doc="with return_log_probs: this many most likely tokens per output "
                                                  "position (0..20) -> output_top_ids, output_top_log_probs")
OUTPUT_TOP_IDS = _out("output_top_ids", T.INT32, (-1, -1, -1), "per beam, output token and rank: token id")
OUTPUT_TOP_LOG_PROBS = _out("output_top_log_probs", T.FP32, (-1, -1, -1),
                            "per beam, output token and rank: its log probability (most likely first)")
CUM_LOG_PROBS = _out("cum_log_probs", T.FP32, (-1,), "per beam: sum of the output tokens' log probabilities")
OUTPUT_LOG_PROBS = _out("output_log_probs", T.FP32, (-1, -1), "per beam and output token")
CONTEXT_LOGITS = _out("context_logits", T.FP32, (-1, -1))
GENERATION_LOGITS = _out("generation_logits", T.FP32, (-1, -1, -1))
BATCH_INDEX = _out("batch_index", T.INT32)
SEQUENCE_INDEX = _out("sequence_index", T.INT32)
KV_NEW_BLOCKS = _out("kv_cache_alloc_new_blocks", T.INT32)
KV_REUSED_BLOCKS = _out("kv_cache_reused_blocks", T.INT32)
KV_TOTAL_BLOCKS = _out("kv_cache_alloc_total_blocks", T.INT32)
ARRIVAL_NS = _out("arrival_time_ns", T.INT64)
FIRST_SCHEDULED_NS = _out("first_scheduled_time_ns", T.INT64)
FIRST_TOKEN_NS = _out("first_token_time_ns", T.INT64)
LAST_TOKEN_NS = _out("last_token_time_ns", T.INT64)
PERF_OUTPUTS: tuple[TensorSpec, ...] = (KV_NEW_BLOCKS, KV_REUSED_BLOCKS, KV_TOTAL_BLOCKS, ARRIVAL_NS,
                                        FIRST_SCHEDULED_NS, FIRST_TOKEN_NS, LAST_TOKEN_NS, ACCEPTANCE_RATE,
                                        TOTAL_ACCEPTED, TOTAL_DRAFT)
_COMMON_OUTPUTS = (CUM_LOG_PROBS, OUTPUT_LOG_PROBS, CONTEXT_LOGITS, GENERATION_LOGITS, BATCH_INDEX, SEQUENCE_INDEX)
TEXT_OUTPUTS: tuple[TensorSpec, ...] = (TEXT_OUTPUT,) + _COMMON_OUTPUTS + PERF_OUTPUTS

# -- token level (tensorrt_llm) -------------------------------------------------------------
INPUT_IDS = _in("input_ids", T.INT32, (-1,), "the prompt's token ids")
DRAFT_INPUT_IDS = _in("draft_input_ids", T.INT32, (-1,), "a client's draft tokens, verified in the first round")
DRAFT_LOGITS = _in("draft_logits", T.FP32, (-1, -1), "the draft model's logits of draft_input_ids [k, vocab]")
INPUT_LENGTHS = TensorSpec("input_lengths", T.INT32, (1,), optional=False, doc="len(input_ids)")
REQUEST_OUTPUT_LEN = TensorSpec("request_output_len", T.INT32, (1,), optional=False, doc="tokens to generate at most")
STREAMING = _in("streaming", T.BOOL, doc="one response per verified block")
RUNTIME_TOP_K = _in("runtime_top_k", T.INT32)
RUNTIME_TOP_P = _in("runtime_top_p", T.FP32)
STOP_WORDS_LIST = _in("stop_words_list", T.INT32, (2, -1), "[ids; end offsets] (preprocessing's layout)")
BAD_WORDS_LIST = _in("bad_words_list", T.INT32, (2, -1), "[ids; end offsets] (preprocessing's layout)")
STOP = _in("stop", T.BOOL, doc="false only: cancel a request by closing its stream")

TOKEN_INPUTS: tuple[TensorSpec, ...] = (
    INPUT_IDS, _in("encoder_input_features", T.FP16, (-1, -1)), _in("encoder_output_lengths", T.INT32),
    INPUT_LENGTHS, REQUEST_OUTPUT_LEN, NUM_RETURN_SEQUENCES, DRAFT_INPUT_IDS,
    _in("decoder_input_ids", T.INT32, (-1,)), _in("decoder_input_lengths", T.INT32),
    DRAFT_LOGITS, _in("draft_acceptance_threshold", T.FP32), END_ID, PAD_ID,
    STOP_WORDS_LIST, BAD_WORDS_LIST, _in("embedding_bias", T.FP32, (-1,)), BEAM_WIDTH, TEMPERATURE, RUNTIME_TOP_K,
    RUNTIME_TOP_P, _in("runtime_top_p_min", T.FP32), _in("runtime_top_p_decay", T.FP32),
    _in("runtime_top_p_reset_ids", T.INT32), _in("len_penalty", T.FP32), _in("early_stopping", T.BOOL),
    REPETITION_PENALTY, MIN_TOKENS, _in("beam_search_diversity_rate", T.FP32), PRESENCE_PENALTY, FREQUENCY_PENALTY,
    SEED, RETURN_LOG_PROBS, RETURN_CONTEXT_LOGITS, RETURN_GENERATION_LOGITS, RETURN_PERF_METRICS, EXCLUDE_INPUT, STOP,
    STREAMING, PROMPT_EMBEDDING_TABLE, _in("prompt_table_extra_ids", T.UINT64, (-1,)), PROMPT_VOCAB_SIZE,
    _in("cross_attention_mask", T.BOOL, (-1, -1)), _in("mrope_rotary_cos_sin", T.FP32, (-1,)),
    _in("mrope_position_deltas", T.INT64), LORA_TASK_ID, LORA_WEIGHTS, LORA_CONFIG,
    _in("context_phase_params", T.UINT8, (-1,)), _in("skip_cross_attn_blocks", T.BOOL),
    _in("retention_token_range_starts", T.INT32, (-1,)), _in("retention_token_range_ends", T.INT32, (-1,)),
    _in("retention_token_range_priorities", T.INT32, (-1,)), _in("retention_token_range_durations_ms", T.INT32, (-1,)),
    _in("retention_decode_priority", T.INT32), _in("retention_decode_duration_ms", T.INT32), GUIDE_TYPE, GUIDE,
    _in("lookahead_window_size", T.INT32), _in("lookahead_ngram_size", T.INT32),
    _in("lookahead_verification_set_size", T.INT32),
)
OUTPUT_IDS = _out("output_ids", T.INT32, (-1, -1), "[beam, tokens]")
SEQUENCE_LENGTH = _out("sequence_length", T.INT32, (-1,), "per beam: tokens in output_ids")
TOKEN_OUTPUTS: tuple[TensorSpec, ...] = ((OUTPUT_IDS, SEQUENCE_LENGTH) + _COMMON_OUTPUTS
                                         + (_out("context_phase_params", T.UINT8, (-1,)),) + PERF_OUTPUTS)

# -- tokenizer models -----------------------------------------------------------------------
PRE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("QUERY", T.STRING, (1,), optional=False), _in("DECODER_QUERY", T.STRING),
    _in("IMAGE_BYTES", T.UINT8, (-1, -1, -1, -1)), _in("IMAGE_URL", T.STRING), _in("VIDEO_BYTES", T.UINT8, (-1, -1, -1, -1)),
    TensorSpec("REQUEST_OUTPUT_LEN", T.INT32, (1,), optional=False), _in("BAD_WORDS_DICT", T.STRING, (-1,)),
    _in("STOP_WORDS_DICT", T.STRING, (-1,)), _in("EMBEDDING_BIAS_WORDS", T.STRING, (-1,)),
    _in("EMBEDDING_BIAS_WEIGHTS", T.FP32, (-1,)), _in("END_ID", T.INT32), _in("PAD_ID", T.INT32),
    _in("PROMPT_TABLE_EXTRA_ID", T.UINT64),
)
PRE_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("INPUT_ID", T.INT32, (-1,)), _out("REQUEST_INPUT_LEN", T.INT32), _out("DECODER_INPUT_ID", T.INT32, (-1,)),
    _out("REQUEST_DECODER_INPUT_LEN", T.INT32), _out("BAD_WORDS_IDS", T.INT32, (2, -1)),
    _out("STOP_WORDS_IDS", T.INT32, (2, -1)), _out("EMBEDDING_BIAS", T.FP32, (-1,)),
    _out("REQUEST_OUTPUT_LEN", T.INT32, (-1,)), _out("OUT_END_ID", T.INT32), _out("OUT_PAD_ID", T.INT32),
    _out("OUT_PROMPT_TABLE_EXTRA_IDS", T.UINT64, (-1,)), _out("PIXEL_VALUES", T.FP16, (-1, -1, -1, -1)),
    _out("ASPECT_RATIO_IDS", T.INT64, (-1,)), _out("ASPECT_RATIO_MASK", T.INT64, (-1, -1)),
    _out("CROSS_ATTENTION_MASK", T.INT64, (-1, -1, -1)), _out("IMAGE_SIZES", T.INT64, (2,)),
    _out("IS_VIDEO_INPUT", T.BOOL), _out("ATTENTION_MASK", T.INT64, (-1,)), _out("IMAGE_GRID_THW", T.INT64, (3,)),
    _out("VISION_INPUT_ID", T.INT32, (-1,)),
)
POST_INPUTS: tuple[TensorSpec, ...] = (TensorSpec("TOKENS_BATCH", T.INT32, (-1, -1), optional=False),
                                       TensorSpec("SEQUENCE_LENGTH", T.INT32, (-1,), optional=False))
POST_OUTPUTS: tuple[TensorSpec, ...] = (_out("OUTPUT", T.STRING, (-1,)),)


# -- what is refused --------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """An input specbuild does not implement: accepted only ``absent`` (or empty), ``false``,
    or ``true``; anything else is refused with ``reason``. An ``absent`` input with
    ``placeholder_max`` > 0 is also accepted, and ignored, with at most that many elements, each
    at most ``placeholder_value_max`` when that is set: preprocessing's placeholder decoder prompt
    (``DECODER_INPUT_ID`` ``[pad_id]``, ``REQUEST_DECODER_INPUT_LEN`` 1), which TensorRT-LLM
    ignores for a decoder-only model and r25.05's ``end_to_end_test.py`` sends to ``tensorrt_llm``."""

    accepts: str  # "absent" | "false" | "true"
    reason: str
    placeholder_max: int = 0
    placeholder_value_max: int | None = None


_NOT_OFFERED = "is not offered by specbuild"
REFUSED: dict[str, Refusal] = {
    **{name: Refusal("absent", _NOT_OFFERED + " (multimodal / encoder-decoder inputs)") for name in (
        "decoder_text_input", "image_input", "image_bytes_input", "image_url_input", "video_bytes_input",
        "encoder_input_features", "encoder_output_lengths",
        "cross_attention_mask", "mrope_rotary_cos_sin", "mrope_position_deltas", "skip_cross_attn_blocks",
        "DECODER_QUERY", "IMAGE_BYTES", "IMAGE_URL", "VIDEO_BYTES")},
    "decoder_input_ids": Refusal("absent", _NOT_OFFERED + " (encoder-decoder input; preprocessing's one-token "
                                 "placeholder [pad_id] is accepted and ignored)", placeholder_max=1),
    "decoder_input_lengths": Refusal("absent", _NOT_OFFERED + " (encoder-decoder input; the placeholder's length 1 "
                                     "is accepted and ignored)", placeholder_max=1, placeholder_value_max=1),
    **{name: Refusal("absent", _NOT_OFFERED + " (prompt tables / LoRA)") for name in (
        "prompt_embedding_table", "prompt_table_extra_id", "prompt_table_extra_ids", "prompt_vocab_size",
        "lora_task_id", "lora_weights", "lora_config", "PROMPT_TABLE_EXTRA_ID")},
    **{name: Refusal("absent", _NOT_OFFERED + " (logit bias)") for name in (
        "embedding_bias", "embedding_bias_words", "embedding_bias_weights", "EMBEDDING_BIAS_WORDS",
        "EMBEDDING_BIAS_WEIGHTS")},
    "draft_acceptance_threshold": Refusal("absent", "is not offered: a fixed acceptance threshold does not keep the "
                                          "target's distribution (specbuild verifies draft_logits with the "
                                          "rejection rule)"),
    **{name: Refusal("absent", _NOT_OFFERED + " (top-p decay, KV retention, disaggregated serving, lookahead)")
       for name in ("runtime_top_p_min", "runtime_top_p_decay", "runtime_top_p_reset_ids", "context_phase_params",
                    "retention_token_range_starts", "retention_token_range_ends",
                    "retention_token_range_priorities", "retention_token_range_durations_ms",
                    "retention_decode_priority", "retention_decode_duration_ms", "lookahead_window_size",
                    "lookahead_ngram_size", "lookahead_verification_set_size")},
    "return_context_logits": Refusal("false", _NOT_OFFERED),
    "return_generation_logits": Refusal("false", _NOT_OFFERED),
    "use_draft_logits": Refusal("true", "= false (token-match acceptance) " + _NOT_OFFERED
                                + ": drafts are verified with their probabilities"),
    "stop": Refusal("false", "= true: cancel a request by closing its stream or connection"),
}

# beam-search-only settings: accepted, no effect at beam_width 1 (as in TensorRT-LLM)
BEAM_ONLY = ("length_penalty", "len_penalty", "early_stopping", "beam_search_diversity_rate")


def union(*groups: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """The specs of ``groups`` in order, each name once; the same name must agree in dtype and dims."""
    seen: dict[str, TensorSpec] = {}
    for spec in (s for group in groups for s in group):
        other = seen.get(spec.name)
        if other is None:
            seen[spec.name] = spec
        elif (other.dtype, other.dims) != (spec.dtype, spec.dims):
            raise ValueError(f"tensor {spec.name!r} declared twice with different types: {other} / {spec}")
    return tuple(seen.values())


def _all_optional(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    from dataclasses import replace

    return tuple(replace(s, optional=True) for s in specs)


# the serving model (text and token level in one process): every input any front model forwards
SERVED_INPUTS: tuple[TensorSpec, ...] = _all_optional(union(INPUTS, BLS_INPUTS, TEXT_EXTRAS, TOKEN_INPUTS,
                                                            (TOP_LOG_PROBS,)))
SERVED_OUTPUTS: tuple[TensorSpec, ...] = union(OUTPUTS, TEXT_OUTPUTS, TOKEN_OUTPUTS,
                                               (OUTPUT_TOP_IDS, OUTPUT_TOP_LOG_PROBS))
# the text-level front models: r25.05's tensors plus ours
ENSEMBLE_SERVED_INPUTS = union(ENSEMBLE_INPUTS, TEXT_EXTRAS, (EXCLUDE_INPUT,))
BLS_SERVED_INPUTS = union(BLS_INPUTS, TEXT_EXTRAS)
TEXT_SERVED_OUTPUTS = union(TEXT_OUTPUTS, OUTPUTS)
TOKEN_SERVED_OUTPUTS = union(TOKEN_OUTPUTS, (FINISH_REASON,) + tuple(o for o in OUTPUTS if o.name != "text_output"))

__all__ = ["BEAM_ONLY", "REFUSED", "Refusal", "SERVED_INPUTS", "SERVED_OUTPUTS", "union"]
