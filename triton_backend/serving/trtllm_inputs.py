"""Reading the tensorrtllm_backend inputs (text and token level) into typed values.

:func:`triton_backend.serving.service.parse_request` calls these; each raises
:class:`~triton_backend.core.errors.InvalidRequestError` naming the input at fault. Inputs that
two levels spell differently (``max_tokens`` / ``request_output_len``, ``stream`` /
``streaming``, ``top_k`` / ``runtime_top_k``, ``seed`` / ``random_seed``) are one setting:
sending both with different values is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from triton_backend.core.errors import InvalidRequestError
from triton_backend.core.guide import Guide

if TYPE_CHECKING:
    from triton_backend.speculation.drafters.client import ClientDraft
from triton_backend.core.config import check_sampling_values
from triton_backend.serving.interface import MAX_TOKENS, STREAM, TEMPERATURE, TEXT_INPUT, TOP_K, TOP_P
from triton_backend.serving.interface import RANDOM_SEED as OUR_SEED
from triton_backend.serving.tensors import TensorSpec, read_ids, read_matrix, read_scalar
from triton_backend.serving.trtllm_interface import (
    BEAM_WIDTH, INPUT_IDS, INPUT_LENGTHS, NUM_RETURN_SEQUENCES, PAD_ID, REFUSED, REQUEST_OUTPUT_LEN, RUNTIME_TOP_K,
    RUNTIME_TOP_P, SEED, STREAMING, Refusal,
)


def _optional(spec: TensorSpec) -> TensorSpec:
    """The serving model takes both levels' tensors: what one level requires is optional there."""
    return replace(spec, optional=True)


def _placeholder(arr: np.ndarray, refusal: Refusal) -> bool:
    """Whether ``arr`` is the placeholder ``refusal`` lets through (see :class:`Refusal`)."""
    if not 0 < arr.size <= refusal.placeholder_max or arr.dtype == np.object_:
        return False
    return refusal.placeholder_value_max is None or bool((arr <= refusal.placeholder_value_max).all())


def refuse_unsupported(arrays: Mapping[str, np.ndarray]) -> None:
    """Refuse any input of :data:`REFUSED` set to something other than what it accepts."""
    for name in sorted(set(arrays) & set(REFUSED)):
        refusal = REFUSED[name]
        arr = np.asarray(arrays[name])
        if refusal.accepts == "absent":
            if _placeholder(arr, refusal):
                continue
            if arr.size and not (arr.dtype == np.object_ and all(not v for v in arr.reshape(-1))):
                raise InvalidRequestError(f"{name} {refusal.reason}; leave it out")
        else:
            wanted = refusal.accepts == "true"
            if arr.size and any(bool(v) != wanted for v in arr.reshape(-1)):
                raise InvalidRequestError(f"{name} {refusal.reason}")


def one_of(arrays: Mapping[str, np.ndarray], first: TensorSpec, second: TensorSpec) -> Any:
    """The value of ``first`` or ``second`` (two spellings of one setting); both differing: refused."""
    a, b = read_scalar(arrays, _optional(first)), read_scalar(arrays, _optional(second))
    if a is not None and b is not None and a != b:
        raise InvalidRequestError(f"{first.name} ({a!r}) and {second.name} ({b!r}) disagree; send one")
    return a if a is not None else b


def read_prompt(arrays: Mapping[str, np.ndarray]) -> str | tuple[int, ...]:
    """``text_input`` (text level) or ``input_ids`` cut to ``input_lengths`` (token level)."""
    has_text, has_ids = TEXT_INPUT.name in arrays, INPUT_IDS.name in arrays
    if has_text and has_ids:
        raise InvalidRequestError("send text_input (text level) or input_ids (token level), not both")
    if not has_ids:
        prompt = read_scalar(arrays, TensorSpec(TEXT_INPUT.name, TEXT_INPUT.dtype, optional=False))
        if not prompt:
            raise InvalidRequestError("text_input is empty")
        return prompt
    ids = read_ids(arrays, INPUT_IDS) or []
    length = read_scalar(arrays, _optional(INPUT_LENGTHS))
    if length is None:
        raise InvalidRequestError("input_lengths is required with input_ids")
    if not 0 < length <= len(ids):
        raise InvalidRequestError(f"input_lengths ({length}) must be in [1, {len(ids)}] (the ids sent)")
    if any(t < 0 for t in ids[:length]):
        raise InvalidRequestError("input_ids must be token ids >= 0")
    return tuple(ids[:length])


