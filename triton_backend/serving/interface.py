"""The served model's interface: its tensors and its serving configuration.

No torch here: the model-repository renderer and the unary entry point import this
without loading the runtime. Tensor names follow NVIDIA tensorrtllm_backend's
ensemble/BLS models (``text_input``, ``max_tokens``, ``stream``, ``temperature``, ``top_k``,
``top_p``, ``random_seed``, ``end_id``, ``stop_words``, ``bad_words``, ``num_draft_tokens``,
``exclude_input_in_output`` ->
``text_output``, ``acceptance_rate``, ``total_accepted_draft_tokens``, ``total_draft_tokens``),
plus ours: ``speculation``, ``apply_chat_template``, ``ignore_eos`` -> ``target_passes``, ``fallback``,
``num_output_tokens``, ``speculation_method``, ``finish_reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from triton_backend.core.errors import ConfigError
from triton_backend.serving.tensors import TensorSpec, TritonType

T = TritonType
TEXT_INPUT = TensorSpec("text_input", T.STRING, optional=False, doc="the prompt (UTF-8)")
MAX_TOKENS = TensorSpec("max_tokens", T.INT32, doc="tokens to generate at most")
STREAM = TensorSpec("stream", T.BOOL, doc="send each verified block as it is accepted")
TEMPERATURE = TensorSpec("temperature", T.FP32, doc="0 = greedy (the default)")
TOP_K = TensorSpec("top_k", T.INT32, doc="0 = no top-k filter")
TOP_P = TensorSpec("top_p", T.FP32, doc="in (0, 1]; 1 or 0 = no nucleus filter")
RANDOM_SEED = TensorSpec("random_seed", T.UINT64, doc="seed of the sampler")
END_ID = TensorSpec("end_id", T.INT32, doc="an extra end token id (EOS always ends)")
STOP_WORDS = TensorSpec("stop_words", T.STRING, (-1,), doc="stop strings, not part of the output")
BAD_WORDS = TensorSpec("bad_words", T.STRING, (-1,), doc="accepted only empty (not supported)")
NUM_DRAFT_TOKENS = TensorSpec("num_draft_tokens", T.INT32, doc="draft length k; 0 = plain decoding")
SPECULATION = TensorSpec("speculation", T.STRING, doc="auto, draft, ngram or off")
CHAT = TensorSpec("apply_chat_template", T.BOOL, doc="wrap text_input in the tokenizer's chat template")
IGNORE_EOS = TensorSpec("ignore_eos", T.BOOL, doc="keep generating past EOS (fixed-length benchmarks)")
EXCLUDE_INPUT = TensorSpec("exclude_input_in_output", T.BOOL,
                           doc="false: text_output starts with the prompt as sent; true or absent: new text only")
GUIDE_TYPE = TensorSpec("guided_decoding_guide_type", T.STRING,
                        doc="structured output: json, json_schema, regex or ebnf_grammar (docs/structured-output.md)")
GUIDE = TensorSpec("guided_decoding_guide", T.STRING, doc="the JSON schema, regex or grammar (unused for json)")
PREFIX_CACHE_NAMESPACE = TensorSpec("prefix_cache_namespace", T.STRING,
                                    doc="keys and values are reused only between requests of one namespace "
                                        "(a tenant's key; absent: the shared one; docs/prefix-caching.md)")

INPUTS: tuple[TensorSpec, ...] = (TEXT_INPUT, MAX_TOKENS, STREAM, TEMPERATURE, TOP_K, TOP_P, RANDOM_SEED, END_ID,
                                  STOP_WORDS, BAD_WORDS, NUM_DRAFT_TOKENS, SPECULATION, CHAT, IGNORE_EOS, EXCLUDE_INPUT,
                                  GUIDE_TYPE, GUIDE, PREFIX_CACHE_NAMESPACE)

TEXT_OUTPUT = TensorSpec("text_output", T.STRING, (-1,), optional=False, doc="generated text (a block when streaming)")
ACCEPTANCE_RATE = TensorSpec("acceptance_rate", T.FP32, doc="accepted / drafted tokens")
TOTAL_ACCEPTED = TensorSpec("total_accepted_draft_tokens", T.INT32)
TOTAL_DRAFT = TensorSpec("total_draft_tokens", T.INT32)
TARGET_PASSES = TensorSpec("target_passes", T.INT32, doc="target forward passes")
FALLBACK = TensorSpec("fallback", T.BOOL, doc="fell back to plain decoding")
NUM_OUTPUT_TOKENS = TensorSpec("num_output_tokens", T.INT32)
METHOD = TensorSpec("speculation_method", T.STRING, doc="the drafter used: draft, ngram or off")
FINISH_REASON = TensorSpec("finish_reason", T.STRING, doc="length, eos or stop")

OUTPUTS: tuple[TensorSpec, ...] = (TEXT_OUTPUT, ACCEPTANCE_RATE, TOTAL_ACCEPTED, TOTAL_DRAFT, TARGET_PASSES, FALLBACK,
                                   NUM_OUTPUT_TOKENS, METHOD, FINISH_REASON)


BATCH_POLICIES = ("load_aware", "per_request")
ENSEMBLE_MODES = ("forward", "pipeline")  # ServingConfig.ensemble_mode
TRTLLM_METRICS_MODEL = "trtllm_metrics_model"  # the serving model's config parameter: ServingConfig.trtllm_metrics_model  # triton_backend.batching.plan.BatchPolicy


def _positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class TrtllmModelNames:
    """The tensorrtllm_backend model names the repository serves in front of ``model_name``
    (:mod:`triton_backend.serving.trtllm_interface`): ``ensemble`` and ``tensorrt_llm_bls``
    (text level), ``tensorrt_llm`` (token level), ``preprocessing`` / ``postprocessing`` (the
    tokenizer). Whether the first three are decoupled is :attr:`ServingConfig.decoupled_mode`.
    ``None`` leaves that model out."""

    ensemble: str | None = "ensemble"
    bls: str | None = "tensorrt_llm_bls"
    tokens: str | None = "tensorrt_llm"
    preprocessing: str | None = "preprocessing"
    postprocessing: str | None = "postprocessing"

    def names(self) -> list[str]:
        return [n for n in (self.ensemble, self.bls, self.tokens, self.preprocessing, self.postprocessing) if n]


@dataclass(frozen=True)
class ServingConfig:
    """How the model is served; rendered into config.pbtxt and read back by the model.

    ``max_batch_size``: requests one instance batches at once (the scheduler's KV slots;
    :mod:`triton_backend.batching.scheduler`); ``max_queue_size``: requests waiting for a slot (a full
    queue is refused at once); ``batch_policy``: ``load_aware`` (draft lengths per round from
    the measured pass cost and the batch) or ``per_request`` (each request's controller);
    ``prefill_chunk_tokens``: prompt tokens one round may prefill; ``prefix_cache``: finished
    requests' keys and values serve later requests sharing their prefix (on by default;
    :mod:`triton_backend.batching.prefix_cache`). ``max_concurrency``:
    requests run at once by runtimes that batch on their own (TensorRT-LLM's Executor), one
    thread each. ``unary_model_name``: a non-decoupled entry point that
    forwards to the decoupled model, for clients of Triton's ``infer`` API (HTTP ``infer``
    and gRPC ``ModelInfer`` do not accept decoupled models); ``None`` renders none.
    ``decoupled_mode``: tensorrtllm_backend's switch of the same name, for ``ensemble``,
    ``tensorrt_llm`` and ``tensorrt_llm_bls``: ``False`` (NVIDIA's quick-start default) makes
    them answer Triton's ``infer`` (one response; ``stream`` / ``streaming`` true refused),
    ``True`` makes them decoupled (streaming over gRPC and ``generate_stream``; ``infer``
    refused by Triton). ``specdec`` is always decoupled, ``specdec_unary`` never.
    ``exclude_input_in_output``: tensorrt_llm's parameter of that name, what a request to
    ``tensorrt_llm``, ``ensemble`` or ``tensorrt_llm_bls`` that leaves the input out gets (true,
    as in every NVIDIA setup: the new tokens / text only; false: the prompt first, when not
    streaming). ``ensemble_mode``: ``forward`` (default) makes ``ensemble`` forward the text
    request to ``model_name``, which tokenizes, generates and detokenizes in one process (chat
    templates, text stop strings, guides, incremental detokenization); ``pipeline`` renders
    NVIDIA's layout, a Triton ensemble of ``preprocessing`` -> ``tensorrt_llm`` ->
    ``postprocessing`` (NVIDIA's ensemble inputs that those three honour), so each ensemble
    request is one request of every one of them, as r25.05's ``base_metrics_verification_tests.py``
    expects (:mod:`builder.stages.ensemble_pipeline`).
    """

    model_name: str = "specdec"
    unary_model_name: str | None = "specdec_unary"
    max_batch_size: int = 8
    instance_count: int = 1
    max_concurrency: int = 4
    unary_instance_count: int = 4
    default_max_tokens: int = 64
    deployment_file: str = "deployment.json"
    trtllm_models: TrtllmModelNames | None = TrtllmModelNames()  # None: none of them
    max_queue_size: int = 64
    batch_policy: str = "load_aware"
    prefill_chunk_tokens: int = 512
    decoupled_mode: bool = False
    exclude_input_in_output: bool = True
    ensemble_mode: str = "forward"
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("decoupled_mode", "exclude_input_in_output", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("max_batch_size", "instance_count", "max_concurrency", "unary_instance_count", "default_max_tokens",
                     "max_queue_size", "prefill_chunk_tokens"):
            _positive(getattr(self, name), name)
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(f"batch_policy must be one of {BATCH_POLICIES}, got {self.batch_policy!r}")
        if self.ensemble_mode not in ENSEMBLE_MODES:
            raise ConfigError(f"ensemble_mode must be one of {ENSEMBLE_MODES}, got {self.ensemble_mode!r}")
        front = self.trtllm_models
        if self.ensemble_mode == "pipeline" and not (front and front.ensemble and front.tokens
                                                     and front.preprocessing and front.postprocessing):
            raise ConfigError("ensemble_mode 'pipeline' needs the ensemble, tensorrt_llm, preprocessing and "
                              "postprocessing models")
        names = [self.model_name, self.unary_model_name or "x"] + (self.trtllm_models.names() if self.trtllm_models else [])
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must differ, got {names}")
        for name in names:
            if not name.replace("_", "").replace("-", "").isalnum():
                raise ConfigError(f"model names must be letters, digits, '_' or '-', got {name!r}")
        if self.unary_model_name == self.model_name:
            raise ConfigError("unary_model_name must differ from model_name")
        if Path(self.deployment_file).name != self.deployment_file:
            raise ConfigError("deployment_file must be a plain file name inside the version folder")

    def parameters(self) -> dict[str, str]:
        """What the decoupled model's config.pbtxt carries (and :meth:`from_parameters` reads)."""
        return {"deployment_file": self.deployment_file, "max_concurrency": str(self.max_concurrency),
                "default_max_tokens": str(self.default_max_tokens), **self._batch_parameters(),
                TRTLLM_METRICS_MODEL: self.trtllm_metrics_model}

    @property
    def trtllm_metrics_model(self) -> str:
        """The ``model`` label of TensorRT-LLM's metric families (``nv_trt_llm_*``,
        ``nv_llm_*_token_len``): the token-level model's name, where TensorRT-LLM publishes them
        (NVIDIA's CI reads ``model="tensorrt_llm"``), else this model's."""
        tokens = self.trtllm_models.tokens if self.trtllm_models is not None else None
        return tokens or self.model_name

    def _batch_parameters(self) -> dict[str, str]:
        return {"max_batch_size": str(self.max_batch_size), "max_queue_size": str(self.max_queue_size),
                "batch_policy": self.batch_policy, "prefill_chunk_tokens": str(self.prefill_chunk_tokens),
                **({} if self.prefix_cache else {"prefix_cache": "false"})}  # on: rendered as before

    @classmethod
    def from_parameters(cls, model_name: str, params: Mapping[str, str]) -> "ServingConfig":
        missing = sorted({"deployment_file", "max_concurrency", "default_max_tokens"} - set(params))
        if missing:
            raise ConfigError(f"config.pbtxt of {model_name!r} lacks parameters {missing}")
        try:
            batch: dict[str, Any] = {name: (params[name] if name == "batch_policy" else int(params[name]))
                                     for name in cls()._batch_parameters() if name in params}
            if "prefix_cache" in params:  # older repositories lack it (on)
                if params["prefix_cache"] not in ("true", "false"):
                    raise ValueError(f"prefix_cache must be true or false, got {params['prefix_cache']!r}")
                batch["prefix_cache"] = params["prefix_cache"] == "true"
            return cls(model_name=model_name, deployment_file=params["deployment_file"],
                       max_concurrency=int(params["max_concurrency"]),
                       default_max_tokens=int(params["default_max_tokens"]), **batch)
        except ValueError as exc:
            raise ConfigError(f"bad parameter in config.pbtxt of {model_name!r}: {exc}") from None



__all__ = ["INPUTS", "OUTPUTS", "ServingConfig", "TrtllmModelNames"]
