"""Running things from the build side: the gRPC/HTTP client, serve (a repository behind the launcher,
guard and OpenAI front of ``triton_backend.serving``), deploy, demo, local runs, perf_analyzer, k8s."""
