"""Where a worker's memory cgroup keeps its OOM-kill count (``aiomp._process.cgroups``),
from sample ``/proc/PID`` and ``/sys/fs/cgroup`` trees: the same hierarchy reading as the
CPU quota's (tests/process/test_cpus.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiomp._process import cgroups
from tests.process.test_cpus import V1_MOUNTS, V2_MOUNTS, _tree

_MEMORY = "/sys/fs/cgroup/memory"

#: (/proc/PID/cgroup, mountinfo, the files there, the OOM file expected, None: none)
OOM_FILES = {
    "v2": (
        "0::/kubepods/pod1\n",
        V2_MOUNTS,
        {"/sys/fs/cgroup/kubepods/pod1/memory.events": "oom_kill 0\n"},
        "/sys/fs/cgroup/kubepods/pod1/memory.events",
    ),
    "v1 first, where both are": (
        "12:memory:/job\n0::/job\n",
        V1_MOUNTS + V2_MOUNTS.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified "),
        {
            f"{_MEMORY}/job/memory.oom_control": "oom_kill 0\n",
            "/sys/fs/cgroup/unified/job/memory.events": "oom_kill 0\n",
        },
        f"{_MEMORY}/job/memory.oom_control",
    ),
    # A container without a cgroup namespace: its group's path repeats the mount's root.
    # (A fixed /sys/fs/cgroup/memory + path found nothing here.)
    "v1 under a mount root": (
        "12:memory:/docker/abc\n0::/\n",
        V1_MOUNTS.replace(" / /sys/fs/cgroup/memory", " /docker/abc /sys/fs/cgroup/memory"),
        {f"{_MEMORY}/memory.oom_control": "oom_kill 0\n"},
        f"{_MEMORY}/memory.oom_control",
    ),
    "none mounted": ("0::/g\n", "", {}, None),
}


@pytest.mark.parametrize("case", OOM_FILES)
def test_the_oom_file_from_sample_files(case: str, tmp_path: Path) -> None:
    cgroup, mounts, files, expected = OOM_FILES[case]
    root = _tree(tmp_path, cgroup, mounts, files)
    found = cgroups.oom_file(0, proc=root / "proc" / "self", root=root)
    assert found == (None if expected is None else str(root / expected.lstrip("/")))


def test_the_oom_kill_count(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroups.oom_kills(str(events)) == 2
    events.write_text("oom_kill many\n")
    assert cgroups.oom_kills(str(events)) is None
    assert cgroups.oom_kills(str(tmp_path / "gone")) is None
    assert cgroups.oom_kills(None) is None
