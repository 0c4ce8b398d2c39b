"""How many CPUs this process may use: the affinity mask, capped by a cgroup CPU quota.

A container limited to 2 CPUs on a 64-core host sees 64 in its affinity mask; only the
cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``) says 2.
The quota of the process's own group and of each ancestor up to the hierarchy's mount
counts: the smallest one caps. Owns nothing; read on each call (a process may be moved).
Paths are strings (``os.path``): ``run_sync``'s first call reads this, and ``pathlib``
would be one more import on its way (decision 0046).
"""

from __future__ import annotations

import math
import os

PathLike = str | os.PathLike[str]


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
    try:
        groups = _read(os.path.join(proc, "cgroup"))
        mounts = _read(os.path.join(proc, "mountinfo"))
    except OSError:
        return None
    quotas = [q for q in _quotas(groups, mounts, root) if q is not None]
    return min(quotas, default=None)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _quotas(groups: str, mounts: str, root: PathLike) -> list[float | None]:
    found: list[float | None] = []
    for line in groups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy or not path:
            continue
        if hierarchy == "0" and controllers == "":
            version, read = "cgroup2", _v2_quota
        elif "cpu" in controllers.split(","):
            version, read = "cpu", _v1_quota
        else:
            continue
        mount = _mount(mounts, version)
        if mount is None:
            continue
        mount_root, mount_point = mount
        found.extend(read(d) for d in _group_dirs(root, mount_point, mount_root, path))
    return found


def _mount(mounts: str, version: str) -> tuple[str, str] | None:
    """``(root, mount point)`` of the cgroup2 hierarchy, or of the v1 hierarchy with the
    ``cpu`` controller (``version == "cpu"``), from ``/proc/self/mountinfo``."""
    for line in mounts.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if version == "cgroup2" and fstype == "cgroup2":
            return fields[3], fields[4]
        if version == "cpu" and fstype == "cgroup" and "cpu" in options:
            return fields[3], fields[4]
    return None


def _group_dirs(root: PathLike, mount_point: str, mount_root: str, path: str) -> list[str]:
    """The group's directory and its ancestors' up to the mount point. A path under the
    mount's own root (v1 without a cgroup namespace: ``/docker/abc`` mounted as ``/``)
    is made relative to it; ancestors above the mount cannot be seen."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :]
    parts = [p for p in path.split("/") if p and p != ".."]
    base = os.path.join(root, mount_point.lstrip("/"))
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(group: str) -> float | None:
    try:
        quota, period = _read(os.path.join(group, "cpu.max")).split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(group: str) -> float | None:
    try:
        quota = int(_read(os.path.join(group, "cpu.cfs_quota_us")))
        period = int(_read(os.path.join(group, "cpu.cfs_period_us")))
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
