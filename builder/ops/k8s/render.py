"""A Kustomize base for a build spec and its plan: plain Python structures, dumped as YAML.

Objects (one file each; ``kustomization.yaml`` lists exactly the files written):

- ``spec.yaml`` -> ConfigMap ``<name>-spec`` (kustomize's ``configMapGenerator``: a changed spec
  gets a new name, so the pods roll): the spec the pods build, with the plan pinned (precisions,
  KV-cache dtype, TP, PP), the GPU count set to one replica's and model sources rewritten to
  container paths where asked.
- ``deployment.yaml``: the image's entrypoint (``specbuild deploy``) configured by ``SPECBUILD_*``
  variables, GPUs / memory / CPU from :mod:`builder.ops.k8s.sizing`, ``/dev/shm``, the engine
  cache, Triton health probes, preStop + grace period, non-root security context.
- ``service.yaml``: HTTP, gRPC, metrics (and the OpenAI port when asked).
- ``engine-cache.yaml``: the PersistentVolumeClaim of the engine cache.
- ``pdb.yaml``: at most one pod down at a time by a voluntary disruption.
- ``hpa.yaml`` (autoscaling): ``autoscaling/v2`` on the Pods metric
  :data:`~triton_backend.serving.triton.metrics.IN_FLIGHT_GAUGE` served by prometheus-adapter
  (:func:`adapter_rule`).
- ``servicemonitor.yaml`` (``Monitoring.SERVICE_MONITOR``): for the Prometheus Operator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from builder.ops.k8s.config import (ENGINE_CACHE_PATH, IMAGE_UID, SPEC_DIR, SPEC_FILE, ImageKind, KubeConfig,
                                    KubernetesError, Monitoring)
from builder.ops.k8s.sizing import TRITON_STARTUP_S, Sizing, size
from builder.plan.architecture import is_config_only
from builder.plan.planner import ResolvedModels, plan_deployment, resolve_models
from builder.plan.spec import BuildSpec, GpuTarget, ModelSpec, Parallelism
from builder.plan.types import Plan
from triton_backend.serving.triton.metrics import IN_FLIGHT_GAUGE

logger = logging.getLogger(__name__)

KUSTOMIZATION = "kustomization.yaml"
HPA_MAX_PERIOD_S = 1800  # the API's bound on a scaling policy's period


@dataclass(frozen=True)
class Rendered:
    """The base: file name -> the object written there (``spec.yaml``: the pod's build spec)."""

    files: dict[str, dict[str, Any]]
    pod_spec: BuildSpec
    plan: Plan
    sizing: Sizing

    def text(self, name: str) -> str:
        return yaml.safe_dump(self.files[name], sort_keys=False, default_flow_style=False, width=120)


# -- the pod's build spec -------------------------------------------------------------------
def pod_spec(spec: BuildSpec, plan: Plan, config: KubeConfig) -> BuildSpec:
    """What the pods build: the plan pinned (precisions, KV-cache dtype, TP and PP: the pod's
    planner only checks them), the GPU count of one replica, model sources at their container paths."""
    paths = dict(config.model_paths)
    changes: dict[str, Any] = {}
    for role in ("target", "draft"):
        model: ModelSpec | None = getattr(spec, role)
        if model is None:
            if role in paths:
                raise KubernetesError(f"a path is given for the {role}, and the spec has no {role}")
            continue
        changes[role] = replace(model, source=paths.get(role, model.source), precision=plan.precision_of(role))
        if role not in paths and is_config_only(model.source):
            raise KubernetesError(f"the {role} {model.source!r} is an architecture-only config (planning only): the pods "
                                  f"need its weights; mount them (--models-claim) and give their container path "
                                  f"(--model-path {role}={config.models_mount}/...)")
    for role in ("medusa", "eagle"):
        section = getattr(spec, role)
        if role in paths:
            if section is None:
                raise KubernetesError(f"a path is given for the {role}, and the spec has no {role} section")
            changes[role] = replace(section, source=paths[role])
        elif section is not None and section.source is None:
            raise KubernetesError(f"the spec's {role} section names no trained drafter (planning only): the pods' build "
                                  f"needs one; give its container path (--model-path {role}={config.models_mount}/...)")
    if config.image_kind is ImageKind.CPU and spec.torch_runtime.device != "cpu":
        raise KubernetesError(f"the CPU image serves the torch runtime on the CPU, and the spec asks for "
                              f"torch_runtime.device = {spec.torch_runtime.device!r}: use the GPU image or device cpu")
    gpus = plan.tp * plan.pp
    return replace(spec, **changes, kv_cache_dtype=plan.kv_cache_dtype, parallel=Parallelism(tp_size=plan.tp, pp_size=plan.pp),
                   gpu=GpuTarget(kind=spec.gpu.kind, count=gpus))


def _check_mounts(spec: BuildSpec, config: KubeConfig) -> None:
    """A model read from a container path needs a volume there."""
    sources = [m.source for m in (spec.target, spec.draft) if m is not None]
    sources += [s.source for s in (spec.medusa, spec.eagle) if s is not None and s.source is not None]
    if spec.calibration.text_file is not None:
        sources.append(spec.calibration.text_file)
    for source in sources:
        if not source.startswith("/") and ("/" in source or Path(source).exists()):
            raise KubernetesError(f"the spec reads {source!r}, a path relative to where it is rendered: the pods need a "
                                  f"container path (--model-path ROLE={config.models_mount}/..., or an absolute path in the spec)")
        if not source.startswith("/"):
            continue  # a reference model's name: in the image's cache
        if not source.startswith(config.models_mount.rstrip("/") + "/"):
            logger.warning("%s is outside the models mount %s: the image must hold it", source, config.models_mount)
        elif config.models_claim is None:
            raise KubernetesError(f"the spec reads {source} in the pod: mount the claim holding it with --models-claim "
                                  f"(at {config.models_mount})")


def spec_document(spec: BuildSpec) -> dict[str, Any]:
    """The spec as the pod reads it (``BuildSpec.from_dict`` of it gives ``spec`` back)."""
    data = spec.to_dict()
    return {key: value for key, value in data.items() if value is not None}


# -- objects ----------------------------------------------------------------------------------
def _meta(config: KubeConfig, name: str) -> dict[str, Any]:
    return {"name": name, "labels": dict(config.labels)}


def _ports(config: KubeConfig) -> list[tuple[str, int]]:
    ports = [("http", config.http_port), ("grpc", config.grpc_port), ("metrics", config.metrics_port)]
    if config.openai_port is not None:
        ports.append(("openai", config.openai_port))
    return ports


def environment(config: KubeConfig, sizing: Sizing) -> list[dict[str, str]]:
    """The entrypoint's settings (``specbuild deploy``'s ``SPECBUILD_*`` variables)."""
    gpu = config.image_kind is ImageKind.GPU
    env = {
        "SPECBUILD_SPEC": f"{SPEC_DIR}/{SPEC_FILE}",
        "SPECBUILD_ENGINE_CACHE": ENGINE_CACHE_PATH,
        "SPECBUILD_BUILD_MODE": "full" if gpu else "torch-only",
        "SPECBUILD_CALIBRATION_DEVICE": "cuda" if gpu else "cpu",
        "SPECBUILD_TRITON": "path" if gpu else "pytriton",
        "SPECBUILD_WORLD_SIZE": "auto",
        "SPECBUILD_HOST": "0.0.0.0",
        "SPECBUILD_HTTP_PORT": str(config.http_port),
        "SPECBUILD_GRPC_PORT": str(config.grpc_port),
        "SPECBUILD_METRICS_PORT": str(config.metrics_port),
        "SPECBUILD_EXIT_TIMEOUT": str(sizing.exit_timeout_s),
        "SPECBUILD_STARTUP_TIMEOUT": str(TRITON_STARTUP_S),
    }
    if config.openai_port is not None:
        env["SPECBUILD_OPENAI_PORT"] = str(config.openai_port)
    return [{"name": k, "value": v} for k, v in env.items()]


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": timeout,
            "failureThreshold": failures}


