"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

from triton_backend.core.errors import SpecbuildError


class OpenAIError(SpecbuildError):
    """An error a client of the OpenAI API sees: ``status`` and the body of :meth:`body`."""

    code = "openai"

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.error_code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.error_code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error`` naming the parameter at fault."""
    return OpenAIError(message, status=400, param=param, code=code)


def unsupported(param: str, why: str) -> OpenAIError:
    """A 400 for a parameter this server does not honour (with that value)."""
    return OpenAIError(f"'{param}' is not supported by this server: {why}", status=400, param=param,
                       code="unsupported_parameter")


def unauthorized() -> OpenAIError:
    return OpenAIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key")


def not_found(message: str, code: str = "not_found") -> OpenAIError:
    return OpenAIError(message, status=404, code=code)


def server_error(message: str, status: int = 500) -> OpenAIError:
    return OpenAIError(message, status=status, type="server_error" if status >= 500 else "invalid_request_error",
                       code="server_error" if status >= 500 else None)


__all__ = ["OpenAIError", "invalid", "not_found", "server_error", "unauthorized", "unsupported"]
