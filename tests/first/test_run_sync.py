"""``aiomp.run_sync`` (issue 29): one call, a default pool per event loop.

Every async test runs on a plain ``asyncio.run`` loop, uvloop and ``trio.run`` (conftest),
each on a fresh loop: so each test also checks that its loop's default pool is closed with
the loop (the autouse leak check finds no child and no fd left after it).
"""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import threading
import time

import anyio
import pytest

import aiomp
from aiomp._first import default as first
from aiomp._pool.pool import on_demand
from aiomp._pool.process_kind import Launched, ProcessKind
from aiomp._process import cpus
from tests._gate import Gate
from tests._procs import dead
from tests._run import REPO, run_python
from tests.children import pool as funcs

pytestmark = pytest.mark.anyio

TIMEOUT = 60


async def test_runs_a_function_in_a_worker() -> None:
    with anyio.fail_after(TIMEOUT):
        square, pid = await aiomp.run_sync(funcs.square_and_pid, 7)
        assert square == 49 and pid != os.getpid()
        assert await aiomp.run_sync(pow, 2, 10) == 1024
        assert await aiomp.run_sync(int, "ff", base=16) == 255  # keyword arguments


async def test_lambdas_closures_and_local_methods_travel_by_value() -> None:
    base = 10

    def closure(x: int) -> int:
        return x + base

    class Local:
        def __init__(self, k: int) -> None:
            self.k = k

        def times(self, x: int) -> int:
            return self.k * x

    async def local_async(x: int) -> int:
        return x - 1

    with anyio.fail_after(TIMEOUT):
        assert await aiomp.run_sync(lambda x: x * 2, 21) == 42
        assert await aiomp.run_sync(closure, 5) == 15
        assert await aiomp.run_sync(Local(3).times, 4) == 12
        assert await aiomp.run_sync(local_async, 1) == 0


async def test_a_function_capturing_a_lock_is_refused_before_any_worker_starts() -> None:
    lock = threading.Lock()

    def holds(x: int) -> int:
        with lock:
            return x

    before = _children()
    with pytest.raises(pickle.PicklingError, match="cannot be pickled") as info:
        await aiomp.run_sync(holds, 1)
    assert "lock" in str(info.value)
    with pytest.raises(TypeError, match="lock"):
        await aiomp.run_sync(funcs.square_and_pid, threading.Lock())
    assert first.default_pool() is None  # no default pool was made for them
    assert _children() == before


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:  # pragma: no cover - a kernel without the file
        return []


async def test_one_pool_per_loop_reused_across_calls() -> None:
    with anyio.fail_after(TIMEOUT):
        assert first.default_pool() is None  # made on first use only
        await aiomp.run_sync(os.getpid)
        pool = first.default_pool()
        assert pool is not None
        assert pool.processes == cpus.cpu_count()
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(aiomp.run_sync, funcs.square_and_pid, i)
        assert first.default_pool() is pool


async def test_the_first_worker_starts_alone_then_the_pool_fills(gate: Gate) -> None:
    """Issue 29, the first call (no slower than anyio's): the default pool starts one
    worker for it and the others once that one is ready; then it has them all, each
    taking a call at once."""
    n = cpus.cpu_count()
    with anyio.fail_after(TIMEOUT):
        await aiomp.run_sync(os.getpid)
        pool = first.default_pool()
        assert pool is not None and pool.processes == n
        async with anyio.create_task_group() as tg:
            for key in range(n):
                tg.start_soon(aiomp.run_sync, funcs.block_at_gate, key, gate.address)
            pids = await gate.ready(n)  # n calls running at once: n workers
            assert len(set(pids.values())) == n
            gate.release()


async def test_timeout_and_cancellation_as_pool_apply() -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(TimeoutError):
            await aiomp.run_sync(time.sleep, 30, timeout=0.2)
        with anyio.move_on_after(0.2) as scope:
            await aiomp.run_sync(time.sleep, 30)
        assert scope.cancelled_caught
        # The killed workers were replaced: the pool serves on.
        assert await aiomp.run_sync(pow, 3, 2) == 9


async def test_exceptions_are_raised_in_the_caller() -> None:
    with anyio.fail_after(TIMEOUT), pytest.raises(ValueError, match="invalid literal"):
        await aiomp.run_sync(int, "not a number")


