"""Where a process's cgroups are, and what the parent reads there: the directories of
its group and of each ancestor (v2's hierarchy, and each v1 hierarchy holding a given
controller), from ``/proc/PID/cgroup`` and ``/proc/PID/mountinfo``.

Two readers: the CPU quota (:mod:`aiomp._process.cpus`) and a worker's OOM-kill count
(:class:`OomWatch`, see ``aiomp._pool.health``). Mountinfo, not a fixed ``/sys/fs/cgroup``
path, is what finds a v1 group whose path repeats its mount's root (a container without
a cgroup namespace: ``/docker/abc`` mounted as ``/``). Owns nothing; read on each call.
Paths are strings (``os.path``): ``run_sync``'s first call reads this, and ``pathlib``
would be one more import on its way (decision 0046).
"""

from __future__ import annotations

import os

PathLike = str | os.PathLike[str]


def hierarchies(proc: PathLike, root: PathLike, controller: str) -> list[tuple[bool, list[str]]]:
    """``(v2, directories)`` for the process ``proc`` stands for (``/proc/self``,
    ``/proc/PID``): cgroup v2's hierarchy (``v2`` True) and the v1 hierarchy holding
    ``controller``, as far as each is mounted; the directories of its group first, then
    each ancestor's up to the mount. ``root`` stands for ``/`` (tests point both at
    sample files). Unreadable files: none."""
    try:
        groups = read(os.path.join(proc, "cgroup"))
        mounts = read(os.path.join(proc, "mountinfo"))
    except OSError:
        return []
    found = []
    for line in groups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy or not path:
            continue
        v2 = hierarchy == "0" and controllers == ""
        if not (v2 or controller in controllers.split(",")):
            continue
        mount = _mount(mounts, None if v2 else controller)
        if mount is not None:
            found.append((v2, _group_dirs(root, mount[1], mount[0], path)))
    return found


def read(path: str) -> str:
    """The text of a cgroup file (OSError where it cannot be read)."""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _mount(mounts: str, controller: str | None) -> tuple[str, str] | None:
    """``(root, mount point)`` of the cgroup2 hierarchy (``controller`` None), or of the
    v1 hierarchy with ``controller``, from a mountinfo's text."""
    for line in mounts.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if controller is None and fstype == "cgroup2":
            return fields[3], fields[4]
        if controller is not None and fstype == "cgroup" and controller in options:
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


# -- OOM kills ------------------------------------------------------------------------------
def oom_file(pid: int, proc: PathLike | None = None, root: PathLike = "/") -> str | None:
    """The file holding the ``oom_kill`` count of ``pid``'s memory cgroup (v1's memory
    controller where mounted, else v2's), or None where there is none to read. ``proc``
    and ``root``: as for :func:`hierarchies`."""
    found = hierarchies(f"/proc/{pid}" if proc is None else proc, root, "memory")
    for v2, dirs in sorted(found, key=lambda h: h[0]):  # v1's memory controller first
        path = os.path.join(dirs[0], "memory.events" if v2 else "memory.oom_control")
        if os.path.exists(path):
            return path
    return None


def oom_kills(path: str | None) -> int | None:
    """The ``oom_kill`` count in ``path`` (None: unreadable)."""
    if path is None:
        return None
    try:
        for line in read(path).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


class OomWatch:
    """The parent's watch of one worker's memory cgroup: did its OOM-kill count rise?"""

    __slots__ = ("_before", "_path")

    def __init__(self, pid: int) -> None:
        self._path: str | None = None
        self._before: int | None = None
        self.look(pid)

    def look(self, pid: int) -> None:
        """Where ``pid`` is now and its count there: at its start, and once it is ready
        (its initializer may have moved it to a cgroup of its own)."""
        self._path = oom_file(pid)
        self._before = oom_kills(self._path)

    def rose(self) -> bool:
        """Whether the count has risen since :meth:`look`."""
        if self._before is None:
            return False
        now = oom_kills(self._path)
        return now is not None and now > self._before