def container(config: KubeConfig, sizing: Sizing) -> dict[str, Any]:
    requests = {"cpu": f"{sizing.cpu:g}", "memory": f"{sizing.memory_request_gib}Gi"}
    limits: dict[str, str] = {"memory": f"{sizing.memory_limit_gib}Gi"}
    if sizing.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(sizing.gpus)
    mounts = [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
              {"name": "engine-cache", "mountPath": ENGINE_CACHE_PATH},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if config.models_claim is not None:
        mounts.append({"name": "models", "mountPath": config.models_mount, "readOnly": True})
    return {
        "name": "triton",
        "image": config.image_ref,
        "imagePullPolicy": config.image_pull_policy,
        "env": environment(config, sizing),
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in _ports(config)],
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        # the engine build happens before Triton listens: nothing else runs until this passes
        "startupProbe": _probe("/v2/health/ready", 10, sizing.startup_failure_threshold),
        "readinessProbe": _probe("/v2/health/ready", 5, 3),
        "livenessProbe": _probe("/v2/health/live", 10, 6),
        # endpoints drop a terminating pod asynchronously: keep serving meanwhile, then SIGTERM
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(config.prestop_s)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID},
    }


def volumes(config: KubeConfig, sizing: Sizing) -> list[dict[str, Any]]:
    vols = [{"name": "spec", "configMap": {"name": config.object_name("spec")}},
            {"name": "engine-cache", "persistentVolumeClaim": {"claimName": config.object_name("engines")}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{sizing.shm_mib}Mi"}}]
    if config.models_claim is not None:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": config.models_claim, "readOnly": True}})
    return vols


def deployment(config: KubeConfig, sizing: Sizing) -> dict[str, Any]:
    template_meta: dict[str, Any] = {"labels": dict(config.labels)}
    if config.monitoring is Monitoring.ANNOTATIONS:
        template_meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.metrics_port),
                                        "prometheus.io/path": "/metrics"}
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": sizing.grace_period_s,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container(config, sizing)],
        "volumes": volumes(config, sizing),
    }
    if sizing.gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if config.node_selector:
        pod["nodeSelector"] = dict(config.node_selector)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(config.selector)},
        # a new pod builds or loads engines for a long time: add it before removing an old one
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": template_meta, "spec": pod},
    }
    if not config.autoscale:
        spec = {"replicas": config.min_replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(config, config.name), "spec": spec}


