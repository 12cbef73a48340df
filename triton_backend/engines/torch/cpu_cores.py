"""How many CPU threads this process may usefully run: the cores its affinity mask allows, capped
by a cgroup CPU quota (a container started with ``--cpus 1`` or a Kubernetes CPU limit still sees
every core of the host in its affinity mask; threads past the quota are throttled, and a row
kernel helper that waits for a throttled peer stalls the pass)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def quota_cores(root: Path = CGROUP) -> float | None:
    """The cgroup CPU quota in cores (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None when there is none or it cannot be read."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        for folder in (root / "cpu", root / "cpu,cpuacct"):
            if (folder / "cpu.cfs_quota_us").is_file():
                quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                period_us = int((folder / "cpu.cfs_period_us").read_text())
                return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None


def usable_cores(limit: int = 8, root: Path = CGROUP) -> int:
    """The cores this process may run on (affinity), capped by the cgroup quota (rounded up) and ``limit``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = quota_cores(root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return max(1, min(limit, cores))


__all__ = ["quota_cores", "usable_cores"]
