"""The rendered CPU pod's container, run here outside Kubernetes: its environment from
``deployment.yaml`` (only the spec/engine-cache paths, the bind address and the ports changed to
this machine's: loopback, free ports), the images' entrypoint, the REAL Triton server bundled
with nvidia-pytriton. Checks what a kubelet would rely on: the startup/readiness/liveness probe
paths answer 200 once ready, the metrics port serves the HPA's gauge (it counts a request in
flight), and the scale-in sequence (the preStop command, then SIGTERM) lets the request in flight
finish and exits 0 well within ``terminationGracePeriodSeconds``. No kubelet, no container."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from builder.loadtest.streams import metrics
from builder.ops.k8s.config import ImageKind, KubeConfig
from builder.ops.k8s.render import render, write
from builder.ops.triton_client import ClientConfig, ClientProtocol, GenerateRequest, generate
from triton_backend.serving.launch.triton_server import free_port
from builder.plan.spec import BuildSpec

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
SPEC = {"target": {"source": "smollm2-135m-instruct"}, "gpu": {"kind": "h100-80gb", "count": 1},
        "limits": {"max_batch_size": 4, "max_input_len": 512, "max_output_len": 128, "max_draft_len": 4}}
MAX_TOKENS = 96


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except OSError:
        return 0


def _local_env(container: dict, ports: dict[str, int], spec: Path, engines: Path) -> dict[str, str]:
    """The container's environment with this machine's spec and cache paths, loopback and free ports."""
    env = {e["name"]: e["value"] for e in container["env"]}
    env.update(SPECBUILD_SPEC=str(spec), SPECBUILD_ENGINE_CACHE=str(engines), SPECBUILD_HOST="127.0.0.1",
               SPECBUILD_PYTHON=sys.executable,
               **{f"SPECBUILD_{name.upper()}_PORT": str(port) for name, port in ports.items()})
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SPECBUILD_") or k == "SPECBUILD_CACHE_DIR"}
    return {**inherited, **env}


@pytest.mark.slow
def test_the_rendered_cpu_pod_starts_serves_its_gauge_and_drains_on_scale_in(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write(render(BuildSpec.from_dict(SPEC), KubeConfig(image_kind=ImageKind.CPU, prestop_s=1)), base)
    deployment = yaml.safe_load((base / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: free_port() for p in container["ports"]}
    assert len(set(ports.values())) == len(ports)
    env = _local_env(container, ports, base / "spec.yaml", tmp_path / "engines")
    probe = {kind: f"http://127.0.0.1:{ports[container[kind]['httpGet']['port']]}{container[kind]['httpGet']['path']}"
             for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    gauge = yaml.safe_load((base / "hpa.yaml").read_text())["spec"]["metrics"][0]["pods"]["metric"]["name"]
    metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
    started = time.monotonic()
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        budget = container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"]
        deadline = time.monotonic() + min(budget, 300)
        while _status(probe["startupProbe"]) != 200:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the startup probe never passed"
            time.sleep(0.5)
        print(f"startup probe passed after {time.monotonic() - started:.1f} s (budget {budget} s)")
        assert _status(probe["readinessProbe"]) == 200 and _status(probe["livenessProbe"]) == 200
        assert metrics(metrics_url)[f'{gauge}{{model="specdec"}}'] == 0

        results: dict[str, object] = {}
        request = GenerateRequest(prompt="Count from one to fifty in words.", max_tokens=MAX_TOKENS, ignore_eos=True,
                                  stream=True)

        def client() -> None:
            try:
                results["answer"] = generate(ClientConfig(f"127.0.0.1:{ports['grpc']}", ClientProtocol.GRPC), request)
            except Exception as exc:  # reported below
                results["error"] = exc

        thread = threading.Thread(target=client)
        thread.start()
        deadline = time.monotonic() + 60
        while metrics(metrics_url).get(f'{gauge}{{model="specdec"}}', 0) < 1:  # the HPA sees the load
            assert time.monotonic() < deadline and thread.is_alive(), f"never in flight: {results}"
            time.sleep(0.05)
        # scale-in: the kubelet runs preStop, then sends SIGTERM
        subprocess.run(container["lifecycle"]["preStop"]["exec"]["command"], check=True, timeout=30)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=pod["terminationGracePeriodSeconds"])
        took = time.monotonic() - stopped
        thread.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    print(f"SIGTERM to exit {took:.1f} s (grace period {pod['terminationGracePeriodSeconds']} s)")
    assert code == 0 and took < pod["terminationGracePeriodSeconds"], (code, took, proc.stderr.read()[-2000:])
    assert "error" not in results, results
    answer = results["answer"]
    assert answer.stats["num_output_tokens"] == MAX_TOKENS and answer.text  # finished, not cut off
    assert _status(probe["livenessProbe"]) == 0
