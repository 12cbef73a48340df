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

Issue 44's cases (``--only issue44`` runs just these: two server starts, a few minutes), in a
section of their own, their figures also in benchmarks/results/headline.json:
plain requests batched beside guided ones whose schema the grammar engine refuses (10,000 and
600 optional properties, a ``$ref`` loop), counted as ``poisoned_batch_collateral_failures``
(goal 0); a 3.9 MB prompt refused (``oversize_prompt_refusal_ms``, goal <= 100, one at a time);
malformed values (NaN / -1 / inf / 1e30 temperature, top_p 0, a 5000-digit max_tokens, a lone
surrogate) on every model, counted as ``malformed_value_500s`` (goal 0); a batch of 8 to
``tensorrt_llm_bls``; 16 HTTP ``generate`` clients that give up after 3 s, then a fresh 4-token
request (``abandoned_http_fresh_request_s``); SIGTERM with nothing in flight (``shutdown_s``,
goal <= 5, exit status 0, every port free at once); then a server with ``--api-key`` and the
OpenAI front on the same ports, each inference port probed without the key
(``unauthenticated_ports_with_key``, goal 0), and SIGTERM with a request in flight (drained:
answered in full, exit status 0).
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

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from builder.headline import HEADLINE_PATH, update_headline
from builder.loadtest.raw_requests import BIG, infer_input, stream_request
from builder.loadtest.raw_requests import post as _post
from triton_backend.serving.launch.triton_server import InferenceKey, ServerError, check_port_free, free_port

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- reliability.py: begin -->", "<!-- reliability.py: end -->"
BEGIN44, END44 = "<!-- reliability.py issue44: begin -->", "<!-- reliability.py issue44: end -->"
KEY = InferenceKey("reliability-" + "k" * 20)


def post(url: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout_s: float = 600) -> tuple[int, bytes, float]:
    """The tests' POST (status 0 when nothing answered), with the long form's longer timeout."""
    return _post(url, body, headers, timeout_s)


class Serve:
    """`specbuild serve` in a subprocess: its public endpoints and Triton's internal HTTP port.
    ``ports``: (HTTP, gRPC, metrics) to listen on; ``extra``: more ``serve`` flags."""

    def __init__(self, work: Path, ports: tuple[int, int, int] | None = None, extra: tuple[str, ...] = (),
                 tag: str = "serve") -> None:
        self.ports = ports or (free_port(), free_port(), free_port())
        self.err = open(work / f"{tag}.err", "w+")
        flags = ["--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]), "--metrics-port",
                 str(self.ports[2]), "--log-file", str(work / f"{tag}-triton.log"), *extra]
        self.proc = subprocess.Popen([sys.executable, "-m", "builder.cli.main", "serve", *flags], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = {}
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit("specbuild serve ended: " + Path(self.err.name).read_text()[-2000:])
            if line.split(" ", 1)[0] in ("HTTP", "gRPC", "metrics", "OpenAI"):
                lines[line.split(" ", 1)[0]] = line.split()[1]
            if line.startswith("try:"):
                break
        self.http, self.grpc, self.metrics = lines["HTTP"], lines["gRPC"], lines["metrics"]
        self.openai = lines["OpenAI"].removesuffix("/v1") if "OpenAI" in lines else None
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

    def in_flight(self) -> float:
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        return sum(float(m) for m in re.findall(r"^specdec_requests_in_flight\{[^}]*\} (\S+)$", text, re.M))

    def wait_idle(self, timeout_s: float = 120) -> float:
        """Seconds until nothing is in flight."""
        started = time.monotonic()
        while self.in_flight() > 0:
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"requests still in flight after {timeout_s:.0f}s")
            time.sleep(0.2)
        return time.monotonic() - started

    def stop(self) -> int:
        return self.timed_stop()[0]

    def timed_stop(self) -> tuple[int, float, list[str]]:
        """SIGTERM: (exit status, seconds to exit, the ports that a new server could not take at once)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=300)
        took = time.monotonic() - started
        taken = []
        for what, port in zip(("HTTP", "gRPC", "metrics"), self.ports):
            try:
                check_port_free("127.0.0.1", port, what)
            except ServerError:
                taken.append(f"{what} {port}")
        return code, took, taken


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


def issue44(serve: Serve) -> tuple[list[tuple[str, str]], dict[str, float | int]]:
    rows: list[tuple[str, str]] = []
    batch = poisoned_batch(serve.http)
    rows.append(("12 plain `ensemble` requests beside 3 refused schemas", json.dumps(batch)))
    sizes = oversize_prompt(serve)
    rows.append(("3.9 MB prompt over gRPC, median of 3 one at a time (ms)", json.dumps(sizes)))
    bad, internal = malformed(serve)
    rows += bad
    rows.append(("batch of 8 to `tensorrt_llm_bls` (`text_input`, `max_tokens` [8, 1])", bls_batch(serve)))
    figures = {"poisoned_batch_collateral_failures": int(batch["collateral_failures"]),
               "oversize_prompt_refusal_ms": max(sizes.values()), "malformed_value_500s": int(internal)}
    return rows, figures


def abandoned_http(serve: Serve, count: int = 16) -> dict[str, object]:
    """``count`` HTTP generate clients of ``ensemble`` (2048 tokens) that give up after 3 s, then a
    fresh 4-token request: how long it took, and whether the work behind the gone clients stopped."""
    before = serve.counter("cancelled")
    answers: list[tuple[int, bytes, float]] = []
    body = json.dumps({"text_input": "Tell me a long story.", "max_tokens": 2048, "ignore_eos": True}).encode()
    threads = [threading.Thread(target=lambda: answers.append(post(
        f"{serve.http}/v2/models/ensemble/generate", body, {"Content-Type": "application/json"}, timeout_s=3.0)))
        for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = generate(serve.http, "ensemble", {"text_input": "Hi", "max_tokens": 4})
    idle_after_s = serve.wait_idle()
    return {"clients": count, "gave_up": sum(1 for a in answers if a[0] == 0),
            "refused": sorted({a[0] for a in answers if a[0] not in (0, 200)}), "fresh_status": fresh[0],
            "fresh_served_after_s": round(fresh[2], 2), "idle_after_s": round(idle_after_s, 2),
            "cancelled_counted": int(serve.counter("cancelled") - before)}


def grpc_served(url: str, headers: dict[str, str] | None) -> bool:
    """Whether Triton's gRPC port serves an ``ensemble`` request with these headers."""
    inputs = [infer_input("text_input", np.array([[b"Hi"]], dtype=object), "BYTES"),
              infer_input("max_tokens", np.array([[2]], dtype=np.int32), "INT32")]
    with grpcclient.InferenceServerClient(url) as client:
        try:
            client.infer("ensemble", inputs, headers=headers, client_timeout=120)
            return True
        except InferenceServerException:
            return False