def read_max_tokens(arrays: Mapping[str, np.ndarray], default: int) -> int:
    value = one_of(arrays, MAX_TOKENS, REQUEST_OUTPUT_LEN)
    return default if value is None else value


def read_stream(arrays: Mapping[str, np.ndarray]) -> bool:
    return bool(one_of(arrays, STREAM, STREAMING))


def read_seed(arrays: Mapping[str, np.ndarray]) -> int | None:
    return one_of(arrays, SEED, OUR_SEED)


def read_top_k_p(arrays: Mapping[str, np.ndarray]) -> tuple[int | None, float | None]:
    """``top_k`` / ``runtime_top_k`` and ``top_p`` / ``runtime_top_p``. TensorRT-LLM's
    ``runtime_top_p`` 0 (what NVIDIA's clients send by default) means "off", as in TensorRT-LLM,
    and reads as ``None``; our ``top_p`` is checked as on every path (0 is refused:
    :func:`~triton_backend.core.config.check_sampling_values`; the tensorrtllm_backend front models
    turn their ``top_p`` 0 into "off" before forwarding: :func:`trtllm_request_defaults`)."""
    top_p = one_of(arrays, TOP_P, RUNTIME_TOP_P)
    ours = read_scalar(arrays, _optional(TOP_P))
    if ours is not None:
        check_sampling_values(top_p=ours)
    return one_of(arrays, TOP_K, RUNTIME_TOP_K), None if top_p == 0 else top_p


def trtllm_request_defaults(arrays: Mapping[str, np.ndarray],
                            exclude_input: bool | None) -> dict[str, np.ndarray | None]:
    """What a tensorrtllm_backend-named model sets on a request before forwarding it, so the
    request means what it means to TensorRT-LLM (returned as ``{input: [1, 1] array}``):

    - ``temperature`` checked first, as on every path (a NaN, negative or huge one is refused,
      never silently replaced): :func:`~triton_backend.core.config.check_sampling_values`;
    - ``top_p`` 0 means "off" (TensorRT-LLM's meaning, which NVIDIA's clients rely on): the input
      is dropped (its value in the returned dict is ``None``);
    - neither top-k nor top-p above 0 (absent counts as 0): greedy, whatever the temperature
      (TensorRT-LLM's sampling layers turn top_k = top_p = 0 into top_k = 1), so
      ``temperature`` becomes 0;
    - ``exclude_input_in_output`` absent: ``exclude_input`` (the model's config parameter, as
      tensorrt_llm's ``exclude_input_in_output`` parameter), when not ``None``."""
    out: dict[str, np.ndarray | None] = {}
    check_sampling_values(temperature=read_scalar(arrays, _optional(TEMPERATURE)))
    if read_scalar(arrays, _optional(TOP_P)) == 0:
        out[TOP_P.name] = None
        arrays = {name: value for name, value in arrays.items() if name != TOP_P.name}
    top_k, top_p = read_top_k_p(arrays)
    if not (top_k or 0) > 0 and not (top_p or 0) > 0:
        out[TEMPERATURE_NAME] = np.zeros((1, 1), np.float32)
    if exclude_input is not None and EXCLUDE_INPUT_NAME not in arrays:
        out[EXCLUDE_INPUT_NAME] = np.full((1, 1), exclude_input, np.bool_)
    return out


TEMPERATURE_NAME, EXCLUDE_INPUT_NAME = "temperature", "exclude_input_in_output"
# the inputs trtllm_request_defaults reads
DEFAULTS_READ = (TOP_K.name, RUNTIME_TOP_K.name, TOP_P.name, RUNTIME_TOP_P.name, EXCLUDE_INPUT_NAME, TEMPERATURE_NAME)


def read_client_draft(arrays: Mapping[str, np.ndarray], token_level: bool) -> "ClientDraft | None":
    """``draft_input_ids`` (+ ``draft_logits``): a client's drafts for the target to verify
    (token level only); ``None`` when absent or empty."""
    from triton_backend.speculation.drafters.client import ClientDraft
    from triton_backend.serving.trtllm_interface import DRAFT_INPUT_IDS, DRAFT_LOGITS

    ids = read_ids(arrays, DRAFT_INPUT_IDS) or []
    logits = read_matrix(arrays, DRAFT_LOGITS)
    if not ids:
        if logits is not None and logits.size:
            raise InvalidRequestError("draft_logits needs draft_input_ids")
        return None
    if not token_level:
        raise InvalidRequestError("draft_input_ids needs input_ids (the token-level tensorrt_llm model)")
    if logits is not None and logits.size:
        if logits.dtype.kind != "f":
            raise InvalidRequestError("draft_logits must be FP32")
        logits = np.asarray(logits, np.float32)
        return ClientDraft(tuple(ids), logits.reshape(-1, logits.shape[-1]) if logits.ndim > 2 else logits)
    return ClientDraft(tuple(ids))


