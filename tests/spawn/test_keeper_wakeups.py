"""The keeper off the start path (issue 41, decision 0090): it is not woken by each
child's start and exit, and it still learns every child before it kills, when the parent
dies right after sending.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap

from tests._run import REPO, run_python
from tests.spawn._descendants import TIMEOUT

_WAKE_UPS = textwrap.dedent("""
    import os
    import subprocess
    import time

    import anyio

    import aiomp
    from aiomp._process import groups

    def noop(rank):
        pass

    def keeper():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != "aiomp-keeper":
                        continue
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                        if f"Pid:\\t{os.getpid()}\\n" in f.read():
                            return int(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        return None

    def wake_ups(pid):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])

    async def main():
        async with aiomp.spawn(noop, 1, start_method="fork"):
            pass
        with anyio.fail_after(30):
            while (pid := keeper()) is None:
                await anyio.sleep(0.02)  # handshake-free: the keeper says nothing when up
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        pidfd = os.pidfd_open(child.pid)
        await anyio.sleep(0.3)  # handshake-free: let the keeper settle into its wait
        before, t0 = wake_ups(pid), time.monotonic()
        for _ in range(100):  # what 100 children's starts and exits send it
            groups.register(child.pid, pidfd)
            groups.unregister(child.pid)
            time.sleep(0.002)  # handshake-free: each message after the keeper slept again
        elapsed = time.monotonic() - t0
        print("wake-ups:", wake_ups(pid) - before, "allowed:", int(elapsed / 0.05) + 4)
        child.kill()
        child.wait()
        os.close(pidfd)

    if __name__ == "__main__":
        anyio.run(main)
""")


def test_the_keeper_is_not_woken_by_each_message() -> None:
    """Regression (issue 41, decision 0090): the keeper polled its socket, so every child
    start (``+pid``) and exit (``-pid``) woke its interpreter, two wake-ups per child on
    the parent's start path, which on a busy two-core host cost ``aiomp.spawn`` about
    17 ms of CPU per four children. It now wakes by its own clock (every 50 ms while
    messages come): at most one wake-up per 50 ms of the burst, not one per message."""
    out = run_python("-c", _WAKE_UPS, timeout=TIMEOUT * 2)
    line = out.stdout.split("wake-ups:")[1].split()
    assert int(line[0]) <= int(line[2]), out.stdout


_DIES_AFTER_SENDING = textwrap.dedent("""
    import os
    import signal
    import subprocess

    from aiomp._process import groups

    # What is registered: a process leading a group of its own, as a child does.
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    print(child.pid, flush=True)
    groups.start_keeper()
    groups.register(child.pid, os.pidfd_open(child.pid))
    os.kill(os.getpid(), signal.SIGKILL)  # at once: the keeper has not read the message
""")


def test_a_parent_killed_right_after_registering_still_takes_the_group() -> None:
    """The keeper reads its socket by its clock (decision 0090): a parent SIGKILLed right
    after a child's ``+pid`` (before the keeper's next read, or before its interpreter
    is even up) must still have that child's group killed: the keeper reads every
    message waiting before it kills."""
    proc = subprocess.run(
        [sys.executable, "-c", _DIES_AFTER_SENDING],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    pid = int(proc.stdout.split()[0])
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        assert select.select([pidfd], [], [], TIMEOUT)[0], "the group outlived its parent"
    finally:
        os.close(pidfd)
