"""Typed errors. Each carries a short message that is safe to show a client."""


class SpecbuildError(Exception):
    """Base of every error specbuild raises on purpose."""

    code = "internal"


class InvalidRequestError(SpecbuildError, ValueError):
    """The request's parameters are invalid (empty prompt, max_tokens <= 0, ...)."""

    code = "invalid_request"


class ConfigError(SpecbuildError, ValueError):
    """A deployment, config file, config.pbtxt parameter or configuration flag is invalid
    (found at load time, before any request). Requests get :class:`InvalidRequestError`."""

    code = "config"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what must be generated) does not fit the model's context."""

    code = "context_length"


class VocabMismatchError(SpecbuildError, ValueError):
    """A draft model does not share the target's tokenizer / vocabulary."""

    code = "vocab_mismatch"


class ModelLoadError(SpecbuildError, RuntimeError):
    """Weights or a model directory could not be found, fetched or loaded."""

    code = "model_load"


OVERLOADED_MESSAGE_PREFIX = "server overloaded"  # what HTTP front ends (triton_backend.serving.front.http_guard) map to 503


class OverloadedError(SpecbuildError):
    """Refused at once because every slot and queue place is taken: retry later. The message
    starts with :data:`OVERLOADED_MESSAGE_PREFIX` (Triton 2.51's HTTP ``generate`` endpoint
    answers every model error with 400; the HTTP guard turns this one into 503)."""

    code = "overloaded"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{OVERLOADED_MESSAGE_PREFIX}: {detail}")