def check_single_sequence(arrays: Mapping[str, np.ndarray]) -> None:
    """``beam_width`` and ``num_return_sequences``: 1 (or absent); speculation verifies one sequence."""
    for spec in (BEAM_WIDTH, NUM_RETURN_SEQUENCES):
        value = read_scalar(arrays, spec)
        if value is not None and value != 1:
            raise InvalidRequestError(f"{spec.name} = {value} is not supported: specbuild returns one sequence "
                                      f"(send {spec.name} = 1)")


def read_pad_id(arrays: Mapping[str, np.ndarray]) -> int | None:
    value = read_scalar(arrays, PAD_ID)
    if value is not None and value < 0:
        raise InvalidRequestError(f"pad_id must be a token id >= 0, got {value}")
    return value


def read_word_list(arrays: Mapping[str, np.ndarray], spec: TensorSpec) -> tuple[tuple[int, ...], ...]:
    """Token sequences from the ``[2, n]`` layout preprocessing writes: row 0 the ids of all
    sequences back to back, row 1 each sequence's end offset (then -1 padding)."""
    item = read_matrix(arrays, spec)
    if item is None or item.size == 0:
        return ()
    if item.ndim != 2 or item.shape[0] != 2 or item.dtype.kind not in "iu":
        raise InvalidRequestError(f"{spec.name} must be an INT32 [2, n] list (ids; end offsets)")
    ids, offsets = [int(v) for v in item[0]], [int(v) for v in item[1] if v >= 0]
    out, start = [], 0
    for end in offsets:
        if not start < end <= len(ids) or any(t < 0 for t in ids[start:end]):
            raise InvalidRequestError(f"{spec.name}: bad end offset {end} or token id in [{start}, {end})")
        out.append(tuple(ids[start:end]))
        start = end
    return tuple(out)


__all__ = ["check_single_sequence", "one_of", "read_guide", "read_max_tokens", "read_pad_id", "read_penalties",
           "read_prompt", "read_client_draft", "read_seed", "read_stream", "read_top_k_p", "read_word_list",
           "refuse_unsupported", "trtllm_request_defaults"]


def read_penalties(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Penalties, ``min_tokens``, bad words (text ``bad_words`` or token ``bad_words_list``) and
    ``return_log_probs`` / ``top_log_probs`` as :class:`~triton_backend.core.config.SamplingParams` fields
    (absent: left out)."""
    from triton_backend.serving.interface import BAD_WORDS
    from triton_backend.serving.tensors import read_strings
    from triton_backend.serving.trtllm_interface import (
        BAD_WORDS_LIST, FREQUENCY_PENALTY, MIN_TOKENS, PRESENCE_PENALTY, REPETITION_PENALTY, RETURN_LOG_PROBS,
        TOP_LOG_PROBS,
    )

    fields = {"repetition_penalty": REPETITION_PENALTY, "presence_penalty": PRESENCE_PENALTY,
              "frequency_penalty": FREQUENCY_PENALTY, "min_tokens": MIN_TOKENS}
    out: dict[str, Any] = {}
    for name, spec in fields.items():
        value = read_scalar(arrays, spec)
        if value is not None:
            out[name] = value
    words = tuple(w for w in read_strings(arrays, BAD_WORDS) if w)
    if words:
        out["bad_words"] = words
    ids = read_word_list(arrays, BAD_WORDS_LIST)
    if ids:
        out["bad_token_ids"] = ids
    if read_scalar(arrays, RETURN_LOG_PROBS):
        out["return_log_probs"] = True
    top = read_scalar(arrays, TOP_LOG_PROBS)
    if top:  # checked by SamplingParams (0..20, with return_log_probs)
        out["top_log_probs"] = top
    return out


def read_guide(arrays: Mapping[str, np.ndarray]) -> Guide | None:
    """Structured output: ``guided_decoding_guide_type`` + ``guided_decoding_guide`` as a typed
    :class:`~triton_backend.core.guide.Guide` (None when neither is set; a bad pair is refused)."""
    from triton_backend.serving.interface import GUIDE, GUIDE_TYPE

    return Guide.from_inputs(read_scalar(arrays, GUIDE_TYPE), read_scalar(arrays, GUIDE))
