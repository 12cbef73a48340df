"""The target's pass costs: what one ragged target pass costs, in one-row one-token decode steps.

:class:`PassCostModel` is the table the gain rule (:mod:`~triton_backend.speculation.round_plan`)
prices every draft with. A deployment measures its target's table at load
(:func:`~triton_backend.speculation.pass_cost.install_measured_cost_model`), which records it
against that engine here; a request reads its target's table once, when it starts
(:func:`current_cost_model`), and hands it to every decision of its rounds. An engine nothing
was measured for decides from :data:`DEFAULT_COST_TABLE`.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# Passes on one row: the CPU runtime's prepacked 8-row GEMMs (benchmarks/results/pass-cost-cpu.md);
# several rows: the batch figures of DESIGN.md. Replaced by a measurement where one exists.
DEFAULT_COST_TABLE: dict[int, dict[int, float]] = {
    1: {1: 1.0, 2: 1.21, 3: 1.24, 4: 1.33, 8: 1.35, 9: 2.05, 16: 2.1},
    4: {1: 1.59, 4: 2.84},
    8: {1: 2.03, 4: 4.59},
    16: {1: 3.41, 4: 8.15},
}


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted ``points``; past the last point, proportional to ``x``."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    last_x, last_y = points[-1]
    return last_y * x / last_x


def _non_decreasing(curve: Mapping[int, float]) -> dict[int, float]:
    """A measured curve made non-decreasing in tokens: a cell below a cell of fewer tokens is
    timing noise (a pass never costs less for carrying more tokens) and takes its value; the
    one-token point, the unit, stays."""
    out: dict[int, float] = {}
    top = 0.0
    for tokens, value in sorted(curve.items()):
        top = out[tokens] = max(top, value)
    return out


@dataclass(frozen=True)
class PassCostModel:
    """Cost of one target pass, in units of one 1-row-1-token decode step.

    ``table[rows][tokens_per_row]``: measured points. A ragged pass is looked up by its row
    count and mean tokens per row, interpolated linearly between measured points (beyond the
    table: proportional to the tokens, or to the rows).
    """

    table: Mapping[int, Mapping[int, float]]
    source: str = "default"

    def __post_init__(self) -> None:
        if 1 not in self.table or 1 not in self.table[1]:
            raise ValueError("a pass-cost table needs the 1-row 1-token step")
        for rows, curve in self.table.items():
            if rows < 1 or not curve or min(curve) < 1 or any(not (c > 0) for c in curve.values()):
                raise ValueError(f"bad pass-cost table entry for {rows} rows: {dict(curve)}")
        # sorted once (a decision looks the table up a few dozen times)
        object.__setattr__(self, "_curves", {rows: tuple(sorted(curve.items())) for rows, curve in self.table.items()})
        object.__setattr__(self, "_rows", tuple(sorted(self.table)))

    @classmethod
    def default(cls) -> "PassCostModel":
        return cls(DEFAULT_COST_TABLE, "default")

    @classmethod
    def from_measurements(cls, seconds: Mapping[tuple[int, int], float], source: str = "measured") -> "PassCostModel":
        """From median seconds per pass keyed by ``(rows, tokens_per_row)``; normalised by (1, 1)."""
        if (1, 1) not in seconds or not seconds[(1, 1)] > 0:
            raise ValueError("measurements need the 1-row 1-token step")
        step = seconds[(1, 1)]
        table: dict[int, dict[int, float]] = {}
        for (rows, tokens), value in sorted(seconds.items()):
            table.setdefault(rows, {})[tokens] = max(value / step, 1e-3)
        return cls({rows: _non_decreasing(curve) for rows, curve in table.items()}, source)

    def _curve_cost(self, rows: int, tokens: float) -> float:
        return _interpolate(self._curves[rows], tokens)

    def pass_cost(self, tokens_per_row: Sequence[int]) -> float:
        """One ragged pass whose rows carry ``tokens_per_row`` new tokens each."""
        rows = len(tokens_per_row)
        if rows == 0:
            return 0.0
        mean = sum(tokens_per_row) / rows
        known = self._rows
        lower = max((r for r in known if r <= rows), default=known[0])
        upper = min((r for r in known if r >= rows), default=None)
        if upper is None:  # more rows than measured: proportional to the rows
            return self._curve_cost(lower, mean) * rows / lower
        if upper == lower:
            return self._curve_cost(lower, mean)
        c0, c1 = self._curve_cost(lower, mean), self._curve_cost(upper, mean)
        return c0 + (c1 - c0) * (rows - lower) / (upper - lower)

    def to_json(self) -> dict:
        table = {str(r): {str(t): c for t, c in curve.items()} for r, curve in self.table.items()}
        return {"source": self.source, "table": table}

    @classmethod
    def from_json(cls, data: Mapping) -> "PassCostModel":
        table = {int(r): {int(t): float(c) for t, c in curve.items()} for r, curve in data["table"].items()}
        return cls(table, str(data.get("source", "cached")))


_DEFAULT_MODEL = PassCostModel.default()


class MeasuredCostModels:
    """The pass costs measured for each target engine of this process, held as long as the engine lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[int, tuple[weakref.ref, PassCostModel]] = {}

    def record(self, engine: Any, model: PassCostModel) -> None:
        key = id(engine)
        try:
            ref = weakref.ref(engine, lambda _: self._forget(key))
        except TypeError:  # an engine without weak references: held for the process
            ref = lambda: engine  # noqa: E731
        with self._lock:
            self._models[key] = (ref, model)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._models.pop(key, None)

    def of(self, engine: Any) -> PassCostModel | None:
        with self._lock:
            found = self._models.get(id(engine))
        if found is None or found[0]() is not engine:
            return None
        return found[1]

    def snapshot(self) -> dict[int, tuple[weakref.ref, PassCostModel]]:
        with self._lock:
            return dict(self._models)

    def restore(self, snapshot: Mapping[int, tuple[weakref.ref, PassCostModel]]) -> None:
        """Back to a :meth:`snapshot` (tests that script decisions from the default table)."""
        with self._lock:
            self._models = dict(snapshot)

    def clear(self) -> None:
        with self._lock:
            self._models.clear()


MEASURED = MeasuredCostModels()


def current_cost_model(engine: Any = None) -> PassCostModel:
    """The pass costs a request on ``engine`` decides from: the table measured for it at load,
    else the default table (also for ``engine`` None)."""
    measured = MEASURED.of(engine) if engine is not None else None
    return measured if measured is not None else _DEFAULT_MODEL


__all__ = ["DEFAULT_COST_TABLE", "MEASURED", "MeasuredCostModels", "PassCostModel", "current_cost_model"]