@pytest.mark.parametrize("runner", ["asyncio", "uvloop", "trio"])
def test_each_loop_gets_its_own_pool_closed_with_it(runner: str) -> None:
    """Two runs, one after the other, in a fresh interpreter: each run's pool is its own,
    and none of its workers is left once the run has ended."""
    program = _PROGRAM % {"runner": runner}
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=TIMEOUT * 2,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = (line.split() for line in proc.stdout.splitlines()[:2])
    assert first[0] != second[0]  # pool ids
    assert set(first[1:]).isdisjoint(second[1:])  # worker pids


_PROGRAM = """
import os, sys
import aiomp
from tests._procs import dead

async def main():
    await aiomp.run_sync(os.getpid)
    from aiomp._first import default as first
    pool = first.default_pool()
    pids = pool.pids()
    return id(pool), pids

def run(fn):
    runner = %(runner)r
    if runner == "trio":
        import trio
        return trio.run(fn)
    import asyncio
    factory = None
    if runner == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(fn())

seen = []
for _ in range(2):
    pool_id, pids = run(main)
    assert pids, "no worker was ready"
    left = [p for p in pids if not dead(p)]
    assert not left, f"workers left after the loop closed: {left}"
    seen.append((pool_id, pids))
for pool_id, pids in seen:
    print(pool_id, *pids)
"""


def test_a_loop_closed_without_asyncio_run_is_cleaned_at_exit() -> None:
    """A loop driven by hand and never closed: the workers end with the interpreter."""
    program = (
        "import asyncio, os\n"
        "import aiomp\n"
        "loop = asyncio.new_event_loop()\n"
        "print(loop.run_until_complete(aiomp.run_sync(os.getpid)), flush=True)\n"
        "from aiomp._first import default as first\n"
        "print(*first.default_pool(loop).pids(), flush=True)\n"
    )
    proc = run_python("-c", program, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert "still running at interpreter exit" not in proc.stderr  # expected, not a leak
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) >= 2
    # Killed and reaped by the interpreter's exit, before it ended.
    assert not [p for p in pids[1:] if not dead(p)]


_QUIET_END = """
import asyncio, os, sys, time
import anyio.lowlevel
import aiomp

def die():
    os._exit(3)

async def main(case):
    if case == "died":
        try:
            await aiomp.run_sync(die)
        except aiomp.BrokenWorkerError:
            pass
    else:
        await aiomp.run_sync(os.getpid)
    if case == "awaits":
        for _ in range(3):  # a few turns of the loop, as a program's last awaits
            await anyio.lowlevel.checkpoint()
    global returned
    returned = time.monotonic()

runner, case = sys.argv[1:]
if runner == "trio":
    import trio
    trio.run(main, case)
elif runner == "uvloop":
    import uvloop
    uvloop.run(main(case))
else:
    asyncio.run(main(case))
print(time.monotonic() - returned)
"""


@pytest.mark.parametrize("case", ["one call", "died", "awaits"])
@pytest.mark.parametrize("runner", ["asyncio", "uvloop", "trio"])
def test_the_end_of_a_run_stops_its_default_pool_at_once_and_quietly(
    runner: str, case: str
) -> None:
    """The loop's end terminates the default pool's workers: at once (trio's run used to
    wait the pool's grace period of 5 s, its exit watches cancelled with the run's system
    tasks) and quietly, whenever it comes: right after the first result (the other
    workers are starting then), a few turns later, or after a worker died (its
    replacement is starting). No "Terminating process" warning, no "coroutine ... was
    never awaited" from a watcher cancelled before it ran. The worker that died on its
    own is the one line (issue 40: a WARNING on the aiomp logger)."""
    proc = run_python("-c", _QUIET_END, runner, case.split()[0], timeout=TIMEOUT)
    if case == "died":
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and "exit code 3 while it ran die" in lines[0], proc.stderr
    else:
        assert proc.stderr == ""
    assert float(proc.stdout) < 2.5  # seconds from main's return to the run's end