def openai_served(base: str, key: str | None) -> bool:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    status, answer, _ = post(f"{base}/v1/models", None, headers)
    if status != 200:
        return False
    model = json.loads(answer)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    return post(f"{base}/v1/chat/completions", body, headers)[0] == 200


def key_probe(serve: Serve) -> tuple[dict[str, object], int]:
    """With ``--api-key``: which inference port serves a request without the key (or with a wrong
    one), and, as a check of the probe, that each serves one with it. (rows, unauthenticated ports)."""
    generate_body = json.dumps({"text_input": "Hi", "max_tokens": 2}).encode()
    wrong = InferenceKey("not-the-key-" + "w" * 16)

    def http_served(base: str, key: InferenceKey | None) -> bool:
        headers = {"Content-Type": "application/json", **({"Authorization": key.value} if key else {})}
        return post(f"{base}/v2/models/ensemble/generate", generate_body, headers)[0] == 200

    assert serve.openai is not None
    probes = {"HTTP (the guard)": lambda key: http_served(serve.http, key),
              "Triton's internal HTTP (loopback)": lambda key: http_served(serve.internal, key),
              "gRPC": lambda key: grpc_served(serve.grpc, key.grpc_metadata if key else None),
              "OpenAI": lambda key: openai_served(serve.openai, key.key if key else None)}
    seen: dict[str, object] = {}
    open_ports = 0
    for port, served in probes.items():
        without, with_wrong, with_key = served(None), served(wrong), served(KEY)
        seen[port] = {"no key": without, "wrong key": with_wrong, "the key": with_key}
        open_ports += without or with_wrong
        if not with_key:
            raise SystemExit(f"{port} did not serve a request with the key: the probe proves nothing")
    return seen, open_ports


def drain(serve: Serve) -> dict[str, object]:
    """SIGTERM while a 48-token HTTP request (with the key) is in flight: answered in full?"""
    answer: dict[str, tuple[int, bytes, float]] = {}
    body = json.dumps({"text_input": "Tell me a story.", "max_tokens": 48, "ignore_eos": True}).encode()
    thread = threading.Thread(target=lambda: answer.setdefault("a", post(
        f"{serve.http}/v2/models/ensemble/generate", body,
        {"Content-Type": "application/json", "Authorization": KEY.value})))
    thread.start()
    started = time.monotonic()
    while serve.in_flight() < 1:
        if time.monotonic() - started > 60:
            raise SystemExit("the request never got in flight")
        time.sleep(0.05)
    time.sleep(1.0)
    code, took, taken = serve.timed_stop()
    thread.join()
    status, text, _ = answer["a"]
    tokens = json.loads(text).get("num_output_tokens") if status == 200 else None
    return {"exit_status": code, "shutdown_s": round(took, 2), "request_status": status, "tokens": tokens,
            "ports_not_free": taken}


