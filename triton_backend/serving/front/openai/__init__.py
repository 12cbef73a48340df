"""An OpenAI-compatible HTTP API in front of a running Triton server (``specbuild serve --openai-port``).

- :mod:`.openai_errors` -- the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``);
- :mod:`.openai_request` -- request bodies parsed into one typed :class:`~.openai_request.GenerationRequest`;
- :mod:`.openai_responses` -- completion / chat objects, stream chunks, server-sent events, ``usage``;
- :mod:`.messages` -- chat messages (tool calls and tool results included) checked and turned into
  the turns the chat template renders;
- :mod:`.tools` -- ``tools`` + ``tool_choice``: a forced call (the schema the answer is decoded under)
  or ``auto`` (the grammar of text or calls), and the system message that describes the function(s);
- :mod:`.tool_format` -- the text format of calls and results in the prompt and the answer;
- :mod:`.tool_calls` -- a forced call's answer as ``message.tool_calls`` and as stream deltas;
- :mod:`.tool_parser` -- an ``auto`` answer parsed into content and calls, streamed and not;
- :mod:`.logprobs` -- ``logprobs`` / ``top_logprobs`` in OpenAI's chat and completion shapes, from the
  runtime's log probabilities of the chosen and the most likely tokens;
- :mod:`.backend` -- the Triton side: gRPC streaming to the ``specdec`` model (the same scheduler
  and in-flight batching as every other client), the model's metadata, the tokenizer;
- :mod:`.app` -- the aiohttp application (routes, API key, body limit) and the server thread.
"""
