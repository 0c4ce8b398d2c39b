"""aiomp.DataLoader's faults and exits as torch's tests see them (issue 39 bugs 2 and 9):
a worker killed and reaped by the program, Ctrl-C in a sync loop, a normal exit under
load, a batch still held at the interpreter's exit. Each test names the torch test or
the bug whose behaviour it pins."""

from __future__ import annotations

import logging
import os
import pty
import select
import signal
import sys
import time

import pytest

import aiomp
from tests._run import REPO, run_python
from tests.children.data_compat import Slow, SlowExit

FS = "forkserver"


def test_a_worker_killed_and_reaped_by_the_program_does_not_hang_the_epoch() -> None:
    """Issue 39 bug 2 (torch: TestDataLoader's worker-kill tests, which SIGKILL a worker
    with psutil and wait() for it): a worker reaped by someone else left no status to
    read, and the epoch hung. Its batch is built again; the epoch is whole."""
    with aiomp.DataLoader(list(range(24)), 2, start_method="spawn") as loader:
        it = iter(loader)
        got = [list(next(it))]
        pid = loader.pool.pids()[0]
        os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)  # the program reaps it (the spawn parent is this process)
        except ChildProcessError:
            pass  # the loader's own watch reaped it first: the race this test plays
        got += [list(b) for b in it]
    assert got == [[2 * i, 2 * i + 1] for i in range(12)]


def test_a_normal_exit_with_a_worker_slow_to_exit_is_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 39 bug 9: leaving a loader normally under load printed "Terminating process
    ... via signal SIGTERM" for a worker slower to exit than the 5 s grace. torch's
    loader terminates such a worker silently after its 5 s join: so does the Pool, every
    task being done (a worker here keeps a thread running for 8 s)."""
    with caplog.at_level(logging.WARNING, logger="aiomp"):
        with aiomp.DataLoader(SlowExit(4, 8), 2, num_workers=1, start_method=FS) as loader:
            assert len(list(loader)) == 2
    assert not [r for r in caplog.records if "Terminating" in r.getMessage()]


def test_a_batch_held_by_a_global_at_exit_says_nothing() -> None:
    """Issue 39 bug 9: a script whose batch (a shared-memory block) was still a module
    global at exit printed "Exception ignored in ... Registry.drop_block" as the
    interpreter cleared the modules. The script prints nothing else."""
    code = (
        "import aiomp\n"
        "loader = aiomp.DataLoader(list(range(8)), 2, start_method='forkserver')\n"
        "if __name__ == '__main__':\n"
        "    for batch in loader:\n"
        "        break\n"
        "    print('done')\n"
    )
    proc = run_python("-c", code, timeout=120)
    assert proc.stdout == "done\n" and proc.stderr == ""


def test_ctrl_c_in_a_sync_loop_prints_only_the_keyboard_interrupt() -> None:
    """Issue 39 bug 9: Ctrl-C in a terminal (SIGINT to the foreground group, which aiomp
    passes on to its workers' groups) while a sync loop waits for batches: the program
    ends with KeyboardInterrupt's traceback alone (no worker started again, no
    "Terminating process" lines)."""
    code = (
        "import aiomp\n"
        "from tests.children.data_compat import Slow\n"
        "if __name__ == '__main__':\n"
        "    loader = aiomp.DataLoader(Slow(1000, 0.05), 2, start_method='forkserver')\n"
        "    for i, batch in enumerate(loader):\n"
        "        if i == 2:\n"
        "            print('ready', flush=True)\n"
    )
    out, status = _run_in_a_terminal(code, "ready", timeout=120)
    assert os.waitstatus_to_exitcode(status) in (1, -signal.SIGINT), out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1] == "KeyboardInterrupt", out
    assert "Terminating" not in out and "WARNING" not in out and "aiomp:" not in out, out
    assert Slow  # the dataset the script loads


def _run_in_a_terminal(code: str, ready: str, timeout: float) -> tuple[str, int]:
    """Run ``python -c code`` on a pseudo-terminal; once it prints ``ready``, type
    Ctrl-C. Its output, and its wait status."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the program, on the terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-c", code])
    out = b""
    deadline = time.monotonic() + timeout
    sent = False
    try:
        while time.monotonic() < deadline:
            if not sent and ready.encode() in out:
                os.write(fd, b"\x03")
                sent = True
            if not select.select([fd], [], [], 1)[0]:
                continue
            try:
                data = os.read(fd, 4096)
            except OSError:  # EIO: the program has exited, the terminal is closed
                break
            if not data:
                break
            out += data
    finally:
        os.close(fd)
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace").replace("\r\n", "\n"), status
