"""The keeper that takes a child's descendants with it (issue 25 item 5), at its edges:
Ctrl-C on the terminal, signals to a child's own group, tasks that reap every child, a
subreaper parent, a stopped or killed keeper, forks while it starts, a slow shell, a
deferred keeper that cannot start.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

import aiomp
import aiomp._process.groups
from tests._gate import Gate
from tests._run import REPO, run_python
from tests.children import groups as funcs
from tests.spawn._descendants import GRACE, METHODS, TIMEOUT, all_exit, watching_later

# -- the terminal -----------------------------------------------------------------------

_CTRL_C_PARENT = textwrap.dedent("""
    import signal
    import sys

    import anyio

    import aiomp
    from tests.children import groups as funcs

    # The parent lets the Ctrl-C pass, so that only the child's answer counts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main():
        ctx = await aiomp.spawn(funcs.ready_for_ctrl_c, 1, args=("\\0" + sys.argv[1],),
                                start_method=sys.argv[2])
        try:
            await ctx.join()
        except aiomp.ProcessRaisedException as exc:
            print("KeyboardInterrupt in the child" if "KeyboardInterrupt" in exc.msg else exc)

    if __name__ == "__main__":
        anyio.run(main)
""")

# Runs argv with the pty's slave as its controlling terminal (a session of its own whose
# group is the terminal's foreground group), as a shell runs a program.
_ON_TERMINAL = "import os, sys; os.login_tty(int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


@pytest.mark.parametrize("start_method", METHODS)
def test_ctrl_c_on_the_terminal_still_reaches_a_child(start_method: str, gate: Gate) -> None:
    """A child leads its own process group now, which a terminal's Ctrl-C does not reach;
    the parent's keeper stands in the terminal's foreground group and passes the SIGINT on: the
    child raises KeyboardInterrupt, as it did in its parent's group (R9, torch's
    behaviour). Run on a real pseudo-terminal; ``\\x03`` is the Ctrl-C."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _ON_TERMINAL,
            str(slave),
            sys.executable,
            "-c",
            _CTRL_C_PARENT,
            gate.address[1:],
            start_method,
        ],
        cwd=REPO,
        pass_fds=[slave],
    )
    os.close(slave)
    output = b""
    try:
        gate.ready_sync(1, timeout=TIMEOUT)
        os.write(master, b"\x03")
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # read until the terminal closes (EIO)
            if not select.select([master], [], [], deadline - time.monotonic())[0]:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        assert proc.wait(timeout=TIMEOUT) == 0, output
        assert b"KeyboardInterrupt in the child" in output, output
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- what the keeper must not do --------------------------------------------------------


@pytest.mark.anyio
async def test_a_signal_to_the_childs_own_group_leaves_the_keeper() -> None:
    """A task sends SIGUSR1 to its worker's whole group (everything it started ignores
    it): the group still ends with the worker. Regression (review of issue 25 item 5): a
    keeper per child stood in that group and died of it. The one keeper per parent stands
    in no child's group, and ignores such signals where it stands in the parent's."""
    with anyio.fail_after(TIMEOUT):
        with watching_later() as watch:
            async with aiomp.Pool(1, start_method="forkserver", grace_period=GRACE) as pool:
                fds = watch(await pool.apply(funcs.descendants_after_group_signal))
            await all_exit(fds)


@pytest.mark.anyio
async def test_a_task_that_reaps_every_child_finds_none_left() -> None:
    """A task that reaps its children until none is left (``os.wait()`` until
    ChildProcessError) must get there. Regression (review of issue 25 item 5): each child
    forked a keeper of its own, a child of the worker that exits only after it, which
    was always left. The one keeper per parent is nobody's child."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method="forkserver", grace_period=GRACE) as pool:
            assert await pool.apply(funcs.reaps_to_the_last_child) == "none left"


_SUBREAPER = textwrap.dedent("""
    import ctypes
    import os

    import anyio

    import aiomp

    def children():
        \"\"\"(state, name, command line) of each child of this process.\"\"\"
        out = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                for pid in f.read().split():
                    try:
                        with open(f"/proc/{pid}/stat") as stat:
                            fields = stat.read().rsplit(")", 1)
                        with open(f"/proc/{pid}/cmdline") as cmdline:
                            command = cmdline.read()
                    except FileNotFoundError:
                        continue
                    out.append((fields[1].split()[0], fields[0].split("(", 1)[1], command))
        return out

    async def main():
        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER, as PID 1 in a container
        async with aiomp.Pool(1, maxtasksperchild=1, start_method="forkserver") as pool:
            for _ in range(3):
                await pool.apply(os.getpid)
        # Three workers started and reaped: the keeper, nobody's child, is re-parented to
        # us (the nearest subreaper) as it starts, and lives as long as we do.
        # (A keeper names itself once it runs: until then, its command line tells.)
        keepers = [
            state
            for state, name, command in children()
            if name == "aiomp-keeper" or "aiomp/_process/groups.py" in command
        ]
        print("zombie keepers:", keepers.count("Z"), "keepers:", len(keepers))

    if __name__ == "__main__":
        anyio.run(main)
