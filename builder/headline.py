"""The headline figures: one flat JSON object in ``benchmarks/results/headline.json``.

Every bench run that measures one of the figures an issue names writes it here through
:func:`update_headline` (read, merge, write atomically under a file lock), so the README can
cite one file and no figure is ever typed in by hand.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

HEADLINE_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "headline.json"


def read_headline(path: Path = HEADLINE_PATH) -> dict[str, float | int | str]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold one flat JSON object")
    return data


def update_headline(figures: Mapping[str, float | int | str], path: Path = HEADLINE_PATH) -> dict:
    """Merge ``figures`` (flat: numbers or strings) into the headline file; returns the result."""
    for key, value in figures.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"headline keys must be non-empty strings, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"headline figure {key!r} must be a number or a string, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"headline figure {key!r} is not finite: {value!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_headline(path)
        data.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")
        os.replace(tmp, path)
    logger.info("headline figures updated in %s: %s", path, ", ".join(sorted(figures)))
    return data


def device_keys(figures: dict[str, float], device: str) -> dict[str, float]:
    """Headline keys as a run on ``device`` writes them: a CUDA run's carry the ``gpu_`` prefix, so
    one headline file holds the CPU and GPU figures of the same measure side by side."""
    return figures if str(device).startswith("cpu") else {f"gpu_{k}": v for k, v in figures.items()}


__all__ = ["HEADLINE_PATH", "device_keys", "read_headline", "update_headline"]
