"""The ``preprocessing`` and ``postprocessing`` models of tensorrtllm_backend's layout: the
serving model's tokenizer behind Triton, for clients that tokenize through the server and
then call the token-level ``tensorrt_llm`` model.

``preprocessing``: ``QUERY`` -> ``INPUT_ID`` / ``REQUEST_INPUT_LEN``, ``STOP_WORDS_DICT`` /
``BAD_WORDS_DICT`` -> ``[2, n]`` word lists (ids back to back; end offsets then -1),
``END_ID`` / ``PAD_ID`` defaults from the tokenizer, ``DECODER_INPUT_ID`` r25.05's ``[pad_id]``
placeholder (length 1). Each output has the data type of r25.05's ``config.pbtxt``. ``postprocessing``: ``TOKENS_BATCH``
[beam, n] cut to ``SEQUENCE_LENGTH`` -> ``OUTPUT`` text (special tokens skipped).
The numpy functions are plain; :class:`PreprocessingModel` / :class:`PostprocessingModel`
are the thin Triton adapters (parameter ``target_model``: whose ``deployment.json`` names
the tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from triton_backend.core.errors import InvalidRequestError, SpecbuildError
from triton_backend.serving.tensors import (
    TritonType, array_tensor, read_matrix, read_scalar, read_strings, scalar_tensor,
)
from triton_backend.serving.triton.io import model_parameters
from triton_backend.serving.trtllm_inputs import refuse_unsupported
from triton_backend.serving.trtllm_interface import POST_INPUTS, PRE_INPUTS

T = TritonType
_PRE = {spec.name: spec for spec in PRE_INPUTS}
_POST = {spec.name: spec for spec in POST_INPUTS}


def word_list(tokenizer: Any, words: Sequence[str]) -> np.ndarray:
    """``[2, n]`` int32: row 0 every word's ids back to back, row 1 their end offsets (-1 padded).
    No word (none sent, or only empty ones): ``[[0], [-1]]``, as r25.05 answers ``[""]``; never
    ``[2, 0]``, which tritonclient <= 2.58 reads back as FP64."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        word_ids = tokenizer.encode(word, add_special_tokens=False)
        if word_ids:  # an empty word has no end offset (r25.05 skips it)
            ids.extend(word_ids)
            offsets.append(len(ids))
    if not ids:
        return np.array([[0], [-1]], dtype=np.int32)
    width = max(len(ids), len(offsets))
    out = np.full((2, width), -1, dtype=np.int32)
    out[0, :] = 0
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
    return out


def preprocess(tokenizer: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    refuse_unsupported(arrays)
    query = read_scalar(arrays, _PRE["QUERY"])
    if not query:
        raise InvalidRequestError("QUERY is empty")
    ids = tokenizer.encode(query, add_special_tokens=False)
    output_len = read_scalar(arrays, _PRE["REQUEST_OUTPUT_LEN"])
    end_id = read_scalar(arrays, _PRE["END_ID"])
    pad_id = read_scalar(arrays, _PRE["PAD_ID"])
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    end_id = eos if end_id is None else end_id
    pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id) if pad_id is None else pad_id
    return {
        "INPUT_ID": array_tensor(ids, T.INT32), "REQUEST_INPUT_LEN": scalar_tensor(len(ids), T.INT32),
        # no DECODER_QUERY: r25.05's placeholder decoder prompt [pad_id] (TensorRT-LLM ignores it for a
        # decoder-only model). Never a zero-size tensor: tritonclient <= 2.58 reads an empty binary
        # output as FP64, and end_to_end_test.py sends it back to tensorrt_llm as decoder_input_ids.
        "DECODER_INPUT_ID": array_tensor([pad_id], T.INT32), "REQUEST_DECODER_INPUT_LEN": scalar_tensor(1, T.INT32),
        "BAD_WORDS_IDS": word_list(tokenizer, read_strings(arrays, _PRE["BAD_WORDS_DICT"]))[np.newaxis],
        "STOP_WORDS_IDS": word_list(tokenizer, read_strings(arrays, _PRE["STOP_WORDS_DICT"]))[np.newaxis],
        "EMBEDDING_BIAS": np.zeros((1, 0), dtype=np.float32),
        "REQUEST_OUTPUT_LEN": scalar_tensor(output_len, T.INT32),
        "OUT_END_ID": scalar_tensor(end_id, T.INT32), "OUT_PAD_ID": scalar_tensor(pad_id, T.INT32),
    }


def postprocess(tokenizer: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = read_matrix(arrays, _POST["TOKENS_BATCH"])
    lengths = read_matrix(arrays, _POST["SEQUENCE_LENGTH"])
    if tokens.ndim != 2 or lengths.ndim != 1 or len(lengths) != tokens.shape[0]:
        raise InvalidRequestError("TOKENS_BATCH must be [beam, n] and SEQUENCE_LENGTH [beam]")
    texts = []
    for beam, length in zip(tokens, lengths):
        if not 0 <= int(length) <= len(beam):
            raise InvalidRequestError(f"SEQUENCE_LENGTH {int(length)} is outside [0, {len(beam)}]")
        texts.append(tokenizer.decode([int(t) for t in beam[:int(length)]], skip_special_tokens=True))
    return {"OUTPUT": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}  # [beam], as r25.05


class _TokenizerModel:
    """Triton adapter: one response per request (``transform(tokenizer, arrays)``), errors as
    short Triton errors."""

    transform: Callable[[Any, Mapping[str, np.ndarray]], dict[str, np.ndarray]]

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        from triton_backend.engines.torch.model_loading import load_tokenizer
        from triton_backend.serving.service import load_deployment

        self._pb = pb_utils
        target = model_parameters(json.loads(args["model_config"])).get("target_model", "")
        if not target:
            raise pb_utils.TritonModelException(f"config.pbtxt of {args['model_name']!r} lacks parameter 'target_model'")
        deployment = load_deployment(Path(args["model_repository"]).parent / target / "1" / "deployment.json")
        self.tokenizer = load_tokenizer(deployment.target)

    def execute(self, requests: list[Any]) -> list[Any]:
        from triton_backend.serving.triton.io import error_response, inference_response

        responses = []
        for request in requests:
            arrays = {t.name(): np.array(t.as_numpy(), copy=True) for t in request.inputs()}
            try:
                responses.append(inference_response(self.transform(self.tokenizer, arrays)))
            except SpecbuildError as exc:
                responses.append(error_response(exc))
        return responses

    def finalize(self) -> None:
        pass


class PreprocessingModel(_TokenizerModel):
    transform = staticmethod(preprocess)


class PostprocessingModel(_TokenizerModel):
    transform = staticmethod(postprocess)


__all__ = ["PostprocessingModel", "PreprocessingModel", "postprocess", "preprocess", "word_list"]
