"""Load tests against a real Triton server: sustained streams, whole sessions, abrupt clients."""
