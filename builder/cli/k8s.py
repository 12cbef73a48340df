"""``specbuild k8s``: Kubernetes manifests for a build spec and its plan.

    specbuild k8s render SPEC -o OUT [--gpus 2 --tp 2 ...] [--min-replicas 1 --max-replicas 4] ...
    kubectl apply -k OUT
    specbuild k8s adapter-rule        # the prometheus-adapter rule the HPA's metric needs

The spec flags are ``specbuild plan``'s; the rest parse into one
:class:`builder.ops.k8s.config.KubeConfig`. See docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from builder.cli.build import add_spec_arguments, spec_from_args
from builder.ops.k8s.config import AccessMode, ImageKind, KubeConfig, Monitoring, parse_pairs


def config_from_args(a: argparse.Namespace) -> KubeConfig:
    return KubeConfig(
        name=a.name, namespace=a.namespace, image_kind=ImageKind(a.image_kind), image=a.image,
        image_pull_policy=a.image_pull_policy, gpus_per_node=a.gpus_per_node, min_replicas=a.min_replicas,
        max_replicas=a.max_replicas, autoscale=not a.no_autoscale, target_in_flight=a.target_in_flight,
        monitoring=Monitoring(a.monitoring), http_port=a.http_port, grpc_port=a.grpc_port,
        metrics_port=a.metrics_port, openai_port=a.openai_port, cache_size_gib=a.cache_size_gib,
        cache_storage_class=a.cache_storage_class, cache_access_mode=AccessMode(a.cache_access_mode),
        models_claim=a.models_claim, models_mount=a.models_mount,
        model_paths=parse_pairs(a.model_path, "--model-path"), memory_gib=a.memory_gib,
        memory_limit_factor=a.memory_limit_factor, shm_gib=a.shm_gib, cpu=a.cpu,
        seconds_per_token=a.seconds_per_token, max_request_s=a.max_request_seconds, prestop_s=a.prestop_seconds,
        startup_minutes=a.startup_minutes, node_selector=parse_pairs(a.node_selector, "--node-selector"))


def cmd_render(a: argparse.Namespace) -> int:
    from builder.ops.k8s.render import render, write

    rendered = render(spec_from_args(a), config_from_args(a))
    written = write(rendered, Path(a.out_dir), force=a.force)
    s, plan = rendered.sizing, rendered.plan
    print(f"plan: TP {plan.tp} x PP {plan.pp} on {plan.gpu.name}; " +
          ", ".join(f"{m.role} {m.precision.value}" for m in plan.models))
    print(f"per replica: {s.gpus} GPU(s), memory {s.memory_request_gib}Gi request / {s.memory_limit_gib}Gi limit, "
          f"/dev/shm {s.shm_mib}Mi, engine cache {s.cache_size_gib}Gi")
    for note in s.notes:
        print(f"  {note}")
    print(f"wrote {len(written)} files to {a.out_dir}: {', '.join(p.name for p in written)}")
    print(f"apply with: kubectl apply -k {a.out_dir}")
    return 0


def cmd_adapter_rule(a: argparse.Namespace) -> int:
    from builder.ops.k8s.render import adapter_rule

    print(yaml.safe_dump({"rules": {"custom": [adapter_rule()]}}, sort_keys=False), end="")
    return 0


def _add_render(sub: Any) -> None:
    p = sub.add_parser("render", help="render a Kustomize base (Deployment, Service, PVC, PDB, HPA) from a build spec")
    add_spec_arguments(p)
    p.add_argument("-o", "--output", dest="out_dir", required=True, help="folder to write the base into")
    p.add_argument("--force", action="store_true", help="replace other YAML files in the output folder")
    p.add_argument("--name", default="specbuild", help="objects' name and app.kubernetes.io/instance")
    p.add_argument("--namespace", default=None, help="namespace set in kustomization.yaml")
    p.add_argument("--image-kind", default="gpu", choices=[k.value for k in ImageKind], help="GPU or CPU image")
    p.add_argument("--image", default=None, help="image reference (default specbuild:gpu / specbuild:cpu)")
    p.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs a node offers (default the spec's gpu.count)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--no-autoscale", action="store_true", help="no HPA: a fixed --min-replicas")
    p.add_argument("--target-in-flight", type=int, default=None,
                   help="HPA target: requests in flight per pod (default 3/4 of limits.max_batch_size)")
    p.add_argument("--monitoring", default="annotations", choices=[m.value for m in Monitoring])
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=None, help="also serve and expose the OpenAI-compatible port")
    p.add_argument("--cache-size-gib", type=int, default=None, help="engine-cache claim size (default from the plan)")
    p.add_argument("--cache-storage-class", default=None)
    p.add_argument("--cache-access-mode", default="ReadWriteMany", choices=[m.value for m in AccessMode])
    p.add_argument("--models-claim", default=None, help="existing claim with model weights, mounted read-only")
    p.add_argument("--models-mount", default="/models", help="where --models-claim is mounted")
    p.add_argument("--model-path", action="append", default=[], metavar="ROLE=PATH",
                   help="container path of a model (target, draft, medusa, eagle) in the pods' spec; repeatable")
    p.add_argument("--memory-gib", type=float, default=None, help="host memory request (default from the plan)")
    p.add_argument("--memory-limit-factor", type=float, default=1.25, help="memory limit = request x this")
    p.add_argument("--shm-gib", type=float, default=None, help="/dev/shm size (default 1 GiB per rank)")
    p.add_argument("--cpu", type=float, default=None, help="CPU request in cores (default 2, or 4 per GPU)")
    p.add_argument("--seconds-per-token", type=float, default=None, help="worst decode time per token under load")
    p.add_argument("--max-request-seconds", type=int, default=None, help="the longest request (sets the grace period)")
    p.add_argument("--prestop-seconds", type=int, default=10, help="preStop sleep before SIGTERM")
    p.add_argument("--startup-minutes", type=int, default=None, help="startup-probe budget (engine build + load)")
    p.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    p.set_defaults(func=cmd_render)


def register(sub: Any) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes manifests from a build spec and its plan",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = k8s.add_subparsers(dest="k8s_command", required=True)
    _add_render(commands)
    rule = commands.add_parser("adapter-rule", help="print the prometheus-adapter rule behind the HPA's metric")
    rule.set_defaults(func=cmd_adapter_rule)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `specbuild k8s render`")
