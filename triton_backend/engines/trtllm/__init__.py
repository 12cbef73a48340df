"""The TensorRT-LLM runtime's engine: Executor requests and engine configs (TensorRT-LLM is imported lazily)."""