""")


def test_keepers_leave_no_zombies_in_a_subreaper_parent() -> None:
    """The parent is a subreaper (``PR_SET_CHILD_SUBREAPER``, or PID 1 in a container
    started without an init): processes orphaned below it become its children.
    Regression (review of issue 25 item 5): a keeper per child, orphaned when its child
    ended, stayed a zombie there for good, one per child started (a Pool with
    ``maxtasksperchild`` ran out of pids). The one keeper of the parent lives as long as
    the parent: one, and no zombie, however many workers came and went."""
    out = run_python("-c", _SUBREAPER, timeout=TIMEOUT * 2)
    assert "zombie keepers: 0 keepers: 1" in out.stdout, out.stdout


# -- the keeper stopped, killed, forked ---------------------------------------------------

_KEEPER_TOOLS = textwrap.dedent("""
    import os
    import signal
    import sys

    import anyio

    import aiomp

    def fds(pid):
        return len(os.listdir(f"/proc/{pid}/fd"))

    def watched_by_keeper(keeper):
        \"\"\"The pids the keeper holds a pidfd of (its parent's included).\"\"\"
        out = set()
        for fd in os.listdir(f"/proc/{keeper}/fd"):
            try:
                with open(f"/proc/{keeper}/fdinfo/{fd}") as f:
                    for line in f:
                        if line.startswith("Pid:"):
                            out.add(int(line.split()[1]))
            except FileNotFoundError:
                continue
        return out

    async def our_keeper(other=None):
        \"\"\"This process's keeper (not ``other``), once it runs and watches us.\"\"\"
        with anyio.fail_after(30):
            while True:
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        with open(f"/proc/{pid}/comm") as f:
                            if f.read().strip() != "aiomp-keeper" or int(pid) == other:
                                continue
                        if os.getpid() in watched_by_keeper(pid):
                            return int(pid)
                    except (FileNotFoundError, ProcessLookupError, PermissionError):
                        continue
                await anyio.sleep(0.02)  # handshake-free: the keeper says nothing when up
""")

_STOPPED_KEEPER = _KEEPER_TOOLS + textwrap.dedent("""
    async def main():
        async with aiomp.Pool(1, maxtasksperchild=1, start_method="fork") as pool:
            await pool.apply(os.getpid)
            keeper = await our_keeper()
            before = fds(os.getpid())
            os.kill(keeper, signal.SIGSTOP)
            try:
                for _ in range(300):
                    await pool.apply(os.getpid)
                print("fds gained:", fds(os.getpid()) - before)
            finally:
                os.kill(keeper, signal.SIGCONT)

    if __name__ == "__main__":
        anyio.run(main)
""")


def test_a_stopped_keeper_costs_the_parent_no_fd_per_child() -> None:
    """The keeper is stopped (SIGSTOP) while a Pool retires a worker per task: the
    messages it does not read fill its socket, and the parent queues the rest. Regression
    (review of the keeper): each queued ``+pid`` held a dup of the child's pidfd until the
    keeper read it, also once the child had exited: about one fd per child, for as long
    as the keeper stayed stopped (EMFILE after a thousand or so). A child that exits
    before its ``+pid`` is sent is now taken off the queue, with its fd."""
    out = run_python("-c", _STOPPED_KEEPER, timeout=TIMEOUT * 4)
    gained = int(out.stdout.split("fds gained:")[1])
    assert gained < 30, out.stdout


_KILLED_KEEPER = _KEEPER_TOOLS + textwrap.dedent("""
    import time

    def block(rank):
        time.sleep(1000)  # handshake-free: blocks until the test kills it

    async def main():
        n = int(sys.argv[1])
        async with aiomp.spawn(block, n, start_method="fork") as ctx:
            keeper = await our_keeper()
            os.kill(keeper, signal.SIGKILL)
            async with aiomp.spawn(block, 1, start_method="fork") as one:
                new = await our_keeper(other=keeper)
                want = {os.getpid(), *ctx.pids(), *one.pids()}
                # Until it has learnt them all, or learnt none more for 3 s (it learns in
                # one burst what the socket held: a fixed 20 s wait spent 20 s per run).
                seen, since = set(), time.monotonic()
                with anyio.move_on_after(20):
                    while not want <= (now := watched_by_keeper(new)):
                        if now != seen:
                            seen, since = now, time.monotonic()
                        elif time.monotonic() - since > 3:
                            break
                        await anyio.sleep(0.05)  # handshake-free: /proc is polled
                print("unwatched:", len(want - watched_by_keeper(new)))
                await one.terminate()
            await ctx.terminate()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.xfail(
    strict=True,
    reason="a new keeper is sent every child's +pid at once, before it reads: what its "
    "socket has no room for (about 280 messages) is queued, and sent only with the next "
    "child's start or exit; the parent's SIGKILL before then leaves those groups running",
)
def test_a_new_keeper_learns_every_child_running() -> None:
    """The keeper is killed by hand while 300 children run; the next child's start starts
    another, which must learn all 301 (review of the keeper: it learnt about 280, and
    before that fix the ones past the socket's room were lost for good)."""
    out = run_python("-c", _KILLED_KEEPER, "300", timeout=TIMEOUT * 4)
    assert "unwatched: 0" in out.stdout, out.stdout


