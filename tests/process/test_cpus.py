"""The CPU count of ``run_sync`` and ``Pool(processes=None)`` (issue 29): the affinity
mask capped by the cgroup CPU quota of this process's group and its ancestors."""

from __future__ import annotations

import gc
import os
import uuid
from pathlib import Path

import pytest

import aiomp
from aiomp._process import cpus
from tests._run import run_python

V2_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A fake ``/proc/self`` and ``/sys/fs/cgroup`` under ``tmp_path``; returns the root."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _quota(root: Path) -> float | None:
    return cpus.cgroup_quota(proc=root / "proc" / "self", root=root)


#: cgroup v1 without a cgroup namespace: the group's path repeats the mount's root.
_V1_DOCKER_MOUNTS = V1_MOUNTS.replace(
    " / /sys/fs/cgroup/cpu,cpuacct", " /docker/abc /sys/fs/cgroup/cpu,cpuacct"
)
_V1 = "/sys/fs/cgroup/cpu,cpuacct"

#: (the process's /proc/self/cgroup, its mountinfo, the cgroup files, the quota in CPUs)
QUOTAS = {
    "v2 quota of the group": (
        "0::/kubepods/pod1\n",
        V2_MOUNTS,
        {
            "/sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
            "/sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
            "/sys/fs/cgroup/cpu.max": "max 100000\n",
        },
        1.5,
    ),
    "v2 an ancestor caps the group": (
        "0::/a/b/c\n",
        V2_MOUNTS,
        {
            "/sys/fs/cgroup/a/b/c/cpu.max": "max 100000\n",
            "/sys/fs/cgroup/a/b/cpu.max": "400000 100000\n",
            "/sys/fs/cgroup/a/cpu.max": "200000 50000\n",  # 4 CPUs
        },
        4.0,
    ),
    "v2 no quota": ("0::/\n", V2_MOUNTS, {"/sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
    "v1 quota and mount root": (
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        _V1_DOCKER_MOUNTS,
        {f"{_V1}/cpu.cfs_quota_us": "50000\n", f"{_V1}/cpu.cfs_period_us": "100000\n"},
        0.5,
    ),
    "v1 unlimited and ancestors": (
        "4:cpu,cpuacct:/slice/job\n",
        V1_MOUNTS,
        {
            f"{_V1}/slice/job/cpu.cfs_quota_us": "-1\n",
            f"{_V1}/slice/job/cpu.cfs_period_us": "100000\n",
            f"{_V1}/slice/cpu.cfs_quota_us": "300000\n",
            f"{_V1}/slice/cpu.cfs_period_us": "100000\n",
        },
        3.0,
    ),
}


@pytest.mark.parametrize("case", QUOTAS)
def test_the_quota_from_sample_files(case: str, tmp_path: Path) -> None:
    cgroup, mounts, files, expected = QUOTAS[case]
    root = _tree(tmp_path, cgroup, mounts, files)
    assert _quota(root) == expected


def test_missing_or_garbled_files_mean_no_quota(tmp_path: Path) -> None:
    assert cpus.cgroup_quota(proc=tmp_path / "nothing", root=tmp_path) is None
    root = _tree(tmp_path, "0::/g\n", V2_MOUNTS, {"/sys/fs/cgroup/g/cpu.max": "what\n"})
    assert _quota(root) is None


def test_count_rounds_up_and_is_at_least_one() -> None:
    assert cpus.capped(8, None) == 8
    assert cpus.capped(8, 1.5) == 2
    assert cpus.capped(8, 0.1) == 1
    assert cpus.capped(2, 64.0) == 2
    assert 1 <= cpus.cpu_count() <= len(os.sched_getaffinity(0))
    pool = aiomp.Pool()
    assert pool.processes == cpus.cpu_count()
    with pytest.warns(RuntimeWarning, match="never awaited or entered"):
        del pool  # made only to read its size: it says so, as a dropped coroutine would
        gc.collect()


def test_a_real_cgroup_quota_caps_the_count() -> None:
    """Makes a cgroup v1 ``cpu`` group (or a v2 one) with half a CPU and asks a child in it."""
    group = _make_group()
    try:
        program = (
            "import os, sys\n"
            f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "import aiomp\n"
            "from aiomp._process import cpus\n"
            "print(len(os.sched_getaffinity(0)), cpus.cpu_count(), aiomp.Pool().processes)\n"
        )
        out = run_python("-c", program).stdout.split()
        assert out[1:] == ["1", "1"], out
    finally:
        group.rmdir()


def _make_group() -> Path:
    name = f"aiomp-test-{uuid.uuid4().hex[:8]}"
    for base, files in (
        (Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000"}),
        (
            Path("/sys/fs/cgroup/cpu,cpuacct"),
            {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000"},
        ),
        (Path("/sys/fs/cgroup"), {"cpu.max": "50000 100000"}),
    ):
        group = base / name
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            for file, text in files.items():
                (group / file).write_text(text)
        except OSError:
            group.rmdir()
            continue
        return group
    pytest.skip("this machine does not let the test make a cgroup with a CPU quota")