def crashes(serve: Serve, count: int) -> dict[str, object]:
    recoveries = []
    for _ in range(count):
        status = post(f"{serve.internal}/v2/models/ensemble/generate", BIG, timeout_s=60)[0]
        time.sleep(1)
        recoveries.append(round(serve.ready(), 1))
    return {"crashes": count, "direct_status": status, "recovery_s": recoveries,
            "restarts_logged": len(re.findall(r"specbuild: Triton restart \d+", serve.stderr())),
            "gave_up": "giving up" in serve.stderr(), "serve_running": serve.proc.poll() is None}


def run_issue44(work: Path) -> tuple[list[tuple[str, str]], dict[str, float | int]]:
    """Issue 44's cases on two servers, the second on the first one's ports with a key."""
    serve = Serve(work, tag="serve-issue44")
    try:
        serve.ready()
        rows, figures = issue44(serve)
        abandoned_figures = abandoned_http(serve)
        rows.append(("16 HTTP `generate` clients of `ensemble` (2048 tokens) giving up after 3 s, then a 4-token "
                     "request", json.dumps(abandoned_figures)))
        figures["abandoned_http_fresh_request_s"] = abandoned_figures["fresh_served_after_s"]
        serve.wait_idle()
        time.sleep(1.0)
    except BaseException:
        serve.stop()
        raise
    code, took, taken = serve.timed_stop()
    rows.append(("SIGTERM with nothing in flight", json.dumps({"exit_status": code, "shutdown_s": round(took, 2),
                                                              "ports_not_free": taken})))
    figures["shutdown_s"] = round(took, 2)
    started = time.monotonic()
    keyed = Serve(work, serve.ports, ("--api-key", KEY.key, "--openai-port", str(free_port())), tag="serve-keyed")
    try:
        keyed.ready()
        rows.append(("`specbuild serve --api-key ... --openai-port ...` on the same ports at once",
                     f"started, ready {time.monotonic() - started:.0f} s later"))
        seen, open_ports = key_probe(keyed)
        rows.append(("inference ports served without the key / with a wrong key / with the key", json.dumps(seen)))
        figures["unauthenticated_ports_with_key"] = open_ports
        drained = drain(keyed)
        rows.append(("SIGTERM with a 48-token HTTP request in flight (drain)", json.dumps(drained)))
    finally:
        if keyed.proc.poll() is None:
            keyed.stop()
    return rows, figures


def run(args: argparse.Namespace, work: Path) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    serve = Serve(work)
    try:
        serve.ready()
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


def replace_section(text: str, begin: str, end: str, section: str) -> str:
    if begin in text:
        return text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(f"| {what} | {seen.replace('|', '/')} |" for what, seen in rows)


def write(rows: list[tuple[str, str]], args: argparse.Namespace, out: Path) -> None:
    section = (f"{BEGIN}\n## One unauthenticated client (issue 26)\n\n"
               f"`python scripts/reliability.py --crashes {args.crashes} --crowd {args.crowd} --abandoned {args.abandoned}`"
               f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the shared 2-core development machine "
               "(`specbuild serve` with its defaults: 8 batch slots + 64 queue places on `specdec`, the HTTP guard "
               "bounding bodies at 2 MiB, admin APIs closed).\n\n| case | observed |\n| --- | --- |\n"
               f"{table(rows)}\n{END}")
    text = out.read_text() if out.is_file() else "# Reliability\n"
    out.write_text(replace_section(text, BEGIN, END, section))


def write_issue44(rows: list[tuple[str, str]], figures: dict[str, float | int], out: Path) -> None:
    load = os.getloadavg()[0]
    section = (f"{BEGIN44}\n## One request's failure stays its own (issue 44)\n\n"
               f"`python scripts/reliability.py --only issue44`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
               f"on the shared 2-core development machine (load average {load:.1f} at the end: other sessions' "
               "work; times are those of a busy box), `specbuild serve` with its defaults (the default deployment).\n\n"
               f"Figures (also in `headline.json`): {json.dumps(figures)}\n\n| case | observed |\n| --- | --- |\n"
               f"{table(rows)}\n{END44}")
    text = out.read_text() if out.is_file() else "# Reliability\n"
    out.write_text(replace_section(text, BEGIN44, END44, section))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crashes", type=int, default=6)
    p.add_argument("--crowd", type=int, default=150)
    p.add_argument("--abandoned", type=int, default=80)
    p.add_argument("--only", choices=["issue44", "issue26"], help="run only these cases")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reliability.md")
    p.add_argument("--headline", type=Path, default=HEADLINE_PATH, help="the headline file to update")
    p.add_argument("--no-headline", action="store_true", help="do not write headline.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specbuild-reliability-") as work:
        if args.only != "issue26":
            rows44, figures = run_issue44(Path(work))
            write_issue44(rows44, figures, args.out)
            if not args.no_headline:
                update_headline(figures, args.headline)
            print("\n".join(f"{a}: {b}" for a, b in rows44))
        if args.only != "issue44":
            rows = run(args, Path(work))
            write(rows, args, args.out)
            print("\n".join(f"{a}: {b}" for a, b in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
