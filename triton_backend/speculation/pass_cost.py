"""A short measurement of a batched engine's pass costs at load, cached per machine.

Through the batched engine contract (:mod:`triton_backend.engines.batch`): scratch slots
are allocated, given a short context, then passes of ``rows x tokens`` new tokens are timed
on top of it (each pass starts at the same position: rollback by start position), cheapest
cells first, each in turn with the 1-token step (its cost is its ratio to the step timed beside
it), in two sweeps while the time budget lasts. The result is cached as JSON under
``$SPECBUILD_CACHE_DIR/pass_cost/`` keyed by model, runtime settings and CPU model, so only
the first load on a machine pays for it.

An EAGLE drafter's cost per drafted token is measured the same way (:func:`install_measured_draft_costs`):
a round's drafting (the target's features of two committed positions fed, then a chain of
``DRAFT_K`` tokens) timed against the target's 1-row 1-token step, interleaved, and cached
beside the pass costs. Its parameter ratio (0.066 of a step for the reference drafter)
understates it: the drafter's small matmuls, attention and per-token bookkeeping cost far
more per parameter than the target's pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from triton_backend.core.reference_model import cache_dir as default_cache_dir
from triton_backend.core.runtime_config import RuntimeConfig
from triton_backend.engines.batch import BatchedEngine, BatchRow, SlotsExhaustedError
from triton_backend.speculation.cost_model import MEASURED, PassCostModel

logger = logging.getLogger(__name__)
T = TypeVar("T")

# measured in this order until the budget is spent: one row's curve first (what a lone
# request's decision needs), then batches of decode rows and of verify rows
CELLS = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 9), (1, 12), (1, 13), (1, 3), (1, 6), (1, 16), (4, 1), (8, 1), (4, 4), (8, 4),
         (2, 1), (2, 4), (16, 1), (16, 4))
CONTEXT = 48
REPEATS = 5  # the fastest of 5: one-row cells 4 tokens apart differ by a few percent, timing noise by as much
SWEEPS = 2
WARMUP = 3
STABLE = 0.5  # the fastest 1-token steps of the measurement's two halves must agree within this fraction
METHOD = 5  # part of the cache key: tables measured another way are measured again


def runtime_settings(runtime: RuntimeConfig) -> str:
    """The runtime settings a measured cost is cached under (``settings`` of the calls here). The
    EAGLE drafter's weight precision leaves the target's passes as they are (a drafter's cost is
    keyed by its own identity, which names it), so it is left out: changing it does not measure
    the pass costs again."""
    return repr(dataclasses.replace(runtime, drafter_weights=None))


def machine_key(model: str, settings: str) -> str:
    """Cache key of a pass-cost measurement: model, runtime settings and this machine's CPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    raw = json.dumps({"model": model, "settings": settings, "cpu": cpu, "cpus": os.cpu_count(), "method": METHOD},
                     sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


class NoisyMeasurementError(RuntimeError):
    """The machine was too busy (or too slow for the budget) to measure pass costs."""


def _cache_path(cache_dir: Path | None, engine: Any, settings: str) -> Path:
    root = cache_dir if cache_dir is not None else default_cache_dir()
    kernel = getattr(engine, "kernel_name", "")  # a changed matmul kernel has other costs: measured anew
    return root / "pass_cost" / f"{machine_key(str(engine.name), settings + kernel)}.json"


def _read_cache(path: Path, parse: Callable[[dict], T]) -> T | None:
    """A cached measurement parsed, or None when there is none; an unreadable one is logged and
    measured anew."""
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the unreadable measurement cache %s: %s", path, exc)
        return None


