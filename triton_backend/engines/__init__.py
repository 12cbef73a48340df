"""Engines: a causal LM behind one protocol, with per-sequence KV sessions."""

from triton_backend.engines.base import CausalLMEngine, EngineSession
from triton_backend.engines.torch_engine import TorchEngine, TorchSession

__all__ = ["CausalLMEngine", "EngineSession", "TorchEngine", "TorchSession"]
