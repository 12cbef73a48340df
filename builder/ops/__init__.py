"""Running things: the Triton launcher and supervisor, the gRPC/HTTP client, serve, deploy, demo, local runs, perf_analyzer."""
