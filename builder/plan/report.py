"""The plan as a human-readable table."""

from __future__ import annotations

from builder.plan.gpus import GIB
from builder.plan.types import Plan


def _params(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    """Per model: params, precision, weights/KV/activations per GPU; totals vs capacity; why."""
    header = ("model", "source", "params", "precision", "weights GiB", "KV GiB", "act GiB", "total GiB", "step ms>=")
    rows = [header]
    for m in plan.models:
        fp = m.footprint
        chosen = m.precision_label + (" (auto)" if m.requested.value == "auto" else "")
        rows.append((m.role, _short(m.source), _params(m.params), chosen, _gib(fp.weights), _gib(fp.kv_cache),
                     _gib(fp.activations), _gib(fp.total), f"{m.decode_step_ms:.2f}"))
    rows.append(("workspace", "", "", "", "", "", "", _gib(plan.workspace_bytes), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    gpu = plan.gpu
    lines += [
        "",
        f"GPU: {plan.gpu_count} x {gpu.name} ({gpu.memory_gib:.1f} GiB, {gpu.bandwidth_gbps / 1000:.2f} TB/s); "
        f"TP {plan.tp} x PP {plan.pp}, {plan.replicas} replica(s); KV cache {plan.kv_cache_dtype.value}",
        f"per GPU: {_gib(plan.total_per_gpu)} GiB of {_gib(plan.capacity)} GiB, headroom {_gib(plan.headroom)} GiB "
        f"({'fits' if plan.fits else 'DOES NOT FIT'})",
        f"limits: batch {plan.limits.max_batch_size}, input {plan.limits.max_input_len}, output "
        f"{plan.limits.max_output_len}, draft {plan.limits.max_draft_len} tokens",
        "why:",
        *(f"  - {r}" for r in plan.reasons),
    ]
    if plan.notes:
        lines += ["notes:", *(f"  - {n}" for n in plan.notes)]
    return "\n".join(lines)


def _short(source: str, width: int = 40) -> str:
    return source if len(source) <= width else "..." + source[-(width - 3):]
