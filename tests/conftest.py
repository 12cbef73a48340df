"""Shared fixtures: the real reference model (SmolLM2-135M-Instruct, float32) and tiny
random Llama models (no weights needed) for fast unit tests."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.torch import row_gemm as row_gemm_module
from triton_backend.engines.torch.hf_engine import TorchEngine

# Prompts for the real model: chat, code, and input-copying tasks (where n-gram lookup matches).
REFERENCE_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Rewrite this sentence in the past tense: 'The cat sits on the mat and looks at the birds.'",
    "List three benefits of regular exercise.",
    "Explain what a hash table is in two sentences.",
    "Translate to French: 'Good morning, how are you today?'",
    "Summarize: The meeting was moved from Monday to Wednesday because the projector in room 4 was broken.",
    "Write a haiku about the ocean.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta.",
]


def tiny_llama(seed: int, *, vocab: int = 32, layers: int = 2, hidden: int = 32, sharpness: float = 4.0,
               max_positions: int = 128) -> LlamaForCausalLM:
    """A small random Llama whose next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness * 50)
    return model.eval()


def tiny_engine(seed: int, **kwargs: object) -> TorchEngine:
    """The torch runtime's default engine (the slot engine) over a tiny random Llama."""
    from triton_backend.engines.torch.model_loading import make_torch_engine

    return make_torch_engine(tiny_llama(seed, **kwargs), name=f"tiny{seed}", runtime=RuntimeConfig(), eos_token_ids=[])


@pytest.fixture
def default_pass_costs():
    """The default pass-cost table for every engine of the test, whatever another test's
    deployment measured and recorded for its engines before it ran (tests that script the gain
    rule's decisions)."""
    from triton_backend.speculation.cost_model import MEASURED

    before = MEASURED.snapshot()
    MEASURED.clear()
    yield
    MEASURED.restore(before)


@pytest.fixture(scope="session")
def reference():
    """(engine, tokenizer) of the real SmolLM2-135M-Instruct, float32, 1 thread."""
    from triton_backend.engines.torch.model_loading import load_engine

    return load_engine("smollm2-135m-instruct", RuntimeConfig())


@pytest.fixture(scope="session")
def reference_prompts(reference):
    _, tokenizer = reference
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in REFERENCE_PROMPTS]


# the row kernel's ISA builds this CPU runs (an AVX-512 CPU runs both)
ROW_KERNEL_ISAS = [isa for isa in ("avx2", "avx512") if row_gemm_module.cpu_isa() in (isa, "avx512")]


@pytest.fixture(params=ROW_KERNEL_ISAS)
def row_gemm(request, monkeypatch):
    """The row kernel of each ISA build this CPU runs, left on one thread afterwards."""
    monkeypatch.setenv("SPECBUILD_ROW_KERNEL_ISA", request.param)
    fn = row_gemm_module.load_row_gemm()
    assert fn is not None, "the kernel builds where the CPU supports it (a C++ compiler is on PATH)"
    yield fn
    fn.set_threads(1)


class ServingSink:
    """The serving model's response sink, as Triton's sender is: collects the responses sent,
    the errors, and sets ``done`` on the final response, a failure or close."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.errors: list[str] = []
        self.done = threading.Event()

    def send(self, outputs, final: bool) -> None:
        self.sent.append(dict(outputs))
        if final:
            self.done.set()

    def fail(self, exc) -> None:
        self.errors.append(str(exc))
        self.done.set()

    def cancelled(self) -> bool:
        return False

    def close(self) -> None:
        self.done.set()
