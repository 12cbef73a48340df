"""An OpenAI-compatible HTTP API in front of a running Triton server (``specbuild serve --openai-port``).

- :mod:`.errors` -- the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``);
- :mod:`.protocol` -- request bodies parsed into one typed :class:`~.protocol.GenerationRequest`;
- :mod:`.responses` -- completion / chat objects, stream chunks, server-sent events, ``usage``;
- :mod:`.backend` -- the Triton side: gRPC streaming to the ``specdec`` model (the same scheduler
  and in-flight batching as every other client), the model's metadata, the tokenizer;
- :mod:`.app` -- the aiohttp application (routes, API key, body limit) and the server thread.
"""
