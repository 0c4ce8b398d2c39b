"""How many CPUs this process may use: the affinity mask, capped by a cgroup CPU quota.

A container limited to 2 CPUs on a 64-core host sees 64 in its affinity mask; only the
cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``) says 2.
The quota of the process's own group and of each ancestor up to the hierarchy's mount
counts: the smallest one caps (where they are: :mod:`aiomp._process.cgroups`). Owns
nothing; read on each call (a process may be moved).
"""

from __future__ import annotations

import math
import os

from .cgroups import PathLike, hierarchies, read


def cpu_count() -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup CPU quota
    rounded up, at least 1 (what ``run_sync`` and ``Pool(processes=None)`` start)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    return capped(affinity, cgroup_quota())


def capped(affinity: int, quota: float | None) -> int:
    """``affinity`` capped by ``quota`` CPUs (None: no quota), rounded up, at least 1."""
    if quota is not None:
        affinity = min(affinity, math.ceil(quota))
    return max(1, affinity)


def cgroup_quota(proc: PathLike = "/proc/self", root: PathLike = "/") -> float | None:
    """The smallest CPU quota (in CPUs) of this process's cgroup and its ancestors, v2 and
    v1 alike, or None where there is none. ``proc`` and ``root`` stand for ``/proc/self``
    and ``/`` (tests point them at sample files). Unreadable or garbled files count as no
    quota: a count that is too high is the old behaviour, never an error."""
    quotas = [
        quota
        for v2, dirs in hierarchies(proc, root, "cpu")
        for quota in map(_v2_quota if v2 else _v1_quota, dirs)
        if quota is not None
    ]
    return min(quotas, default=None)


def _v2_quota(group: str) -> float | None:
    try:
        quota, period = read(os.path.join(group, "cpu.max")).split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(group: str) -> float | None:
    try:
        quota = int(read(os.path.join(group, "cpu.cfs_quota_us")))
        period = int(read(os.path.join(group, "cpu.cfs_period_us")))
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
