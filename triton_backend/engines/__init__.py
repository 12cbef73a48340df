"""Engines: a causal LM behind one protocol (:mod:`~triton_backend.engines.base`), with
per-sequence KV sessions. Import the modules themselves: the package imports nothing, so that
plain-data modules here (:mod:`~triton_backend.engines.trtllm_config`) load without torch."""
