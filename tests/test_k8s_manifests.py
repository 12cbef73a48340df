"""`specbuild k8s render`: the Kustomize base for the reference specs (GPU, CPU, TP = 2).

No cluster runs here (no image registry, no kubelet): every rendered object is validated offline
against the Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: unknown fields are
errors), `kubectl kustomize` builds the base where kubectl is installed, and the figures are
checked against the plan.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) not installed")

from builder.cli.deploy import SETTINGS, config_from_settings, resolve_settings  # noqa: E402
from builder.cli.main import main  # noqa: E402
from builder.ops.deploy import DeployError  # noqa: E402
from builder.ops.k8s.config import ImageKind, KubeConfig, KubernetesError, Monitoring  # noqa: E402
from builder.ops.k8s.render import KUSTOMIZATION, adapter_rule, render, write  # noqa: E402
from triton_backend.serving.launch.triton_supervisor import EXIT_GRACE_S  # noqa: E402
from builder.plan.gpus import GIB  # noqa: E402
from builder.plan.planner import plan_deployment  # noqa: E402
from builder.plan.spec import BuildSpec, MedusaSpec, TorchRuntimeSpec  # noqa: E402
from triton_backend.serving.triton.metrics import IN_FLIGHT_GAUGE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPU_SPEC = REPO / "docker" / "specs" / "reference-gpu.yaml"
TP2_SPEC = REPO / "builder" / "examples" / "llama3-70b-8b-h100.yaml"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # the oldest and newest schemas checked
TP2_PATHS = (("draft", "/models/llama-3-8b"), ("target", "/models/llama-3-70b"))


def _tp2_spec() -> BuildSpec:
    spec = BuildSpec.load(TP2_SPEC)
    return replace(spec, gpu=replace(spec.gpu, count=2), parallel=replace(spec.parallel, tp_size=2))


def _cases() -> dict[str, tuple[BuildSpec, KubeConfig]]:
    gpu = BuildSpec.load(GPU_SPEC)
    return {
        "gpu": (gpu, KubeConfig()),
        "cpu": (replace(gpu, torch_runtime=TorchRuntimeSpec(device="cpu")), KubeConfig(image_kind=ImageKind.CPU)),
        "tp2": (_tp2_spec(), KubeConfig(name="llama70b", namespace="llm", models_claim="llama-weights",
                                        model_paths=TP2_PATHS, max_replicas=8, monitoring=Monitoring.SERVICE_MONITOR)),
    }


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    out = {}
    for name, (spec, config) in _cases().items():
        rendered = render(spec, config)
        folder = tmp_path_factory.mktemp(f"k8s-{name}")
        write(rendered, folder)
        out[name] = (rendered, folder)
    return out


def _load(folder: Path, name: str) -> dict:
    return yaml.safe_load((folder / name).read_text())


def _pod(rendered) -> dict:
    return rendered.files["deployment.yaml"]["spec"]["template"]["spec"]


def _env(rendered) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _pod(rendered)["containers"][0]["env"]}


@pytest.mark.parametrize("case", ["gpu", "cpu", "tp2"])
def test_every_written_object_passes_the_kubernetes_schemas(bases, case: str) -> None:
    rendered, folder = bases[case]
    kustomization = _load(folder, KUSTOMIZATION)
    for name in kustomization["resources"]:
        obj = _load(folder, name)
        assert obj == rendered.files[name]  # what was written is what was rendered
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # a CRD: no schema in kubernetes-validate; checked structurally below
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_validation_refuses_what_kubernetes_would(bases) -> None:
    """The check can fail: a misspelt field, a wrong type and a missing required field are refused."""
    rendered, _ = bases["gpu"]
    deployment = yaml.safe_load(rendered.text("deployment.yaml"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)
    hpa = yaml.safe_load(rendered.text("hpa.yaml"))
    hpa["spec"]["maxReplicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, "1.37.0", strict=True)
    service = yaml.safe_load(rendered.text("service.yaml"))
    del service["spec"]["ports"][0]["port"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, "1.37.0", strict=True)


@pytest.mark.parametrize("case", ["gpu", "cpu", "tp2"])
def test_the_objects_refer_to_one_another(bases, case: str) -> None:
    rendered, _ = bases[case]
    files = rendered.files
    deployment, service = files["deployment.yaml"], files["service.yaml"]
    template = deployment["spec"]["template"]
    labels, pod = template["metadata"]["labels"], template["spec"]
    container = pod["containers"][0]
    selectors = [deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                 files["pdb.yaml"]["spec"]["selector"]["matchLabels"]]
    if "servicemonitor.yaml" in files:
        selectors.append(files["servicemonitor.yaml"]["spec"]["selector"]["matchLabels"])
        assert selectors[-1].items() <= service["metadata"]["labels"].items()  # it selects the Service
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in files["servicemonitor.yaml"]["spec"]["endpoints"]} <= ports
    for selector in selectors:
        assert selector and selector.items() <= labels.items()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert named[port["targetPort"]] == port["port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in named
        assert container[probe]["httpGet"]["path"].startswith("/v2/health/")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    assert volumes["engine-cache"]["persistentVolumeClaim"]["claimName"] == files["engine-cache.yaml"]["metadata"]["name"]
    generated = files[KUSTOMIZATION]["configMapGenerator"][0]
    assert volumes["spec"]["configMap"]["name"] == generated["name"] and generated["files"] == ["spec.yaml"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert _env(rendered)["SPECBUILD_SPEC"] == mounts["/etc/specbuild"]["mountPath"] + "/spec.yaml"
    assert mounts["/dev/shm"]["name"] == "dshm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    if "hpa.yaml" in files:
        target = files["hpa.yaml"]["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0 and not security["allowPrivilegeEscalation"]
    assert pod["securityContext"]["fsGroup"] == security["runAsUser"]  # the engine-cache volume is writable


@pytest.mark.parametrize("case", ["gpu", "cpu", "tp2"])
def test_kustomization_lists_exactly_the_files_written(bases, case: str) -> None:
    _, folder = bases[case]
    kustomization = _load(folder, KUSTOMIZATION)
    listed = set(kustomization["resources"]) | {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    assert listed | {KUSTOMIZATION} == {p.name for p in folder.iterdir()}
    assert len(listed) == len(kustomization["resources"]) + 1


def test_the_figures_follow_the_plan(bases) -> None:
    for case, (spec, _) in _cases().items():
        rendered, _ = bases[case]
        plan, sizing = plan_deployment(spec), rendered.sizing
        container = _pod(rendered)["containers"][0]
        resources, env = container["resources"], _env(rendered)
        ranks = plan.tp * plan.pp if case != "cpu" else 1
        if case == "cpu":
            assert "nvidia.com/gpu" not in resources["limits"] and "tolerations" not in _pod(rendered)
            assert env["SPECBUILD_BUILD_MODE"] == "torch-only" and env["SPECBUILD_TRITON"] == "pytriton"
        else:
            assert resources["limits"]["nvidia.com/gpu"] == str(plan.tp * plan.pp)
            assert env["SPECBUILD_BUILD_MODE"] == "full" and env["SPECBUILD_TRITON"] == "path"
            # the host holds a 16-bit copy of every model while the pod builds its engines
            params = sum(m.params for m in plan.models)
            assert sizing.memory_request_gib * GIB >= 2 * params + (1 + 2 * ranks + ranks) * GIB
        shm = _pod(rendered)["volumes"][2]["emptyDir"]["sizeLimit"]
        assert shm == f"{1024 * ranks}Mi"
        request = int(resources["requests"]["memory"].removesuffix("Gi"))
        limit = int(resources["limits"]["memory"].removesuffix("Gi"))
        assert request >= 1 + ranks  # base + /dev/shm at least (a memory-backed volume counts)
        assert limit == math.ceil(request * 1.25)
        # graceful scale-in: the longest request the spec allows fits in Triton's exit timeout, which
        # fits with the preStop sleep and the supervisor's grace in the pod's grace period
        spt = sizing.seconds_per_token
        longest = spec.limits.max_output_len * spt + spec.limits.max_input_len * spt / 8
        assert int(env["SPECBUILD_EXIT_TIMEOUT"]) >= longest
        preStop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert preStop == ["sleep", "10"]
        assert _pod(rendered)["terminationGracePeriodSeconds"] == 10 + int(env["SPECBUILD_EXIT_TIMEOUT"]) + EXIT_GRACE_S + 5
        # the startup probe allows the engine build; liveness waits for it
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= (30 * 60 if case != "cpu" else 5 * 60)
        hpa = rendered.files["hpa.yaml"]["spec"]
        assert hpa["metrics"][0]["pods"]["metric"]["name"] == IN_FLIGHT_GAUGE
        assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == str(math.ceil(0.75 * spec.limits.max_batch_size))
    tp2 = bases["tp2"][0]
    assert tp2.plan.tp == 2 and tp2.sizing.gpus == 2 and tp2.files[KUSTOMIZATION]["namespace"] == "llm"
    assert tp2.files["hpa.yaml"]["spec"]["maxReplicas"] == 8


def test_the_pods_spec_is_the_plan_pinned(bases) -> None:
    for case, (spec, _) in _cases().items():
        rendered, folder = bases[case]
        loaded = BuildSpec.from_dict(_load(folder, "spec.yaml"))
        assert loaded == rendered.pod_spec
        assert loaded.parallel.tp_size == rendered.plan.tp and loaded.gpu.count == rendered.plan.tp * rendered.plan.pp
        assert loaded.limits == spec.limits and loaded.kv_cache_dtype == rendered.plan.kv_cache_dtype
        assert [loaded.target.precision] + ([loaded.draft.precision] if loaded.draft else []) == [
            m.precision for m in rendered.plan.models if m.role in ("target", "draft")]
        if case == "tp2":
            assert (loaded.target.source, loaded.draft.source) == ("/models/llama-3-70b", "/models/llama-3-8b")
            continue
        replanned = plan_deployment(loaded)  # what the pod's `specbuild deploy` plans
        assert (replanned.tp, replanned.pp) == (rendered.plan.tp, rendered.plan.pp)
        assert [(m.role, m.precision) for m in replanned.models] == [(m.role, m.precision) for m in rendered.plan.models]


@pytest.mark.parametrize("case", ["gpu", "cpu", "tp2"])
def test_the_environment_is_what_specbuild_deploy_reads(bases, case: str, tmp_path: Path) -> None:
    rendered, _ = bases[case]
    env = _env(rendered)
    known = {s.env for s in SETTINGS}
    assert set(env) <= known, set(env) - known
    config = config_from_settings(resolve_settings(_no_flags(), env))
    assert str(config.spec) == env["SPECBUILD_SPEC"] and config.server.host == "0.0.0.0"
    assert config.server.exit_timeout_s == rendered.sizing.exit_timeout_s
    with pytest.raises(DeployError, match="SPECBUILD_EXIT_TIMEOUT"):
        resolve_settings(_no_flags(), {**env, "SPECBUILD_EXIT_TIMEOUT": "0"})


def _no_flags():
    import argparse

    return argparse.Namespace(**{s.dest: None for s in SETTINGS})


def test_the_openai_port_only_when_asked(tmp_path: Path) -> None:
    spec, config = _cases()["gpu"]
    assert "openai" not in render(spec, config).text("service.yaml")
    rendered = render(spec, replace(config, openai_port=9000))
    container = _pod(rendered)["containers"][0]
    assert {"name": "openai", "containerPort": 9000, "protocol": "TCP"} in container["ports"]
    assert {"name": "openai", "port": 9000, "targetPort": "openai", "protocol": "TCP"} in rendered.files["service.yaml"]["spec"]["ports"]
    assert _env(rendered)["SPECBUILD_OPENAI_PORT"] == "9000"
    kubernetes_validate.validate(rendered.files["deployment.yaml"], "1.37.0", strict=True)


def test_monitoring_and_autoscaling_options() -> None:
    spec, config = _cases()["gpu"]
    annotated = render(spec, config)
    assert annotated.files["deployment.yaml"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    assert "servicemonitor.yaml" not in annotated.files
    fixed = render(spec, replace(config, monitoring=Monitoring.NONE, autoscale=False, min_replicas=3, max_replicas=3))
    assert "annotations" not in fixed.files["deployment.yaml"]["spec"]["template"]["metadata"]
    assert "hpa.yaml" not in fixed.files and fixed.files["deployment.yaml"]["spec"]["replicas"] == 3
    assert "replicas" not in annotated.files["deployment.yaml"]["spec"]  # the HPA owns the count
    kubernetes_validate.validate(fixed.files["deployment.yaml"], "1.37.0", strict=True)


def test_rendering_is_deterministic(bases, tmp_path: Path) -> None:
    spec, config = _cases()["tp2"]
    write(render(spec, config), tmp_path)
    _, first = bases["tp2"]
    for path in sorted(first.iterdir()):
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_clear_errors() -> None:
    gpu, _ = _cases()["gpu"]
    tp2 = _tp2_spec()
    claim = {"models_claim": "w", "model_paths": TP2_PATHS}
    with pytest.raises(KubernetesError, match=r"needs 2 GPUs per replica \(TP 2 x PP 1\) and a node offers 1"):
        render(tp2, KubeConfig(gpus_per_node=1, **claim))
    with pytest.raises(KubernetesError, match="architecture-only config"):
        render(tp2, KubeConfig())
    with pytest.raises(KubernetesError, match="--models-claim"):
        render(tp2, KubeConfig(model_paths=TP2_PATHS))
    with pytest.raises(KubernetesError, match="torch_runtime.device = 'cuda'"):
        render(gpu, KubeConfig(image_kind=ImageKind.CPU))
    with pytest.raises(KubernetesError, match="medusa section names no trained drafter"):
        render(replace(gpu, medusa=MedusaSpec(num_heads=4)), KubeConfig())
    with_heads = render(replace(gpu, medusa=MedusaSpec(num_heads=4)),
                        KubeConfig(models_claim="w", model_paths=(("medusa", "/models/heads.safetensors"),)))
    assert with_heads.pod_spec.medusa.source == "/models/heads.safetensors"
    with pytest.raises(KubernetesError, match="a path relative to where it is rendered"):
        render(replace(gpu, calibration=replace(gpu.calibration, text_file="data/calibration.txt")), KubeConfig())
    with pytest.raises(KubernetesError, match="spec has no draft"):
        render(gpu, KubeConfig(model_paths=(("draft", "/models/d"),), models_claim="w"))
    for bad, match in [({"min_replicas": 5, "max_replicas": 2}, "must not exceed"), ({"name": "Spec_Build"}, "DNS label"),
                       ({"openai_port": 8000}, "ports must differ"), ({"model_paths": (("head", "/m"),)}, "role"),
                       ({"model_paths": (("target", "models/x"),)}, "absolute"), ({"memory_limit_factor": 0.5}, r"\[1, 100\]"),
                       ({"shm_gib": float("inf")}, "at most"), ({"seconds_per_token": float("nan")}, "> 0"),
                       ({"monitoring": "grafana"}, "unknown value"), ({"node_selector": (("gpu type", "h100"),)}, "label")]:
        with pytest.raises(KubernetesError, match=match):
            KubeConfig(**bad)


def test_write_refuses_a_folder_with_other_yaml(bases, tmp_path: Path) -> None:
    rendered, _ = bases["gpu"]
    (tmp_path / "old-ingress.yaml").write_text("kind: Ingress\n")
    with pytest.raises(KubernetesError, match="old-ingress.yaml"):
        write(rendered, tmp_path)
    write(rendered, tmp_path, force=True)
    assert not (tmp_path / "old-ingress.yaml").exists() and (tmp_path / KUSTOMIZATION).is_file()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: `kubectl kustomize` not run")
@pytest.mark.parametrize("case", ["gpu", "tp2"])
def test_kubectl_kustomize_builds_the_base(bases, case: str) -> None:
    """kustomize (built into kubectl; no cluster needed) builds the base: the generated ConfigMap
    gets a content hash in its name and the Deployment's volume follows it."""
    rendered, folder = bases[case]
    built = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    expected = sorted([rendered.files[n]["kind"] for n in rendered.files[KUSTOMIZATION]["resources"]] + ["ConfigMap"])
    assert kinds == expected
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert re.fullmatch(rf"{rendered.files[KUSTOMIZATION]['configMapGenerator'][0]['name']}-[a-z0-9]{{10}}",
                        config_map["metadata"]["name"])
    assert BuildSpec.from_dict(yaml.safe_load(config_map["data"]["spec.yaml"])) == rendered.pod_spec
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "spec")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    namespace = rendered.files[KUSTOMIZATION].get("namespace")
    for doc in docs:
        assert doc["metadata"].get("namespace") == namespace
        if doc["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_the_docs_carry_the_adapter_rule_the_hpa_needs(capsys) -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", docs, re.S)]
    rules = [b for b in blocks if isinstance(b, dict) and "rules" in b]
    assert rules and rules[0]["rules"]["custom"] == [adapter_rule()]
    assert main(["k8s", "adapter-rule"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == rules[0]
    assert adapter_rule()["name"]["as"] == IN_FLIGHT_GAUGE


def test_the_command_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "base"
    assert main(["k8s", "render", str(GPU_SPEC), "-o", str(out), "--max-replicas", "6", "--openai-port", "9000"]) == 0
    assert "kubectl apply -k" in capsys.readouterr().out
    assert _load(out, "hpa.yaml")["spec"]["maxReplicas"] == 6
    assert main(["k8s", "render", str(TP2_SPEC), "--gpus", "2", "--tp", "2", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "architecture-only config" in err and "Traceback" not in err
