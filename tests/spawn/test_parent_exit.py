"""Spawning: the parent's exit: a double SIGINT, the interpreter's exit, the terminate
grace period, a SIGKILLed parent's children.

How children are met and bounded: see ``tests/spawn/test_results.py``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common as funcs
from tests.spawn._spawns import METHODS, TIMEOUT, exitcodes

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")

REPO = Path(__file__).resolve().parents[2]


_DOUBLE_SIGINT_PARENT = textwrap.dedent("""
    import asyncio
    import signal
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    # As run from a terminal: a test run started in the background inherits SIGINT
    # ignored, and then neither asyncio nor trio would install its Ctrl-C handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def main():
        address = "\\0" + sys.argv[1]  # abstract socket: argv cannot hold the NUL
        async with aiomp.spawn(_funcs.ignore_sigterm_then_block, 2, args=(address,),
                               grace_period=float(sys.argv[3])):
            await anyio.sleep_forever()

    if __name__ == "__main__":
        if sys.argv[2] == "trio":
            import trio

            trio.run(main)
        else:
            factory = None
            if sys.argv[2] == "uvloop":
                import uvloop

                factory = uvloop.new_event_loop
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(main())
""")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_double_sigint_kills_children_and_exits(loop: str, gate: Gate) -> None:
    """Regression (issue 18.1): a second Ctrl-C during the grace period aborted the
    termination (under trio the KeyboardInterrupt was raised inside the wait); children
    that ignore SIGTERM were never killed and the parent hung at exit in multiprocessing's
    join of its non-daemon children. Now the second Ctrl-C means "SIGKILL now"."""
    grace = 2.0
    parent = subprocess.Popen(
        [sys.executable, "-c", _DOUBLE_SIGINT_PARENT, gate.address[1:], loop, str(grace)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    pidfds: list[int] = []
    try:
        pids = gate.ready_sync(2, timeout=TIMEOUT)
        pidfds = [os.pidfd_open(pid) for pid in pids.values()]
        start = time.monotonic()
        os.kill(parent.pid, signal.SIGINT)
        time.sleep(0.3)  # handshake-free: the user's second Ctrl-C comes a moment later
        os.kill(parent.pid, signal.SIGINT)
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        exited: set[int] = set()
        while len(exited) < len(pidfds) and time.monotonic() < start + grace + 1:
            exited.update(fd for fd, _ in poller.poll(50))
        assert len(exited) == 2, "children outlived a double Ctrl-C"
        _, err = parent.communicate(timeout=TIMEOUT)
        assert parent.returncode != 0
        assert "KeyboardInterrupt" in err
        assert err.count("via signal SIGKILL") == 2, err
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no orphans, even on failure
            except ProcessLookupError:
                pass
            os.close(fd)


_EXIT_WITH_CHILDREN = textwrap.dedent("""
    import signal
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as run from a terminal

    async def main():
        address = "\\0" + sys.argv[1]
        await aiomp.spawn(_funcs.ignore_sigterm_then_block, 1, args=(address,),
                          daemon=sys.argv[2] == "daemon")
        await anyio.sleep_forever()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("daemon", ["daemon", "non-daemon"])
def test_interpreter_exit_never_waits_on_children(daemon: str, gate: Gate) -> None:
    """Issue 18.1: multiprocessing's exit hook joins non-daemon children (and SIGTERMs,
    then joins, daemon ones) without a timeout, so a child left running (here: one that
    ignores SIGTERM, never joined) hung interpreter exit forever. aiomp's own hook, which
    runs first, SIGKILLs and reaps it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _EXIT_WITH_CHILDREN, gate.address[1:], daemon],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    pidfd = -1
    try:
        pid = gate.ready_sync(1, timeout=TIMEOUT)[0]
        pidfd = os.pidfd_open(pid)
        os.kill(parent.pid, signal.SIGINT)  # anyio.run: KeyboardInterrupt, then exit
        _, err = parent.communicate(timeout=TIMEOUT)
        assert select.select([pidfd], [], [], 0)[0], "the child outlived its parent"
        assert "still running at interpreter exit" in err
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        if pidfd >= 0:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(pidfd)


@pytest.mark.anyio
async def test_terminate_grace_period_argument(gate: Gate) -> None:
    """``terminate(grace_period=...)`` overrides the context's own (30 s here)."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.ignore_sigterm_then_block, 1, args=(gate.address,), grace_period=30
        )
        try:
            await gate.ready(1)
        finally:
            start = time.monotonic()
            await ctx.terminate(grace_period=0.2)
        elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 5
    assert exitcodes(ctx) == [-signal.SIGKILL]


# -- parent death (R8) ---------------------------------------------------------------------

_PARENT = textwrap.dedent("""
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    async def main():
        address = "\\0" + sys.argv[1]  # abstract socket: argv cannot hold the NUL
        ctx = await aiomp.spawn(_funcs.ready_then_block, 2, args=(address,),
                                start_method=sys.argv[2])
        await ctx.join()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("start_method", METHODS)
def test_children_die_with_a_sigkilled_parent(start_method: str, gate: Gate) -> None:
    """R8. Regression (forkserver): each child held the fork server's "alive" pipe, so the
    server, the child's real parent, outlived ours and no death signal came."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, gate.address[1:], start_method], cwd=REPO
    )
    pidfds: list[int] = []
    try:
        pids = gate.ready_sync(2, timeout=TIMEOUT)
        # pidfds work for processes that are not our children, and their readiness is the
        # exit: no /proc polling. Opened while the parent lives, so the pids are not reused.
        pidfds = [os.pidfd_open(pid) for pid in pids.values()]
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=TIMEOUT) == -signal.SIGKILL
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + 5
        exited: set[int] = set()
        while len(exited) < len(pidfds) and time.monotonic() < deadline:
            exited.update(fd for fd, _ in poller.poll(100))
        assert len(exited) == 2, "children outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no orphans, even on failure
            except ProcessLookupError:
                pass
            os.close(fd)
