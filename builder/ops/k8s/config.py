"""What ``specbuild k8s render`` is asked for: one typed config, checked at construction.

Everything a rendered Kustomize base depends on besides the build spec and its plan lives here
(names, image, replicas, autoscaling target, storage, monitoring, overrides of the figures the
plan gives). A bad value raises :class:`KubernetesError` naming the field.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from triton_backend.core.errors import SpecbuildError

# The images' fixed paths (docker/Dockerfile.gpu, docker/Dockerfile.cpu)
ENGINE_CACHE_PATH = "/var/lib/specbuild/engines"
SPEC_DIR = "/etc/specbuild"
SPEC_FILE = "spec.yaml"
IMAGE_UID = 1000  # the CPU image's `specbuild` user; NVIDIA's Triton images have their own uid-1000 user
MODEL_ROLES = ("target", "draft", "medusa", "eagle")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
NAME_MAX = 40  # leaves room for the suffixes (-engines, -spec-<hash>, pod hashes) within 63


class KubernetesError(SpecbuildError, ValueError):
    """The Kubernetes manifests cannot be rendered as asked."""

    code = "kubernetes"


class ImageKind(str, enum.Enum):
    """Which image runs the pods: the GPU one (Triton + TensorRT-LLM, engines built in the pod)
    or the CPU one (the torch runtime on the Triton that nvidia-pytriton bundles)."""

    GPU = "gpu"
    CPU = "cpu"


class Monitoring(str, enum.Enum):
    """How Prometheus finds the metrics port: ``prometheus.io/*`` pod annotations (any
    Prometheus with the usual kubernetes-pods scrape job), a Prometheus Operator
    ``ServiceMonitor`` (needs its CRD in the cluster), or nothing."""

    ANNOTATIONS = "annotations"
    SERVICE_MONITOR = "servicemonitor"
    NONE = "none"


class AccessMode(str, enum.Enum):
    """Access mode of the engine-cache claim. ``ReadWriteMany``: every replica shares one cache
    (one builds, the others wait on its lock and reuse the build); ``ReadWriteOnce``: only pods
    on one node can mount it."""

    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE = "ReadWriteOnce"


def _enum(cls: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return value if isinstance(value, cls) else cls(value)
    except ValueError:
        raise KubernetesError(f"{name}: unknown value {value!r}; expected one of: "
                              f"{', '.join(m.value for m in cls)}") from None


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise KubernetesError(message)


def _positive(value: float | None, name: str, bound: float) -> None:
    _check(value is None or (not isinstance(value, bool) and 0 < value <= bound),
           f"{name} must be > 0 and at most {bound:g}, got {value!r}")


def parse_pairs(items: list[str] | tuple[str, ...], what: str) -> tuple[tuple[str, str], ...]:
    """``["k=v", ...]`` -> ``(("k", "v"), ...)`` sorted by key; a duplicate or missing ``=`` is an error."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        _check(sep == "=" and key != "", f"{what}: expected KEY=VALUE, got {item!r}")
        _check(key not in pairs, f"{what}: {key!r} given twice")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class KubeConfig:
    """The render's settings. ``None`` figures come from the spec and its plan
    (:mod:`builder.ops.k8s.sizing`)."""

    name: str = "specbuild"  # app.kubernetes.io/instance and the objects' name prefix
    namespace: str | None = None  # kustomization.yaml's namespace; None: the one kubectl applies to
    image_kind: ImageKind = ImageKind.GPU
    image: str | None = None  # None: specbuild:gpu / specbuild:cpu, the tags docker/README.md builds
    image_pull_policy: str = "IfNotPresent"
    gpus_per_node: int | None = None  # None: the spec's gpu.count (one node of the plan)
    min_replicas: int = 1
    max_replicas: int = 4
    autoscale: bool = True  # an HPA on the per-pod load gauge; False: a fixed min_replicas
    target_in_flight: int | None = None  # per-pod average the HPA keeps; None: 3/4 of the batch slots
    monitoring: Monitoring = Monitoring.ANNOTATIONS
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    openai_port: int | None = None  # rendered only when given (SPECBUILD_OPENAI_PORT)
    cache_size_gib: int | None = None  # engine-cache claim; None: from the plan
    cache_storage_class: str | None = None
    cache_access_mode: AccessMode = AccessMode.READ_WRITE_MANY
    models_claim: str | None = None  # an existing claim holding model weights, mounted read-only
    models_mount: str = "/models"
    model_paths: tuple[tuple[str, str], ...] = ()  # (role, container path): the pod's spec reads the model there
    memory_gib: float | None = None  # host memory request; None: from the plan
    memory_limit_factor: float = 1.25  # limit = request x factor
    shm_gib: float | None = None  # /dev/shm size; None: 1 GiB per Triton process (MPI rank)
    cpu: float | None = None  # CPU request (cores); None: 2, or 4 per GPU
    seconds_per_token: float | None = None  # worst decode time per token under load; None: from the plan
    max_request_s: int | None = None  # the longest request; None: the spec's limits x seconds_per_token
    prestop_s: int = 10  # preStop sleep: endpoints drop the pod before SIGTERM
    startup_minutes: int | None = None  # startup-probe budget (build + load); None: from the plan
    node_selector: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_kind", _enum(ImageKind, self.image_kind, "image_kind"))
        object.__setattr__(self, "monitoring", _enum(Monitoring, self.monitoring, "monitoring"))
        object.__setattr__(self, "cache_access_mode", _enum(AccessMode, self.cache_access_mode, "cache_access_mode"))
        _check(bool(_DNS_LABEL.match(self.name)) and len(self.name) <= NAME_MAX,
               f"name {self.name!r} must be a DNS label (lower-case letters, digits, '-') of at most {NAME_MAX} characters")
        _check(self.namespace is None or (bool(_DNS_LABEL.match(self.namespace)) and len(self.namespace) <= 63),
               f"namespace {self.namespace!r} must be a DNS label")
        _check(self.image is None or (self.image.strip() != "" and " " not in self.image), f"image {self.image!r} is not an image reference")
        _check(self.image_pull_policy in ("Always", "IfNotPresent", "Never"),
               f"image_pull_policy must be Always, IfNotPresent or Never, got {self.image_pull_policy!r}")
        self._check_counts()
        self._check_ports()
        self._check_storage()
        for key, value in self.node_selector:
            _check(bool(_LABEL_KEY.match(key)) and bool(_LABEL_VALUE.match(value)) and len(value) <= 63,
                   f"node selector {key}={value} is not a valid label")

    def _check_counts(self) -> None:
        for name, bound in (("gpus_per_node", 1024), ("min_replicas", 10_000), ("max_replicas", 10_000),
                            ("target_in_flight", 100_000), ("cache_size_gib", 1 << 20), ("max_request_s", 86_400),
                            ("startup_minutes", 10_080)):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= bound),
                   f"{name} must be a positive integer of at most {bound}, got {value!r}")
        _check(self.min_replicas <= self.max_replicas,
               f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        for name, bound in (("memory_gib", 65536), ("shm_gib", 65536), ("cpu", 4096), ("seconds_per_token", 3600)):
            _positive(getattr(self, name), name, bound)
        _check(1 <= self.memory_limit_factor <= 100, f"memory_limit_factor must be in [1, 100], got {self.memory_limit_factor}")
        _check(isinstance(self.prestop_s, int) and 0 <= self.prestop_s <= 300, f"prestop_s must be in 0..300, got {self.prestop_s!r}")

    def _check_ports(self) -> None:
        ports = [p for p in (self.http_port, self.grpc_port, self.metrics_port, self.openai_port) if p is not None]
        for port in ports:
            _check(isinstance(port, int) and 0 < port < 65536, f"port {port!r} must be in 1..65535")
        _check(len(set(ports)) == len(ports), f"ports must differ, got {ports}")

    def _check_storage(self) -> None:
        _check(self.models_claim is None or bool(_DNS_LABEL.match(self.models_claim)),
               f"models_claim {self.models_claim!r} must be a claim name (DNS label)")
        _check(PurePosixPath(self.models_mount).is_absolute(), f"models_mount must be an absolute path, got {self.models_mount!r}")
        roles = [role for role, _ in self.model_paths]
        _check(len(set(roles)) == len(roles), f"model paths: a role is given twice ({roles})")
        for role, path in self.model_paths:
            _check(role in MODEL_ROLES, f"model path role {role!r}: expected one of {', '.join(MODEL_ROLES)}")
            _check(PurePosixPath(path).is_absolute(), f"model path for {role} must be an absolute container path, got {path!r}")

    @property
    def image_ref(self) -> str:
        return self.image or f"specbuild:{self.image_kind.value}"

    @property
    def selector(self) -> dict[str, str]:
        """The pods' identity: the Deployment's, Service's, PDB's and ServiceMonitor's selector."""
        return {"app.kubernetes.io/name": "specbuild", "app.kubernetes.io/instance": self.name}

    @property
    def labels(self) -> dict[str, str]:
        return {**self.selector, "app.kubernetes.io/component": "triton"}

    def object_name(self, suffix: str = "") -> str:
        return f"{self.name}-{suffix}" if suffix else self.name


__all__ = ["AccessMode", "ENGINE_CACHE_PATH", "IMAGE_UID", "ImageKind", "KubeConfig", "KubernetesError", "MODEL_ROLES",
           "Monitoring", "SPEC_DIR", "SPEC_FILE", "parse_pairs"]
