"""The ``trtllm`` runtime's engines: compiled TensorRT-LLM engines behind TensorRT-LLM's
Executor API (``tensorrt_llm.bindings.executor``).

:class:`TrtllmEngine` holds one ``Executor`` over one engine folder and runs the plain-data
requests of :mod:`triton_backend.engines.trtllm.requests`: ``generate`` waits for the final
response, ``stream`` yields each response's new tokens (closing it cancels the request). The
speculative loop around them lives in :mod:`triton_backend.speculation.trtllm_loop`.

TensorRT-LLM is imported only when an engine is loaded. Where it is missing (anywhere but
the GPU image), loading raises :class:`~triton_backend.core.errors.ModelLoadError` with
:data:`TRTLLM_MISSING`, never an ImportError traceback. Engine folders are checked first
(``config.json`` and ``rank<N>.engine``, as ``trtllm-build`` writes them), so a wrong path
is reported as such on any machine.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from triton_backend.engines.trtllm.requests import ExecutorSpec, RequestSpec
from triton_backend.core.errors import ModelLoadError, SpecbuildError

logger = logging.getLogger(__name__)

TRTLLM_MISSING = (
    "TensorRT-LLM is not installed; this deployment's engines need the GPU image (docker/Dockerfile.gpu: NVIDIA's "
    "Triton + TensorRT-LLM base image) on a machine with the planned GPU. Elsewhere, serve the build's torch "
    "weights instead: set engine_runtime to \"torch\" in the deployment file"
)
EXECUTOR_MODULE = "tensorrt_llm.bindings.executor"


class TrtllmEngineError(SpecbuildError, RuntimeError):
    """A TensorRT-LLM engine failed or timed out on a request (details in the server log)."""

    code = "engine"


def executor_bindings() -> ModuleType:
    """``tensorrt_llm.bindings.executor``, or a ModelLoadError saying why it cannot be had."""
    try:
        return importlib.import_module(EXECUTOR_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "tensorrt_llm":
            raise ModelLoadError(TRTLLM_MISSING) from None
        raise ModelLoadError(f"TensorRT-LLM could not be imported: {exc}") from None
    except (ImportError, OSError, RuntimeError) as exc:  # installed, but its CUDA libraries cannot load
        raise ModelLoadError(f"TensorRT-LLM could not be loaded ({type(exc).__name__}: {exc}); it needs the GPU "
                             "image with a CUDA driver") from None


@dataclass(frozen=True)
class EngineInfo:
    """What an engine folder's ``config.json`` says about the compiled engine."""

    engine_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    world_size: int  # TP x PP ranks, one rank<N>.engine each
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_draft_len: int
    num_medusa_heads: int

    @property
    def cost(self) -> float:
        """A relative cost of one decoding step (layers x hidden^2), for draft-length control."""
        return float(self.num_layers) * float(self.hidden_size) ** 2


def check_engine_dir(path: str | Path, role: str) -> Path:
    """The folder, when it holds what ``trtllm-build`` writes (``config.json``, ``rank0.engine``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"the {role} engine folder {folder} does not exist; compile it with the build's "
                             "build_engines.sh (trtllm-build)")
    missing = [name for name in ("config.json", "rank0.engine") if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(f"the {role} engine folder {folder} has no {' or '.join(missing)}; it is not a "
                             "finished trtllm-build output")
    return folder


def _field(section: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{where} has no integer {name!r}")
    return value


def read_engine_info(path: str | Path, role: str) -> EngineInfo:
    """Parse and check an engine folder's ``config.json`` (TensorRT-LLM's engine format:
    ``pretrained_config`` with the model and its ``mapping``, ``build_config`` with the limits)."""
    folder = check_engine_dir(path, role)
    where = f"the {role} engine's {folder / 'config.json'}"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{where} cannot be read: {exc}") from None
    pretrained, build = config.get("pretrained_config"), config.get("build_config")
    if not isinstance(pretrained, dict) or not isinstance(build, dict):
        raise ModelLoadError(f"{where} has no pretrained_config/build_config: not an engine built by trtllm-build")
    mapping = pretrained.get("mapping") or {}
    world = _field(mapping, "tp_size", where, 1) * _field(mapping, "pp_size", where, 1)
    info = EngineInfo(
        engine_dir=folder, architecture=str(pretrained.get("architecture", "")),
        vocab_size=_field(pretrained, "vocab_size", where), hidden_size=_field(pretrained, "hidden_size", where),
        num_layers=_field(pretrained, "num_hidden_layers", where), world_size=world,
        max_batch_size=_field(build, "max_batch_size", where), max_input_len=_field(build, "max_input_len", where),
        max_seq_len=_field(build, "max_seq_len", where), max_draft_len=_field(build, "max_draft_len", where, 0),
        num_medusa_heads=_field(pretrained, "num_medusa_heads", where, 0))
    missing = [f"rank{r}.engine" for r in range(world) if not (folder / f"rank{r}.engine").is_file()]
    if missing:
        raise ModelLoadError(f"the {role} engine folder {folder} lacks {missing[:4]} for its {world} ranks")
    return info


# -- specs -> bindings ----------------------------------------------------------------------
def to_executor_request(bindings: ModuleType, spec: RequestSpec) -> Any:
    draft = None
    if spec.draft is not None:
        draft = bindings.ExternalDraftTokensConfig(**spec.draft.kwargs())
    return bindings.Request(**spec.kwargs(), sampling_config=bindings.SamplingConfig(**spec.sampling.kwargs()),
                            output_config=bindings.OutputConfig(**spec.output.kwargs()),
                            external_draft_tokens_config=draft)


def to_executor_config(bindings: ModuleType, spec: ExecutorSpec) -> Any:
    config = bindings.ExecutorConfig(**spec.kwargs(), kv_cache_config=bindings.KvCacheConfig(**spec.kv_cache.kwargs()))
    if spec.medusa_choices is not None:
        config.decoding_config = bindings.DecodingConfig(medusa_choices=[list(c) for c in spec.medusa_choices])
    if spec.orchestrator:
        import tensorrt_llm

        worker = Path(tensorrt_llm.__file__).parent / "bin" / "executorWorker"
        config.parallel_config = bindings.ParallelConfig(
            bindings.CommunicationType.MPI, bindings.CommunicationMode.ORCHESTRATOR,
            orchestrator_config=bindings.OrchestratorConfig(True, str(worker)))
    return config


@dataclass
class EngineOutput:
    """New tokens of one response; ``logits``: its generation logits ``[len(tokens), vocab]``
    when asked for; ``iterations``: the engine's decoding steps so far (when it reports them)."""

    tokens: list[int]
    logits: Any = None
    final: bool = True
    iterations: int | None = None


