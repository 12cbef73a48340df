"""What clients reach beside Triton: the HTTP guard on the public HTTP port (``http_guard.py``) and the
OpenAI-compatible API (``openai/``)."""
