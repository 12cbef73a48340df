"""Serving without Triton imports: the request interface and its tensors, parsing, responses, the service."""
