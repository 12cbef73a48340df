"""Fixtures for tests of the OpenAI front against the session's REAL Triton server: one front
(what ``specbuild serve --openai-port`` runs, with an API key) and an ``openai`` SDK client.

Import them into a test module: ``from openai_fixtures import front, client``.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from triton_backend.serving.front.openai.app import OpenAIConfig, OpenAIServer
from builder.ops.serve import start_openai_front
from triton_fixtures import triton  # noqa: F401 - the session's real Triton server

KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def front(triton) -> Iterator[OpenAIServer]:  # noqa: F811
    server = start_openai_front(OpenAIConfig(api_key=KEY, max_body_bytes=64 * 1024), triton.endpoints,
                                triton.repository)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(front: OpenAIServer) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=front.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
