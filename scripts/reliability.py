#!/usr/bin/env python3
"""The long form of tests/test_abuse.py: what one unauthenticated client (or a crowd) can do
to `specbuild serve` (the default deployment and bounds, the HTTP guard, the real Triton),
measured, and written as a section of benchmarks/results/reliability.md.

    nice python scripts/reliability.py [--crashes 6] [--crowd 150] [--abandoned 80]

Cases: a 6 MB form-encoded generate body through the guard, and straight to Triton's own
(internal) HTTP port, where Triton 2.51 segfaults: ``--crashes`` times, to show the supervisor
never gives up on such crashes; crowds on ``ensemble`` and ``tensorrt_llm_bls``; clients of
``ensemble`` that give up after 3 s; 100,000 stop words; integers Triton would wrap; an 8 MB
prompt over gRPC; the admin APIs; status codes of validation and overload errors.

Issue 44's cases (``--only issue44`` runs just these, in about a minute after the server is up):
plain requests batched beside guided ones whose schema the grammar engine refuses (10,000 and
600 optional properties, a ``$ref`` loop), counted as ``poisoned_batch_collateral_failures``
(goal 0); a 3.9 MB prompt refused (``oversize_prompt_refusal_ms``, goal <= 100, one at a time);
malformed values (NaN / -1 / inf / 1e30 temperature, top_p 0, a 5000-digit max_tokens, a lone
surrogate) on every model, counted as ``malformed_value_500s`` (goal 0); a batch of 8 to
``tensorrt_llm_bls``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from reliability_fixtures import BIG, infer_input, stream_request  # noqa: E402
from reliability_fixtures import post as _post  # noqa: E402

import numpy as np  # noqa: E402

BEGIN, END = "<!-- reliability.py: begin -->", "<!-- reliability.py: end -->"


def post(url: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout_s: float = 600) -> tuple[int, bytes, float]:
    """The tests' POST (status 0 when nothing answered), with the long form's longer timeout."""
    return _post(url, body, headers, timeout_s)


class Serve:
    """`specbuild serve` in a subprocess: its public endpoints and Triton's internal HTTP port."""

    def __init__(self, work: Path) -> None:
        self.err = open(work / "serve.err", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "builder.cli.main", "serve", "--log-file",
                                      str(work / "triton.log")], cwd=REPO, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = {}
        while "metrics" not in lines:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit("specbuild serve ended: " + (work / "serve.err").read_text()[-2000:])
            if line.split(" ", 1)[0] in ("HTTP", "gRPC", "metrics"):
                lines[line.split(" ", 1)[0]] = line.split()[1]
        self.http, self.grpc, self.metrics = lines["HTTP"], lines["gRPC"], lines["metrics"]
        self.internal = re.search(r"HTTP guard on \S+ -> (http://\S+)", self.stderr()).group(1)

    def stderr(self) -> str:
        self.err.flush()
        return Path(self.err.name).read_text()

    def ready(self, timeout_s: float = 300) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if post(f"{self.http}/v2/health/ready", None, timeout_s=5)[0] == 200:
                return time.monotonic() - started
            time.sleep(0.5)
        raise SystemExit("the server did not come back")

    def counter(self, outcome: str) -> float:
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        match = re.search(rf'^specdec_requests_total{{model="specdec",outcome="{outcome}"}} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def generate(base: str, model: str, body: dict) -> tuple[int, bytes, float]:
    return post(f"{base}/v2/models/{model}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})


def crowd(base: str, model: str, count: int) -> dict[str, object]:
    answers: list[tuple[int, bytes, float]] = []
    body = {"text_input": "Count to ten.", "max_tokens": 16, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: answers.append(generate(base, model, body))) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = sorted(a[2] for a in answers if a[0] == 200)
    refused = sorted(a[2] for a in answers if a[0] != 200)
    codes = sorted({a[0] for a in answers if a[0] != 200})
    return {"served": len(served), "refused": len(refused), "codes": codes,
            "served_p50_s": round(statistics.median(served), 2) if served else None,
            "served_max_s": round(served[-1], 2) if served else None,
            "refused_max_s": round(refused[-1], 3) if refused else None}


def abandoned(serve: Serve, count: int) -> dict[str, object]:
    before = serve.counter("cancelled")
    request = [infer_input("text_input", np.array([[b"Tell me a long story."]], dtype=object), "BYTES"),
               infer_input("max_tokens", np.array([[2000]], dtype=np.int32), "INT32"),
               infer_input("ignore_eos", np.array([[True]]), "BOOL"), infer_input("stream", np.array([[True]]), "BOOL")]
    threads = [threading.Thread(target=stream_request, args=(serve.grpc, request),
                                kwargs={"cancel_after_s": 3.0, "model": "ensemble", "timeout_s": 600})
               for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gave_up = time.monotonic()
    fresh = generate(serve.http, "ensemble", {"text_input": "Hi", "max_tokens": 4})
    first_served_s = time.monotonic() - gave_up
    time.sleep(2)
    return {"clients": count, "fresh_status": fresh[0], "fresh_served_after_s": round(first_served_s, 2),
            "cancelled_counted": int(serve.counter("cancelled") - before)}


MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
POISONED = {"10,000 optional properties": MANY_OPTIONAL,
            "600 optional properties": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}},
            "a $ref loop": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}


def poisoned_batch(base: str, plain: int = 12) -> dict[str, object]:
    """Plain requests beside guided ones the grammar engine refuses, all at once."""
    answers: list[tuple[int, bytes, float]] = []
    poisoned: dict[str, str] = {}
    body = {"text_input": "Count to ten.", "max_tokens": 16, "ignore_eos": True}

    def bad(label: str, schema: dict) -> None:
        status, answer, took = generate(base, "ensemble", {"text_input": "Answer in JSON.", "max_tokens": 16,
                                                           "guided_decoding_guide_type": "json_schema",
                                                           "guided_decoding_guide": json.dumps(schema)})
        poisoned[label] = f"{status} in {took * 1000:.0f} ms: {answer.decode()[:120]}"

    threads = ([threading.Thread(target=lambda: answers.append(generate(base, "ensemble", body))) for _ in range(plain)]
               + [threading.Thread(target=bad, args=item) for item in POISONED.items()])
    for t in threads[:plain // 2] + threads[plain:] + threads[plain // 2:plain]:
        t.start()
    for t in threads:
        t.join()
    return {"plain": len(answers), "collateral_failures": sum(1 for a in answers if a[0] != 200), "poisoned": poisoned}


def oversize_prompt(serve: Serve, repeats: int = 3) -> dict[str, object]:
    """A 3.9 MB prompt, one at a time, to specdec (gRPC: no guard in front) and through ensemble."""
    prompt = np.array([[b"word " * (780 * 1024)]], dtype=object)
    took: dict[str, list[float]] = {}
    for model in ("specdec", "ensemble"):
        for _ in range(repeats):
            started = time.monotonic()
            outcome = stream_request(serve.grpc, [infer_input("text_input", prompt, "BYTES"),
                                                  infer_input("max_tokens", np.array([[8]], dtype=np.int32), "INT32")],
                                     model=model)
            took.setdefault(model, []).append((time.monotonic() - started) * 1000)
            assert outcome.error and "over the limit" in outcome.error, outcome.error
    return {model: round(statistics.median(ms), 1) for model, ms in took.items()}


def malformed(serve: Serve) -> tuple[list[tuple[str, str]], int]:
    """Malformed values on every model: (rows, answers that were 500 / internal)."""
    rows, internal = [], 0
    for value in (float("nan"), -1.0, float("inf"), 1e30):
        for model in ("specdec", "ensemble", "tensorrt_llm_bls"):
            outcome = stream_request(serve.grpc, [
                infer_input("text_input", np.array([[b"Hi"]], dtype=object), "BYTES"),
                infer_input("max_tokens", np.array([[4]], dtype=np.int32), "INT32"),
                infer_input("temperature", np.array([[value]], dtype=np.float32), "FP32")], model=model)
            internal += outcome.error is None or "internal" in (outcome.error or "").lower()
            rows.append((f"`temperature` {value} via `{model}` (gRPC)", str(outcome.error)[:120]))
    raw = [("`top_p` 0 via `specdec`", "specdec", json.dumps({"text_input": "Hi", "top_p": 0.0}).encode()),
           ("`max_tokens` of 5000 digits", "ensemble", b'{"text_input": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"),
           ("a lone surrogate in `text_input`", "ensemble", b'{"text_input": "Hi \\ud800", "max_tokens": 4}')]
    for label, model, body in raw:
        status, answer, took = post(f"{serve.http}/v2/models/{model}/generate", body, {"Content-Type": "application/json"})
        internal += status >= 500 or status == 200
        rows.append((label, f"{status} in {took * 1000:.0f} ms: {answer.decode()[:120]}"))
    return rows, internal


def bls_batch(serve: Serve) -> str:
    prompts = np.array([[f"Fact {i}: the capital of France is".encode()] for i in range(8)], dtype=object)
    outcome = stream_request(serve.grpc, [infer_input("text_input", prompts, "BYTES"),
                                          infer_input("max_tokens", np.full((8, 1), 6, np.int32), "INT32")],
                             model="tensorrt_llm_bls")
    if outcome.error:
        return f"refused: {outcome.error[:160]}"
    return f"served: {len(outcome.responses[-1]['text_output'].reshape(-1))} rows of text"


def issue44(serve: Serve) -> tuple[list[tuple[str, str]], dict[str, float]]:
    rows: list[tuple[str, str]] = []
    batch = poisoned_batch(serve.http)
    rows.append(("12 plain `ensemble` requests beside 3 refused schemas", json.dumps(batch)))
    sizes = oversize_prompt(serve)
    rows.append(("3.9 MB prompt over gRPC, median of 3 one at a time (ms)", json.dumps(sizes)))
    bad, internal = malformed(serve)
    rows += bad
    rows.append(("batch of 8 to `tensorrt_llm_bls` (`text_input`, `max_tokens` [8, 1])", bls_batch(serve)))
    figures = {"poisoned_batch_collateral_failures": float(batch["collateral_failures"]),
               "oversize_prompt_refusal_ms": max(sizes.values()), "malformed_value_500s": float(internal)}
    return rows, figures


def crashes(serve: Serve, count: int) -> dict[str, object]:
    recoveries = []
    for _ in range(count):
        status = post(f"{serve.internal}/v2/models/ensemble/generate", BIG, timeout_s=60)[0]
        time.sleep(1)
        recoveries.append(round(serve.ready(), 1))
    return {"crashes": count, "direct_status": status, "recovery_s": recoveries,
            "restarts_logged": len(re.findall(r"specbuild: Triton restart \d+", serve.stderr())),
            "gave_up": "giving up" in serve.stderr(), "serve_running": serve.proc.poll() is None}


def run(args: argparse.Namespace, work: Path) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    serve = Serve(work)
    try:
        serve.ready()
        cases, figures = issue44(serve)
        rows += cases + [("issue 44 figures", json.dumps(figures))]
        if args.only == "issue44":
            return rows
        base = serve.http
        status, body, took = post(f"{base}/v2/models/ensemble/generate", BIG)
        rows.append(("6 MB form-encoded `generate` body through the guard",
                     f"{status} `{json.loads(body).get('code')}` in {took * 1000:.0f} ms; Triton untouched"))
        rows.append((f"the same body straight to Triton's internal port, {args.crashes} times",
                     json.dumps(crashes(serve, args.crashes))))
        for model, count in (("ensemble", args.crowd), ("tensorrt_llm_bls", args.crowd * 2 // 3)):
            rows.append((f"{count} concurrent HTTP `generate` on `{model}` (16 tokens)", json.dumps(crowd(base, model, count))))
        rows.append((f"{args.abandoned} `ensemble` gRPC clients giving up after 3 s", json.dumps(abandoned(serve, args.abandoned))))
        for label, body in (("100,000 `stop_words`", {"text_input": "Hi", "max_tokens": 2000,
                                                     "stop_words": [f"w{i}" for i in range(100_000)]}),
                            ("`max_tokens` 2^32 + 5", {"text_input": "Hi", "max_tokens": 2**32 + 5}),
                            ("`max_tokens` 10^9", {"text_input": "Hi", "max_tokens": 10**9}),
                            ("`max_tokens` 2^40", {"text_input": "Hi", "max_tokens": 2**40}),
                            ("`temperature` -1 via `tensorrt_llm_bls`", {"text_input": "Hi", "temperature": -1.0})):
            model = "tensorrt_llm_bls" if "bls" in label else "ensemble"
            status, answer, took = generate(base, model, body)
            rows.append((label, f"{status} in {took * 1000:.0f} ms: {answer.decode()[:160]}"))
        started = time.monotonic()
        outcome = stream_request(serve.grpc, [infer_input("text_input", np.array([[b"x" * (8 << 20)]], dtype=object),
                                                          "BYTES")], model="ensemble")
        rows.append(("8 MB prompt over gRPC (no guard)", f"{(time.monotonic() - started) * 1000:.0f} ms: {outcome.error}"))
        for path in ("/v2/logging", "/v2/repository/index", "/v2/models/stats", "/v2/systemsharedmemory/status"):
            status, answer, _ = post(base + path, b"{}" if "repository" in path else None)
            rows.append((f"`{path}` without the admin key", f"{status} `{json.loads(answer).get('code')}`"))
    finally:
        code = serve.stop()
        rows.append(("SIGTERM at the end", f"`specbuild serve` exit status {code}"))
    return rows


def write(rows: list[tuple[str, str]], args: argparse.Namespace, out: Path) -> None:
    table = "\n".join(f"| {what} | {seen.replace('|', '/')} |" for what, seen in rows)
    section = (f"{BEGIN}\n## One unauthenticated client (issue 26)\n\n"
               f"`python scripts/reliability.py --crashes {args.crashes} --crowd {args.crowd} --abandoned {args.abandoned}`"
               f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the shared 2-core development machine "
               "(`specbuild serve` with its defaults: 8 batch slots + 64 queue places on `specdec`, the HTTP guard "
               "bounding bodies at 2 MiB, admin APIs closed).\n\n| case | observed |\n| --- | --- |\n"
               f"{table}\n{END}")
    text = out.read_text() if out.is_file() else "# Reliability\n"
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crashes", type=int, default=6)
    p.add_argument("--crowd", type=int, default=150)
    p.add_argument("--abandoned", type=int, default=80)
    p.add_argument("--only", choices=["issue44"], help="run only these cases (a short check)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reliability.md")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specbuild-reliability-") as work:
        rows = run(args, Path(work))
    write(rows, args, args.out)
    print("\n".join(f"{a}: {b}" for a, b in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