class TrtllmEngine:
    """One compiled engine served by a TensorRT-LLM Executor (in-flight batching: requests
    from several threads share it)."""

    def __init__(self, engine_dir: str | Path, role: str, spec: ExecutorSpec, *, timeout_s: float = 600.0) -> None:
        self.info = read_engine_info(engine_dir, role)
        self.role = role
        self.name = f"{role}:{self.info.engine_dir.name}"
        self._bindings = executor_bindings()
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._lock = threading.Lock()
        logger.info("loading the %s engine %s (%s, %d rank(s))", role, self.info.engine_dir, self.info.architecture,
                    self.info.world_size)
        config = to_executor_config(self._bindings, spec)
        try:
            self._executor = self._bindings.Executor(str(self.info.engine_dir), self._bindings.ModelType.DECODER_ONLY,
                                                     config)
        except Exception as exc:  # the bindings raise RuntimeError subclasses with TensorRT-LLM's message
            raise ModelLoadError(f"TensorRT-LLM could not load the {role} engine {self.info.engine_dir}: {exc}") from None

    def _enqueue(self, spec: RequestSpec) -> int:
        request = to_executor_request(self._bindings, spec)
        with self._lock:
            return int(self._executor.enqueue_request(request))

    def _responses(self, request_id: int) -> list[Any]:
        responses = self._executor.await_responses(request_id, self._timeout)
        if not responses:
            logger.error("%s: no response to request %d within %s", self.name, request_id, self._timeout)
            raise TrtllmEngineError(f"the {self.role} engine did not answer in time")
        for response in responses:
            if response.has_error():
                logger.error("%s: request %d failed: %s", self.name, request_id, response.error_msg)
                raise TrtllmEngineError(f"the {self.role} engine failed the request; see the server log")
        return responses

    @staticmethod
    def _output(result: Any) -> EngineOutput:
        tokens = [int(t) for t in result.output_token_ids[0]]
        logits = result.generation_logits
        if logits is not None:
            logits = logits[0, :len(tokens)]  # [beam, tokens, vocab] -> [tokens, vocab]
        return EngineOutput(tokens, logits, bool(result.is_final), getattr(result, "decoding_iter", None))

    def generate(self, spec: RequestSpec) -> EngineOutput:
        """Run a non-streaming request to its final response."""
        request_id = self._enqueue(spec)
        while True:
            for response in self._responses(request_id):
                if response.result.is_final:
                    return self._output(response.result)

    def stream(self, spec: RequestSpec) -> Iterator[EngineOutput]:
        """Each response's new tokens; closing the iterator early cancels the request."""
        request_id = self._enqueue(spec)
        final = False
        try:
            while not final:
                for response in self._responses(request_id):
                    output = self._output(response.result)
                    final = output.final
                    yield output
        finally:
            if not final:
                self._executor.cancel_request(request_id)

    def shutdown(self) -> None:
        self._executor.shutdown()


__all__ = ["EXECUTOR_MODULE", "TRTLLM_MISSING", "EngineInfo", "EngineOutput", "TrtllmEngine", "TrtllmEngineError",
           "check_engine_dir", "executor_bindings", "read_engine_info", "to_executor_config", "to_executor_request"]