def _write_cache(path: Path, data: dict) -> None:
    """A read-only cache (an image's baked-in cache, a locked-down host) only costs the next load a re-measure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        logger.warning("measured but not cached (%s: %s)", path, exc)


def machine_busy(cores: int | None = None) -> float | None:
    """The 1-minute load average when other work held this machine's cores over the last minute
    (more runnable threads than ``cores`` less half a core, at least 1): a measurement taken now
    is used by this process but not cached, so the next load on a quieter machine measures again
    (the row kernel's multi-token passes share both cores with whatever else runs). None: quiet enough."""
    from triton_backend.engines.torch.cpu_cores import usable_cores

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = usable_cores(64) if cores is None else cores
    return load if load > max(1.0, cores - 0.5) else None


# Set (to 1) where every process on the machine must decide from one measurement, busy or not: a
# harness comparing a server with an in-process reference of the same deployment. Left unset, a
# busy machine's measurement is used by the process that took it and measured again by the next.
CACHE_BUSY_ENV = "SPECBUILD_CACHE_BUSY_MEASUREMENTS"


def _cache_unless_busy(path: Path, data: dict, busy: float | None, what: str) -> None:
    """Cache a measurement, unless the machine was busy when it was taken (:func:`machine_busy`)
    and :data:`CACHE_BUSY_ENV` does not ask for it all the same."""
    keep = busy is None or os.environ.get(CACHE_BUSY_ENV) == "1"
    if busy is not None:
        logger.warning("%s measured on a busy machine (load average %.1f): %s", what, busy,
                       f"cached all the same ({CACHE_BUSY_ENV}=1)" if keep else "used now, not cached")
    if keep:
        _write_cache(path, data)


def _allocate(engine: Any, want: int) -> list[int]:
    slots: list[int] = []
    try:
        while len(slots) < want:
            slots.append(engine.allocate())
    except SlotsExhaustedError:
        pass
    return slots


def _time_pass(engine: Any, slots: list[int], tokens: int) -> float:
    rows = [BatchRow(slot=s, start=CONTEXT, tokens=[(11 * (i + j) + 7) % engine.vocab_size for j in range(tokens)],
                     num_logits=tokens) for i, s in enumerate(slots)]
    start = time.perf_counter()
    engine.forward(rows)
    return time.perf_counter() - start


def _fastest_in_turn(first: Callable[[], float], second: Callable[[], float], *, warmup: int = WARMUP,
                     repeats: int = 2 * REPEATS) -> tuple[float, float]:
    """The fastest of ``repeats`` timings of each after ``warmup`` rounds, the two timed in turn
    (a busy machine slows both alike)."""
    a, b = [], []
    for i in range(warmup + repeats):
        x, y = first(), second()
        if i >= warmup:
            a.append(x)
            b.append(y)
    return min(a), min(b)


def measure_seconds(engine: Any, budget_s: float = 8.0) -> dict[tuple[int, int], float]:
    """Seconds per pass for ``(rows, tokens_per_row)`` cells in :data:`CELLS` order, within the
    budget: up to :data:`SWEEPS` sweeps over the cells, each cell timed in turn with the 1-row
    1-token step (:data:`REPEATS` of each, the fastest kept: robust to a busy machine's spikes).
    A cell's cost is its ratio to the step timed beside it, the lowest of the sweeps', so a
    machine whose speed drifts while measuring (a shared VM) still gives the right ratios, and a
    busy spell (which slows a multi-token pass on two cores more than the memory-bound step)
    inflates no cell; returned as that ratio times the fastest step."""
    slots = _allocate(engine, min(max(r for r, _ in CELLS), int(engine.num_slots)))
    if not slots:
        raise SlotsExhaustedError("no free slot to measure pass costs on")
    try:
        context = [(13 * i + 5) % engine.vocab_size for i in range(CONTEXT)]
        deadline = time.perf_counter() + budget_s
        engine.forward([BatchRow(slot=s, start=0, tokens=context) for s in slots])
        for _ in range(WARMUP):
            _time_pass(engine, slots[:1], 1)
        cells = [(r, t) for r, t in CELLS if r <= len(slots) and (r, t) != (1, 1)]
        ratios: dict[tuple[int, int], list[float]] = {}
        steps: list[float] = []
        for _ in range(SWEEPS):
            for rows, tokens in cells:
                if time.perf_counter() > deadline and ratios:  # the first cell is always measured
                    break
                step, cell = _fastest_in_turn(lambda: _time_pass(engine, slots[:1], 1),
                                              lambda: _time_pass(engine, slots[:rows], tokens), warmup=0,
                                              repeats=REPEATS)
                steps.append(step)
                ratios.setdefault((rows, tokens), []).append(cell / step)
        early, late = min(steps[:max(1, len(steps) // 2)]), min(steps[len(steps) // 2:])
        if max(early, late) / min(early, late) > 1 + STABLE:  # the fastest step of each half: jitter aside
            raise NoisyMeasurementError(f"the 1-token step moved from {early * 1e3:.1f} ms to {late * 1e3:.1f} ms "
                                        "while measuring (a busy machine)")
        step = min(steps)
        return {(1, 1): step, **{cell: step * min(r) for cell, r in ratios.items()}}
    finally:
        for slot in slots:
            engine.release(slot)


def _check(seconds: dict[tuple[int, int], float]) -> None:
    """Plausible and complete enough to decide from: the whole one-row curve, and no pass much
    dearer than decoding its tokens one at a time."""
    missing = [t for r, t in CELLS if r == 1 and (1, t) not in seconds]
    if missing:
        raise NoisyMeasurementError(f"the budget ran out before the one-row curve was measured (missing {missing})")
    step = seconds[(1, 1)]
    bad = [cell for cell, value in seconds.items() if not 0.8 <= value / step <= 1.25 * cell[0] * cell[1]]
    if bad:
        raise NoisyMeasurementError(f"implausible pass costs for {bad} (a busy machine)")


def install_measured_cost_model(engine: Any, settings: str, budget_s: float = 8.0,
                                cache_dir: Path | None = None) -> PassCostModel | None:
    """At load: measure (or read the cached) pass costs of a batched engine and record them as
    that engine's (:func:`~triton_backend.speculation.cost_model.current_cost_model`: what its
    requests decide from); engines outside the batched contract keep the default table."""
    if not isinstance(engine, BatchedEngine):
        return None
    model = measure_pass_cost_model(engine, settings=settings, cache_dir=cache_dir, budget_s=budget_s)
    MEASURED.record(engine, model)
    return model


def measure_pass_cost_model(engine: Any, *, settings: str = "", cache_dir: Path | None = None,
                            budget_s: float = 8.0) -> PassCostModel:
    """Measure (or read this machine's cached measurement of) ``engine``'s pass costs; the
    default table when the machine is too busy to measure."""
    path = _cache_path(cache_dir, engine, settings)
    cached = _read_cache(path, PassCostModel.from_json)
    if cached is not None:
        return cached
    busy = machine_busy()
    started = time.perf_counter()
    try:
        seconds = measure_seconds(engine, budget_s)
        _check(seconds)
    except NoisyMeasurementError as exc:
        logger.warning("pass costs of %s not measured (%s); deciding from the default table", engine.name, exc)
        return PassCostModel.default()
    measured = PassCostModel.from_measurements(seconds, source=f"measured:{engine.name}")
    # row counts the budget left out keep the default table's curves
    table = {rows: dict(curve) for rows, curve in PassCostModel.default().table.items() if rows not in measured.table}
    model = PassCostModel({**table, **{r: dict(c) for r, c in measured.table.items()}}, measured.source)
    logger.info("pass costs of %s measured in %.1f s: %s", engine.name, time.perf_counter() - started, model.to_json()["table"])
    _cache_unless_busy(path, model.to_json(), busy, f"pass costs of {engine.name}")
    return model


# -- an EAGLE drafter's cost per drafted token --------------------------------------------------
DRAFT_K = 4  # drafted tokens a timed round chains
NEW_PAIRS = 2  # target features a round hands the drafter (the accepted drafts and the bonus token's root)
MAX_DRAFT_COST = 3.0  # per drafted token, in target steps: beyond it the measurement is not believed


def measure_eagle_draft_seconds(drafter: Any, engine: Any) -> tuple[float, float]:
    """(seconds per drafted token, seconds per 1-row 1-token target pass) of an
    :class:`~triton_backend.speculation.drafters.eagle.EagleDrafter` on ``engine``'s machine: the fastest of
    a few rounds each, the two timed in turn so a busy machine slows both alike."""
    import torch

    from triton_backend.core.sampling import LogitsProcessor

    slot = engine.allocate()
    try:
        context = [(13 * i + 5) % engine.vocab_size for i in range(CONTEXT)]
        engine.forward([BatchRow(slot=slot, start=0, tokens=context)])
        device = drafter.device
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(1, CONTEXT, int(drafter.feature_size), generator=generator).to(device, drafter.dtype)
        tokens = torch.tensor([context], dtype=torch.long, device=device)
        kv = drafter.new_cache(1, CONTEXT + NEW_PAIRS + DRAFT_K)
        greedy = [LogitsProcessor()]
        drafter.draft_chain(kv, torch.tensor([0], device=device), features, tokens,
                            torch.tensor([CONTEXT], device=device), 1, greedy, [None])  # the context, once
        start, count = torch.tensor([CONTEXT], device=device), torch.tensor([NEW_PAIRS], device=device)

        def one_round() -> float:  # each round drafts from the same position (rollback by start)
            t0 = time.perf_counter()
            drafter.draft_chain(kv, start, features[:, :NEW_PAIRS], tokens[:, :NEW_PAIRS], count, DRAFT_K, greedy, [None])
            return time.perf_counter() - t0

        draft, step = _fastest_in_turn(one_round, lambda: _time_pass(engine, [slot], 1))
        return draft / DRAFT_K, step
    finally:
        engine.release(slot)


def measured_eagle_draft_cost(drafter: Any, engine: Any, settings: str = "", cache_dir: Path | None = None) -> float | None:
    """The drafter's cost per drafted token in target steps: this machine's cached measurement,
    else measured now and cached; None when the measurement is not believable (a busy machine)."""
    return _cached_draft_cost(engine, settings, cache_dir, drafter.cost_identity(),
                              lambda: measure_eagle_draft_seconds(drafter, engine),
                              f"EAGLE drafter (parameter ratio {drafter.relative_cost:.3f})")


def _cached_draft_cost(engine: Any, settings: str, cache_dir: Path | None, identity: str,
                       measure: Callable[[], tuple[float, float]], what: str) -> float | None:
    """A drafted token's cost in target steps under ``identity``: the cached figure of this machine,
    else ``measure()`` (seconds per drafted token, per target step) now, cached when believable."""
    path = _cache_path(cache_dir, engine, settings + identity)
    cached = _read_cache(path, lambda data: float(data["draft_cost"]))
    if cached is not None:
        return cached
    busy = machine_busy()
    per_token, step = measure()
    cost = per_token / step
    if not 0.0 < cost <= MAX_DRAFT_COST:
        logger.warning("%s: a drafted token costing %.3f target steps is not believable; keeping the estimate",
                       what, cost)
        return None
    logger.info("%s on %s: %.3f target steps per drafted token (%.2f ms per token, %.2f ms per step)",
                what, engine.name, cost, 1e3 * per_token, 1e3 * step)
    _cache_unless_busy(path, {"draft_cost": cost, "per_token_s": per_token, "step_s": step,
                              "source": f"measured:{identity}"}, busy, what)
    return cost


# -- a draft model's step against the target's (the self draft) --------------------------------
def measure_step_seconds(draft: Any, engine: Any) -> tuple[float, float]:
    """(seconds per 1-row 1-token pass of ``draft``, the same of ``engine``), both batched engines
    on a short context: the fastest of a few each, timed in turn so a busy machine slows both alike."""
    slots = [(draft, draft.allocate())]
    try:
        slots.append((engine, engine.allocate()))
        for eng, slot in slots:
            eng.forward([BatchRow(slot=slot, start=0, tokens=[(13 * i + 5) % eng.vocab_size for i in range(CONTEXT)])])
        return _fastest_in_turn(lambda: _time_pass(draft, [slots[0][1]], 1), lambda: _time_pass(engine, [slots[1][1]], 1))
    finally:
        for eng, slot in slots:
            eng.release(slot)


def measured_step_cost(draft: Any, engine: Any, settings: str = "", cache_dir: Path | None = None) -> float | None:
    """A draft model's 1-token step in target steps (what one drafted token costs): this machine's
    cached measurement, else measured now and cached; None when either is outside the batched
    engine contract or the measurement is not believable (a busy machine)."""
    if not (isinstance(draft, BatchedEngine) and isinstance(engine, BatchedEngine)):
        return None
    try:
        return _cached_draft_cost(engine, settings, cache_dir, f"draft-step:{draft.name}:{getattr(draft, 'kernel_name', '')}",
                                  lambda: measure_step_seconds(draft, engine), f"draft {draft.name}")
    except SlotsExhaustedError:
        return None


def install_measured_draft_costs(target: Any, drafters: Mapping[Any, Any], settings: str = "",
                                 cache_dir: Path | None = None) -> None:
    """At load: each EAGLE drafter's ``relative_cost`` (what the gain rule prices a drafted
    token at) becomes its measured cost per drafted token on this machine. Other drafters, and
    targets outside the batched engine contract, keep their parameter ratios."""
    from triton_backend.speculation.drafters.eagle import FeatureDrafter

    if not isinstance(target, BatchedEngine):
        return
    for drafter in drafters.values():
        if isinstance(drafter, FeatureDrafter):
            try:
                cost = measured_eagle_draft_cost(drafter, target, settings, cache_dir)
            except SlotsExhaustedError:
                cost = None
            if cost is not None:
                drafter.relative_cost = cost


__all__ = ["CACHE_BUSY_ENV", "NoisyMeasurementError", "machine_busy", "machine_key", "runtime_settings", "install_measured_cost_model", "install_measured_draft_costs", "measure_eagle_draft_seconds",
           "measure_pass_cost_model", "measure_seconds", "measure_step_seconds", "measured_eagle_draft_cost",
           "measured_step_cost"]
