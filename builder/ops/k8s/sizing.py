"""The figures of a pod, from the build spec and its plan: GPUs, host memory, shared memory,
engine-cache size, the longest request (hence the shutdown budget) and the startup budget.

Each figure is an estimate from the plan's own numbers, written down in ``Sizing.notes`` next
to how it was reached, and each can be overridden in :class:`~builder.ops.k8s.config.KubeConfig`:

* GPUs per replica: the plan's TP x PP (one Triton process, MPI rank, per GPU). A plan needing
  more GPUs than a node offers cannot be scheduled and is refused here.
* Host memory, GPU image: a 16-bit copy of every model's weights (the pod builds its engines
  at first start: modelopt loads each model on the host to quantize and export it), plus
  ``BASE_GIB`` for Triton and its Python-backend processes, ``CUDA_HOST_GIB`` per MPI rank for
  the CUDA libraries and context on the host, plus ``/dev/shm`` (a memory-backed volume counts
  against the container's limit).
  CPU image: the torch runtime's resident set: float32 weights, the slot engine's static KV
  cache (the deployment's slots x positions), the row kernel's packed copy, plus the same base
  and ``/dev/shm``. Limit = request x ``memory_limit_factor``.
* Seconds per generated token under load: GPU, four times the plan's memory-bound lower bound
  of one decode step (target + draft; batched rows, draft rounds and KV reads cost more), at
  least ``GPU_MIN_S_PER_TOKEN``; CPU, ``CPU_S_PER_TOKEN``. The longest request: every output
  token of ``limits.max_output_len`` plus the prompt (``limits.max_input_len`` tokens at 1/8 of
  a decode step each: prefill runs in chunks).
* Shutdown: Triton's exit timeout (``SPECBUILD_EXIT_TIMEOUT``) = the longest request; the pod's
  ``terminationGracePeriodSeconds`` = preStop sleep + exit timeout + the supervisor's own grace
  (:data:`triton_backend.serving.launch.triton_supervisor.EXIT_GRACE_S`) + ``EXIT_SLACK_S``.
* Startup: the in-pod build (GPU: 30 min + 2 min per billion parameters; CPU torch-only: 5 min
  + 1 min per billion) plus Triton's startup timeout (``SPECBUILD_STARTUP_TIMEOUT``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from builder.ops.k8s.config import ImageKind, KubeConfig, KubernetesError
from triton_backend.serving.launch.triton_supervisor import EXIT_GRACE_S
from builder.plan.gpus import GIB
from builder.plan.memory import row_kernel_packed_bytes, torch_runtime_bytes
from builder.plan.planner import ResolvedModels
from builder.plan.spec import BuildSpec
from builder.plan.types import Plan
from builder.stages.torch_weights import torch_serving
from triton_backend.core.runtime_config import RuntimeConfig

BASE_GIB = 1.0  # Triton, its Python-backend stubs (front, tokenizer and serving models), the deploy process
CUDA_HOST_GIB = 2.0  # per rank: CUDA libraries and context on the host (an allowance, not measured here)
SHM_GIB_PER_RANK = 1.0
GPU_MIN_S_PER_TOKEN = 0.02
GPU_STEP_FACTOR = 4.0
CPU_S_PER_TOKEN = 0.1
PREFILL_SHARE = 1 / 8  # a prompt token's share of a decode step
MIN_EXIT_TIMEOUT_S = 30  # Triton's default --exit-timeout-secs
EXIT_SLACK_S = 5
TRITON_STARTUP_S = 600  # the deploy's --startup-timeout default: Triton loading the repository
PROBE_PERIOD_S = 10
CACHE_FACTOR = 1.2
MIN_CACHE_GIB = 10


@dataclass(frozen=True)
class Sizing:
    gpus: int  # per replica: nvidia.com/gpu (0 on the CPU image)
    world_size: int  # Triton processes (MPI ranks) in one pod
    memory_request_gib: int
    memory_limit_gib: int
    shm_mib: int
    cpu: float
    cache_size_gib: int
    seconds_per_token: float
    longest_request_s: int
    exit_timeout_s: int
    grace_period_s: int
    startup_budget_s: int
    batch_slots: int  # requests one pod batches at once (the serving model's max_batch_size)
    target_in_flight: int  # the HPA's per-pod average
    notes: tuple[str, ...]

    @property
    def startup_failure_threshold(self) -> int:
        return math.ceil(self.startup_budget_s / PROBE_PERIOD_S)


def _ceil_gib(value_bytes: float) -> int:
    return max(1, math.ceil(value_bytes / GIB - 1e-9))


def gpus_per_replica(plan: Plan, config: KubeConfig, spec: BuildSpec) -> int:
    """TP x PP; refused when a node offers fewer GPUs."""
    need = plan.tp * plan.pp
    per_node = config.gpus_per_node if config.gpus_per_node is not None else spec.gpu.count
    if need > per_node:
        raise KubernetesError(f"the plan needs {need} GPUs per replica (TP {plan.tp} x PP {plan.pp}) and a node offers "
                              f"{per_node}: one replica must run on one node (its ranks share /dev/shm); use GPUs with "
                              "more memory, a smaller model or precision, or nodes with more GPUs")
    return need


def _params(plan: Plan) -> int:
    """Every parameter the pod loads: target, draft, Medusa heads / EAGLE nets."""
    return sum(m.params for m in plan.models)


def host_memory_bytes(spec: BuildSpec, plan: Plan, models: ResolvedModels, config: KubeConfig,
                      world_size: int, shm_bytes: int) -> tuple[float, str]:
    base = BASE_GIB * GIB + shm_bytes
    if config.image_kind is ImageKind.GPU:
        copy = 2 * _params(plan)
        cuda = CUDA_HOST_GIB * GIB * world_size
        return base + cuda + copy, (f"16-bit host copy of {_params(plan) / 1e9:.2f} B parameters (in-pod build) "
                                    f"{copy / GIB:.2f} GiB + base {BASE_GIB:g} GiB + CUDA host allowance "
                                    f"{CUDA_HOST_GIB:g} GiB x {world_size} rank(s) + /dev/shm")
    runtime = RuntimeConfig()  # the slots x positions a build renders into the deployment
    total = 0
    for arch in (models.target, models.draft):
        if arch is not None:
            weights, kv = torch_runtime_bytes(arch, 4, runtime.max_batch_size, runtime.max_seq_len)
            total += weights + kv + row_kernel_packed_bytes(arch)
    heads = sum(m.params for m in plan.models if m.role in ("medusa", "eagle")) * 4
    return base + total + heads, (f"torch runtime (float32 weights, KV cache of {runtime.max_batch_size} slots x "
                                  f"{runtime.max_seq_len} positions, packed row-kernel copy) {(total + heads) / GIB:.2f} GiB "
                                  f"+ base {BASE_GIB:g} GiB + /dev/shm")


def seconds_per_token(plan: Plan, config: KubeConfig) -> tuple[float, str]:
    if config.seconds_per_token is not None:
        return config.seconds_per_token, "given"
    if config.image_kind is ImageKind.CPU:
        return CPU_S_PER_TOKEN, "CPU torch runtime"
    bound_s = sum(m.decode_step_ms for m in plan.models) / 1000
    value = max(GPU_MIN_S_PER_TOKEN, GPU_STEP_FACTOR * bound_s)
    return value, f"{GPU_STEP_FACTOR:g} x the plan's decode-step lower bound {bound_s * 1000:.2f} ms, at least {GPU_MIN_S_PER_TOKEN * 1000:g} ms"


def cache_bytes(spec: BuildSpec, plan: Plan, config: KubeConfig) -> int:
    """The build folder: torch-runtime weights, plus (GPU) TensorRT-LLM checkpoints and engines."""
    width = 4 if torch_serving(spec, plan).dtype == "float32" else 2
    if config.image_kind is ImageKind.CPU:
        width = 4
    total = width * _params(plan)
    if config.image_kind is ImageKind.GPU:
        total += 2 * sum(m.footprint.weights for m in plan.models) * plan.tp * plan.pp  # checkpoint + engine
    return int(total * CACHE_FACTOR) + GIB


def startup_budget_s(plan: Plan, config: KubeConfig) -> int:
    if config.startup_minutes is not None:
        return config.startup_minutes * 60
    billions = _params(plan) / 1e9
    build_min = 30 + 2 * billions if config.image_kind is ImageKind.GPU else 5 + billions
    return math.ceil(build_min * 60) + TRITON_STARTUP_S


def size(spec: BuildSpec, plan: Plan, models: ResolvedModels, config: KubeConfig) -> Sizing:
    gpu = config.image_kind is ImageKind.GPU
    world_size = gpus_per_replica(plan, config, spec) if gpu else 1
    shm_bytes = int((config.shm_gib if config.shm_gib is not None else SHM_GIB_PER_RANK * world_size) * GIB)
    notes = []
    if config.memory_gib is not None:
        memory, how = config.memory_gib * GIB, "given"
    else:
        memory, how = host_memory_bytes(spec, plan, models, config, world_size, shm_bytes)
    request = _ceil_gib(memory)
    notes.append(f"memory request {request} GiB: {how}; limit x {config.memory_limit_factor:g}")
    spt, how = seconds_per_token(plan, config)
    limits = spec.limits
    longest = config.max_request_s or math.ceil(limits.max_output_len * spt + limits.max_input_len * spt * PREFILL_SHARE)
    notes.append(f"longest request {longest} s: " + ("given" if config.max_request_s else
                 f"{limits.max_output_len} output + {limits.max_input_len} prompt tokens at {spt * 1000:.0f} ms a token ({how})"))
    exit_timeout = max(MIN_EXIT_TIMEOUT_S, longest)
    grace = config.prestop_s + exit_timeout + EXIT_GRACE_S + EXIT_SLACK_S
    notes.append(f"termination grace {grace} s = preStop {config.prestop_s} + Triton exit timeout {exit_timeout} "
                 f"+ supervisor {EXIT_GRACE_S} + slack {EXIT_SLACK_S}")
    cache = config.cache_size_gib or max(MIN_CACHE_GIB, _ceil_gib(cache_bytes(spec, plan, config)))
    startup = startup_budget_s(plan, config)
    notes.append(f"startup budget {startup // 60} min (build + Triton load), engine cache {cache} GiB")
    slots = limits.max_batch_size
    target = config.target_in_flight or max(1, math.ceil(0.75 * slots))
    return Sizing(gpus=world_size if gpu else 0, world_size=world_size, memory_request_gib=request,
                  memory_limit_gib=max(request, math.ceil(request * config.memory_limit_factor - 1e-9)),
                  shm_mib=math.ceil(shm_bytes / 2**20), cpu=config.cpu or (4.0 * world_size if gpu else 2.0),
                  cache_size_gib=cache, seconds_per_token=spt, longest_request_s=longest, exit_timeout_s=exit_timeout,
                  grace_period_s=grace, startup_budget_s=startup, batch_slots=slots, target_in_flight=target,
                  notes=tuple(notes))


__all__ = ["BASE_GIB", "Sizing", "gpus_per_replica", "size"]
