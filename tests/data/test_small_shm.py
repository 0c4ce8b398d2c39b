"""aiomp.DataLoader with a small /dev/shm (issue 27; torch's "Bus error" in Docker,
pytorch/pytorch#5040): 32 MiB batches through a 16 MiB /dev/shm."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests._run import REPO


def test_batches_larger_than_dev_shm() -> None:
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=16m tmpfs /dev/shm"],
        capture_output=True,
        check=False,
    )
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip("needs unshare -m and mount (root in the test's container)")
    script = (
        f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} -m tests.children.data"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "ok", proc.stderr
