"""A deployment: its typed config and the decoder it builds (torch or TensorRT-LLM runtime)."""