_IN_FLIGHT = """
import asyncio, sys, time
import anyio.lowlevel
import aiomp

def hang():
    time.sleep(600)  # handshake-free: the call that is still running when the loop ends

async def turns(n):
    for _ in range(n):
        await anyio.lowlevel.checkpoint()

async def main(n):
    asyncio.get_running_loop().create_task(aiomp.run_sync(hang))
    await turns(n)

async def trio_main(n):
    import trio
    async with trio.open_nursery() as nursery:
        nursery.start_soon(aiomp.run_sync, hang)
        await turns(n)
        nursery.cancel_scope.cancel()

if __name__ == "__main__":
    runner, n = sys.argv[1], int(sys.argv[2])
    if runner == "trio":
        import trio
        trio.run(trio_main, n)
    elif runner == "uvloop":
        import uvloop
        uvloop.run(main(n))
    else:
        asyncio.run(main(n))
    print("ended")
"""


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 4, 6])
@pytest.mark.parametrize("runner", ["asyncio", "uvloop", "trio"])
def test_a_call_in_flight_when_the_loop_ends_is_cancelled_quietly(runner: str, turns: int) -> None:
    """Regression (issue 38, item 7): with the default pool's first call still running
    when ``main`` returns, the loop's end warned "coroutine 'Engine._supervise' was never
    awaited" (after 3 turns on asyncio, 2 on uvloop: the supervisor's task was made and
    cancelled before its first step), and after 0 turns "Exception ignored in
    Pool.__del__" at exit (the default pool was taken for a user's pool never entered).
    The call is cancelled and its worker stopped: the program ends although the call
    would run for ten minutes, and prints nothing else."""
    proc = run_python("-c", _IN_FLIGHT, runner, str(turns), timeout=TIMEOUT)
    assert (proc.stdout, proc.stderr) == ("ended\n", "")


_LAUNCH_ORDER = """
import asyncio, os, sys
import multiprocessing.util as mp_util
import aiomp

pool_imported = []
launch = mp_util.spawnv_passfds

def spy(*args, **kwargs):
    pool_imported.append("aiomp._pool.pool" in sys.modules)
    return launch(*args, **kwargs)

mp_util.spawnv_passfds = spy

async def main():
    return await aiomp.run_sync(os.getpid)

if __name__ == "__main__":
    assert asyncio.run(main()) != os.getpid()
    print(pool_imported[0])
"""


def test_the_first_worker_is_launched_before_the_pool_is_imported() -> None:
    """Decision 0048: the first call launches its worker first of all, and imports and
    builds the rest of the pool while that worker's interpreter boots."""
    proc = run_python("-c", _LAUNCH_ORDER, timeout=TIMEOUT)
    assert proc.stdout.split() == ["False"]


async def test_a_launch_ahead_that_fails_is_left_to_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first worker that cannot be launched ahead (EAGAIN) is started by the engine,
    which tries again as for any start."""
    real = ProcessKind._launch
    slots: list[int] = []

    def flaky(self: ProcessKind, slot: int, processes: int) -> Launched:
        slots.append(slot)
        if len(slots) == 1:
            raise OSError(errno.EAGAIN, "fork: resource temporarily unavailable")
        return real(self, slot, processes)

    monkeypatch.setattr(ProcessKind, "_launch", flaky)
    with anyio.fail_after(TIMEOUT):
        assert await aiomp.run_sync(pow, 2, 5) == 32
    assert slots[:2] == [0, 0]


async def test_a_worker_launched_ahead_is_killed_if_its_pool_never_opens() -> None:
    kind = ProcessKind("spawn", (None, ()), "prefix")
    kind.launch_ahead(0, 1)
    (launched,) = kind._ahead.values()
    with anyio.fail_after(TIMEOUT):
        await kind.close(False)
    assert launched.child.exited and launched.sock.fileno() == -1


async def test_a_pool_cancelled_as_it_opens_kills_its_worker_launched_ahead() -> None:
    """Review of decision 0048: a cancellation at the engine's first checkpoint (a first
    ``run_sync`` as trio's run ends: its keeper task starts cancelled) closes the kind,
    which kills and reaps the worker launched ahead."""
    kind = ProcessKind("spawn", (None, ()), "prefix")
    kind.launch_ahead(0, 1)
    (child,) = kind.unadopted()
    pool, _ = on_demand(kind, 1)
    with anyio.fail_after(TIMEOUT), anyio.CancelScope() as scope:
        scope.cancel()
        async with pool:
            pytest.fail("the pool opened in a cancelled scope")
    assert child.exited
