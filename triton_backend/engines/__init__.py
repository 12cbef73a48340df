"""Engines: a causal LM behind one protocol (``base``), batched ragged passes over KV-cache slots
(``batch``), and the two runtimes: ``torch`` and ``trtllm``."""
