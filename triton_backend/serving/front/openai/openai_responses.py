"""OpenAI response objects: completions, chat completions, their stream chunks (server-sent
events), and ``usage`` with the speculation statistics as an extension field (``usage.speculation``)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from triton_backend.serving.front.openai.openai_request import Endpoint

DONE_EVENT = b"data: [DONE]\n\n"
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class ResponseIds:
    """What every object of one response shares."""

    endpoint: Endpoint
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, endpoint: Endpoint, model: str) -> "ResponseIds":
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        return cls(endpoint, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.endpoint is Endpoint.CHAT else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"


@dataclass
class Generation:
    """What came back from the served model for one request."""

    prompt_tokens: int
    text: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_reason(self) -> str:
        return _FINISH.get(str(self.stats.get("finish_reason", "")), "stop")

    def usage(self) -> dict[str, Any]:
        s = self.stats
        completion = int(s.get("num_output_tokens", 0))
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "speculation": {
                "method": s.get("speculation_method"), "acceptance_rate": float(s.get("acceptance_rate", 0.0)),
                "draft_tokens": int(s.get("total_draft_tokens", 0)),
                "accepted_draft_tokens": int(s.get("total_accepted_draft_tokens", 0)),
                "target_passes": int(s.get("target_passes", 0)), "fallback": bool(s.get("fallback", False)),
            },
        }


def _choice(endpoint: Endpoint, text: str, finish: str | None, *, delta: Mapping[str, Any] | None = None,
            message: Mapping[str, Any] | None = None) -> dict:
    if endpoint is Endpoint.CHAT:
        if delta is not None:
            body = {"delta": dict(delta)}
        else:
            body = {"message": dict(message) if message is not None else {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def full_response(ids: ResponseIds, generation: Generation, *, message: Mapping[str, Any] | None = None,
                  finish: str | None = None) -> dict[str, Any]:
    """The non-streamed answer of either endpoint (chat: ``message`` and ``finish`` replace the
    text answer's, for a tool call)."""
    return {"id": ids.id, "object": ids.object, "created": ids.created, "model": ids.model,
            "choices": [_choice(ids.endpoint, generation.text, finish or generation.finish_reason, message=message)],
            "usage": generation.usage()}


def chunk(ids: ResponseIds, text: str, finish: str | None = None, *, first: bool = False,
          include_usage: bool = False) -> dict[str, Any]:
    """One stream chunk carrying ``text`` (chat: the first one also carries the role)."""
    delta = None
    if ids.endpoint is Endpoint.CHAT:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    out = {"id": ids.id, "object": ids.chunk_object, "created": ids.created, "model": ids.model,
           "choices": [_choice(ids.endpoint, text, finish, delta=delta)]}
    if include_usage:
        out["usage"] = None
    return out


def delta_chunk(ids: ResponseIds, delta: Mapping[str, Any], finish: str | None = None, *,
                include_usage: bool = False) -> dict[str, Any]:
    """One chat stream chunk carrying ``delta`` as it is (a tool call's deltas)."""
    out = {"id": ids.id, "object": ids.chunk_object, "created": ids.created, "model": ids.model,
           "choices": [_choice(ids.endpoint, "", finish, delta=delta)]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(ids: ResponseIds, generation: Generation) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": ids.id, "object": ids.chunk_object, "created": ids.created, "model": ids.model, "choices": [],
            "usage": generation.usage()}


def sse(event: Mapping[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def models_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "specbuild"} for name in names]}


__all__ = ["DONE_EVENT", "Generation", "ResponseIds", "chunk", "delta_chunk", "full_response", "models_list", "sse", "usage_chunk"]
