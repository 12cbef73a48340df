#!/usr/bin/env python3
"""One row of ``scripts/cpu_peer_bench.py``, in its own process: ``cpu_peer_row.py JOB OUT`` reads the
bench's job file (the row, the tokenized prompts, threads, files), decodes every prompt with our
runtime or with llama.cpp, and writes the samples (tokens, latency, time to first token) to OUT.

The llama.cpp rows run this file under the llama.cpp interpreter, which has no torch: nothing beyond
the standard library is imported at its top.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def _sample(prompt: dict, tokens: list[int], latency: float, ttft: float, passes: int | None) -> dict:
    return {"workload": prompt["workload"], "index": prompt["index"], "tokens": tokens, "latency_s": latency,
            "ttft_s": ttft, "target_passes": passes}


def run_ours_row(job: dict) -> dict:
    """Our Python API (``build_decoder`` + ``generate``), as a user embedding the runtime calls it."""
    from triton_backend.core.config import (DraftLengthConfig, EagleConfig, SamplingParams, SpeculationConfig,
                                            SpeculationMode)
    from triton_backend.core.runtime_config import RuntimeConfig
    from triton_backend.deployment.deployment_config import DeploymentConfig
    from triton_backend.deployment.torch_deployment import build_decoder

    row = SimpleNamespace(**job["row"])  # cpu_peer_bench.RowSpec's fields
    threads = job["threads"]
    needs_eagle = row.method in ("eagle_tree", "auto")
    start = time.perf_counter()
    decoder = build_decoder(DeploymentConfig(
        target=job["target"], eagle=job["eagle"] if needs_eagle else None,
        runtime=RuntimeConfig(num_threads=threads, kernel_threads=min(threads, 16), weights=row.precision)))
    load_s = time.perf_counter() - start
    length = DraftLengthConfig(num_draft_tokens=max(row.k, 1))
    speculation = {
        "plain": SpeculationConfig(method=SpeculationMode.OFF),
        "ngram": SpeculationConfig(method=SpeculationMode.NGRAM, draft_length=length),
        "eagle_tree": SpeculationConfig(method=SpeculationMode.EAGLE, draft_length=length,
                                        eagle=EagleConfig(tree=True, max_tree_nodes=row.tree_nodes or 11)),
        "auto": SpeculationConfig(method=SpeculationMode.AUTO, draft_length=length),
    }[row.method]
    params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = job["prompts"]
    decoder.generate(prompts[0]["ids"], SamplingParams(max_tokens=8, ignore_eos=True), speculation)  # warm-up
    samples = []
    for prompt in prompts:
        t0 = time.perf_counter()
        result = decoder.generate(prompt["ids"], params, speculation)
        latency = time.perf_counter() - t0
        samples.append(_sample(prompt, list(result.token_ids), latency, result.stats.time_to_first_token_s,
                               result.stats.target_passes))
    kernel = getattr(decoder.target, "kernel_name", "")
    return {"load_s": load_s, "samples": samples, "info": {"kernel": kernel, "threads": threads}}


def run_llamacpp_row(job: dict) -> dict:
    """llama-cpp-python's ``Llama.generate`` (greedy sampler, a fresh cache per request), plain or with
    its prompt-lookup draft model; the first ``max_tokens`` tokens it yields (EOS ignored)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    row = SimpleNamespace(**job["row"])  # cpu_peer_bench.RowSpec's fields
    threads, max_tokens, prompts = job["threads"], job["max_tokens"], job["prompts"]
    longest = max(len(p["ids"]) for p in prompts)
    n_ctx = -(-(longest + max_tokens + row.k + 16) // 256) * 256
    draft = LlamaPromptLookupDecoding(max_ngram_size=job["lookup_ngram"], num_pred_tokens=row.k) \
        if row.method == "prompt_lookup" else None
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          draft_model=draft, seed=0, verbose=False)
    load_s = time.perf_counter() - start

    def generate(ids: list[int], count: int) -> tuple[list[int], float, float]:
        llm.reset()  # no prefix reuse across requests: ours starts every request cold too
        t0 = time.perf_counter()
        tokens, ttft = [], 0.0
        stream = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in stream:
            if not tokens:
                ttft = time.perf_counter() - t0
            tokens.append(int(token))
            if len(tokens) >= count:
                break
        stream.close()
        return tokens, time.perf_counter() - t0, ttft

    generate(prompts[0]["ids"], 8)  # warm-up
    samples = []
    for prompt in prompts:
        tokens, latency, ttft = generate(prompt["ids"], max_tokens)
        samples.append(_sample(prompt, tokens, latency, ttft, None))
    return {"load_s": load_s, "samples": samples, "info": {"llama_cpp": llama_cpp.__version__, "threads": threads,
                                                            "n_ctx": n_ctx}}


def main(job_file: Path, out_file: Path) -> int:
    job = json.loads(job_file.read_text())
    os.chdir(job["cwd"])
    result = run_ours_row(job) if job["row"]["engine"] == "ours" else run_llamacpp_row(job)
    out_file.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