def test_a_fork_while_another_thread_starts_the_keeper_can_start_its_own() -> None:
    """A thread of the parent holds the lock that starts the keeper (another event loop's
    first child) when the parent forks: the fork's own first child must start its own
    keeper. Regression (review of the keeper): the lock stayed held in the fork, and
    its first child waited for it forever."""
    with aiomp._process.groups._lock:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the fork
            got = aiomp._process.groups._lock.acquire(timeout=5)
            os._exit(0 if got else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the fork found the lock held"


_SLOW_SHELL = textwrap.dedent("""
    import os
    import time

    import anyio

    import aiomp
    from aiomp._process import groups as _groups
    spawn = os.posix_spawn

    def slow_shell(path, argv, *args, **kwargs):
        # a shell whose fork of the keeper takes 4 s (bash retrying under a pids limit)
        return spawn(path, [argv[0], argv[1], "sleep 4; " + argv[2], *argv[3:]], *args, **kwargs)

    os.posix_spawn = slow_shell

    def noop(rank):
        pass

    async def main():
        t = time.monotonic()
        async with aiomp.spawn(noop, 1, start_method="fork"):
            pass
        print("first start took %.2f s" % (time.monotonic() - t))
        print("shells waiting:", len(_groups._shells))
        await anyio.wait_readable(_groups._shells[0])  # the slow shell's exit
        async with aiomp.spawn(noop, 1, start_method="fork"):
            pass
        print("shells left:", len(_groups._shells))

    if __name__ == "__main__":
        anyio.run(main)
""")


def test_a_slow_shell_starting_the_keeper_does_not_hold_the_loop() -> None:
    """Review of issue 25 item 5: the parent waited for the shell that starts its keeper
    with a blocking waitpid on the loop's thread; bash, failing to fork under a pids limit,
    retries with sleeps of 1, 2, 4 and 8 s, at every child start. Now it never waits for
    it (decision 0090), and reaps the shell at a later message. (The shell takes 4 s
    here: a start that waited for it is told from a slow one on a busy host by far more
    than their noise.)"""
    out = run_python("-c", _SLOW_SHELL, timeout=TIMEOUT * 2)
    took = float(out.stdout.split("first start took ")[1].split()[0])
    assert took < 3, out.stdout
    assert "shells waiting: 1" in out.stdout and "shells left: 0" in out.stdout, out.stdout


_DEFERRED_KEEPER_FAILS = textwrap.dedent("""
    import errno, os, subprocess

    from aiomp._process import groups

    # What is registered: a process leading a group of its own, as a child does.
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    me = os.pidfd_open(child.pid)

    real_spawn, real_deliver = groups._spawn, groups._deliver
    delivered = []

    def no_shell(end, stand_in, wait=True):
        raise OSError(errno.EAGAIN, "fork: resource temporarily unavailable")

    def deliver(sock, data, fd):
        delivered.append(data.decode())
        real_deliver(sock, data, fd)

    groups._deliver = deliver
    groups.start_keeper(defer=True)
    groups.register(1001, me)  # waits in the socket for the deferred keeper
    groups._spawn = no_shell
    groups.start_deferred_keeper()  # cannot start: the socket is let go of
    assert groups._sock is None and groups._unstarted is None
    groups._spawn = real_spawn
    delivered.clear()
    groups.register(1002, me)  # the next child starts a keeper, which learns both
    print(*delivered)
    child.kill()
    child.wait()
""")


def test_a_deferred_keeper_that_cannot_start_is_started_with_the_next_child() -> None:
    proc = run_python("-c", _DEFERRED_KEEPER_FAILS, timeout=TIMEOUT)
    assert proc.stdout.split() == ["+1001", "+1002"]
    assert "no keeper process" in proc.stderr