def service(config: KubeConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(config, config.name),
            "spec": {"type": "ClusterIP", "selector": dict(config.selector),
                     "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                               for name, port in _ports(config)]}}


def engine_cache_claim(config: KubeConfig, sizing: Sizing) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": [config.cache_access_mode.value],
                            "resources": {"requests": {"storage": f"{sizing.cache_size_gib}Gi"}}}
    if config.cache_storage_class is not None:
        spec["storageClassName"] = config.cache_storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(config, config.object_name("engines")),
            "spec": spec}


def disruption_budget(config: KubeConfig) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(config, config.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(config.selector)}}}


def autoscaler(config: KubeConfig, sizing: Sizing) -> dict[str, Any]:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(config, config.name),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": config.name},
                "minReplicas": config.min_replicas, "maxReplicas": config.max_replicas,
                "metrics": [{"type": "Pods", "pods": {"metric": {"name": IN_FLIGHT_GAUGE},
                                                      "target": {"type": "AverageValue",
                                                                 "averageValue": str(sizing.target_in_flight)}}}],
                "behavior": {
                    "scaleUp": {"stabilizationWindowSeconds": 0,
                                "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                    # one pod at a time, each after its in-flight requests had their grace period
                    "scaleDown": {"stabilizationWindowSeconds": 300,
                                  "policies": [{"type": "Pods", "value": 1,
                                                "periodSeconds": min(HPA_MAX_PERIOD_S, max(60, sizing.grace_period_s))}]},
                }}}


def service_monitor(config: KubeConfig) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(config, config.name),
            "spec": {"selector": {"matchLabels": dict(config.selector)},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def adapter_rule() -> dict[str, Any]:
    """prometheus-adapter's custom-metrics rule serving the HPA's Pods metric: the gauge summed
    over a pod's series (one per serving model), per pod and namespace."""
    return {"seriesQuery": f'{IN_FLIGHT_GAUGE}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{IN_FLIGHT_GAUGE}$", "as": IN_FLIGHT_GAUGE},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}


def kustomization(config: KubeConfig, resources: list[str]) -> dict[str, Any]:
    data: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if config.namespace is not None:
        data["namespace"] = config.namespace
    data["resources"] = list(resources)
    data["configMapGenerator"] = [{"name": config.object_name("spec"), "files": [SPEC_FILE],
                                   "options": {"labels": dict(config.labels)}}]
    return data


# -- the whole base ---------------------------------------------------------------------------
def render(spec: BuildSpec, config: KubeConfig, models: ResolvedModels | None = None) -> Rendered:
    """Plan the spec and render the base (nothing written)."""
    models = models or resolve_models(spec)
    plan = plan_deployment(spec, models)
    sizing = size(spec, plan, models, config)
    for_pods = pod_spec(spec, plan, config)
    _check_mounts(for_pods, config)
    objects = {"deployment.yaml": deployment(config, sizing), "service.yaml": service(config),
               "engine-cache.yaml": engine_cache_claim(config, sizing), "pdb.yaml": disruption_budget(config)}
    if config.autoscale:
        objects["hpa.yaml"] = autoscaler(config, sizing)
    if config.monitoring is Monitoring.SERVICE_MONITOR:
        objects["servicemonitor.yaml"] = service_monitor(config)
    files = {SPEC_FILE: spec_document(for_pods), **objects, KUSTOMIZATION: kustomization(config, list(objects))}
    return Rendered(files=files, pod_spec=for_pods, plan=plan, sizing=sizing)


def write(rendered: Rendered, out: Path, *, force: bool = False) -> list[Path]:
    """Write every file of the base into ``out`` (refusing to mix with other YAML files there
    unless ``force``: a stale object left beside the base would not be applied, or worse, would)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KubernetesError(f"{out} exists and is not a folder")
    stale = sorted(p.name for p in out.glob("*.y*ml") if p.name not in rendered.files) if out.is_dir() else []
    if stale and not force:
        raise KubernetesError(f"{out} holds other YAML files ({', '.join(stale)}): render into an empty folder, "
                              "or pass --force to replace the folder's YAML files")
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in stale:
            (out / name).unlink()
        for name in rendered.files:
            path = out / name
            path.write_text(rendered.text(name))
            written.append(path)
    except OSError as exc:
        raise KubernetesError(f"cannot write the base into {out}: {exc.strerror or exc}") from None
    return written


__all__ = ["KUSTOMIZATION", "Rendered", "adapter_rule", "autoscaler", "deployment", "environment", "pod_spec", "render",
           "spec_document", "write"]
