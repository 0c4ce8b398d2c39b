"""Chaos: consumers SIGKILLed holding arrays, a SIGKILLed parent's tree swept by the next
start, SIGINT to the parent, fd exhaustion and recovery. Seeds, counts and what is asserted:
see ``tests/chaos/test_chaos.py``.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

import aiomp
from aiomp import _lifecycle
from aiomp._memory.registry import REGISTRY
from tests._run import run_python
from tests.chaos import _chaos
from tests.chaos._checks import GRACE, SEEDS, TIMEOUT, exactly_once, names_of

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = ["file_descriptor", "file_system"]
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_gone(pids: list[int], timeout: float = TIMEOUT) -> None:
    """Wait for processes that are not our children to vanish (polling the kernel)."""
    deadline = time.monotonic() + timeout
    while any(_lifecycle.pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, (
            f"orphans left: {[p for p in pids if _lifecycle.pid_alive(p)]}"
        )
        time.sleep(0.01)  # handshake-free: polling the kernel's view of a non-child


# -- repeated SIGKILL of consumers holding arrays --------------------------------------------

ROUNDS, HELD = 8, 3


@pytest.mark.anyio
@ONE_LOOP
@SEEDS
async def test_sigkilled_consumers_holding_arrays(strategy: str, seed: int) -> None:
    """Consumers take arrays (100 KiB and 2 MiB copies made by this producer), hold them and
    are SIGKILLed, round after round. The kernel drops their leases: this producer reuses
    the blocks, and its fds, RSS and segments stay flat; no names are left."""
    rng = random.Random(seed)
    q, took = aiomp.Queue(), aiomp.Queue()
    taken: list[tuple[int, int]] = []
    put: list[tuple[int, int]] = []
    marks: list[tuple[int, int, int]] = []
    pids: list[int] = []
    for r in range(ROUNDS):
        with anyio.fail_after(TIMEOUT):
            ctx = await aiomp.spawn(
                _chaos.hold_until_killed, 1, args=(q, took, strategy, HELD), grace_period=GRACE
            )
            pids += ctx.pids()
            sizes = [2 << 20] + [100 << 10] * (HELD - 1)  # the same demand every round
            rng.shuffle(sizes)
            for j, size in enumerate(sizes):
                key = (r, j)
                await q.put((key, np.full(size, _chaos.fill_of(key), np.uint8)))
                put.append(key)
            for _ in range(HELD):
                taken.append(await took.get())
            os.kill(ctx.pids()[0], signal.SIGKILL)
            with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
                await ctx.join()
        gc.collect()
        marks.append((fds(), rss(), sum(len(s) for s in REGISTRY.pool.segments.values())))
    lost, duplicated = exactly_once(put, taken)
    # flat: the second half of the rounds needs no more than the first half did
    half = ROUNDS // 2
    fds0, rss0, segs0 = (max(m[i] for m in marks[:half]) for i in range(3))
    fds1, rss1, segs1 = (max(m[i] for m in marks[half:]) for i in range(3))
    assert fds1 - fds0 <= 1, marks
    assert segs1 - segs0 <= 0, marks
    assert rss1 - rss0 < 8 << 20, marks
    leaked = names_of(pids)
    assert not leaked
    _chaos.record(
        "sigkill-consumers",
        strategy=strategy,
        seed=seed,
        messages=len(put),
        kills=ROUNDS,
        fds_growth=fds1 - fds0,
        segments_growth=segs1 - segs0,
        rss_growth_kib=(rss1 - rss0) >> 10,
        lost=lost,
        duplicated=duplicated,
        leaked=len(leaked),
    )


# -- SIGKILL of the parent, then a new start sweeps; SIGINT to the parent -------------------

_TREE = textwrap.dedent("""
    import asyncio, os, sys
    import anyio
    import aiomp
    from tests.chaos import _chaos

    loop, strategy, seed, ready_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    async def main():
        aiomp.set_sharing_strategy(strategy)
        q, out = aiomp.Queue(maxsize=8), aiomp.Queue()
        async with aiomp.spawn(_chaos.consume, 2, args=(q, out, strategy), grace_period=0.5), \\
                aiomp.spawn(_chaos.produce, 1, args=(q, 10**9, seed, strategy),
                            grace_period=0.5) as producer:
            held = []  # the parent takes and holds items too
            i = 0
            async for item in q:
                held.append(item)
                del held[:-8]
                i += 1
                if i == ready_at:
                    print(os.getpid(), *producer.pids(), flush=True)

    if loop == "trio":
        import trio
        trio.run(main)
    elif loop == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
""")


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _start_tree(loop: str, strategy: str, seed: int) -> tuple[subprocess.Popen[str], list[int]]:
    ready_at = random.Random(seed).randrange(20, 200)
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE, loop, strategy, str(seed), str(ready_at)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the tree did not start"
    return proc, _tree_pids(int(line.split()[0]))


@pytest.mark.parametrize("strategy", STRATEGIES)
@SEEDS
def test_sigkilled_parent_then_a_new_start_sweeps(strategy: str, seed: int) -> None:
    """A parent under load (a producer, two consumers and itself taking items) is
    SIGKILLed at a seeded moment: its children die (parent-death signal), and the next
    aiomp start removes every name the dead tree left (unread messages included)."""
    proc, pids = _start_tree("asyncio", strategy, seed)
    try:
        os.kill(pids[0], signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        wait_gone(pids)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    left_by_kill = names_of(pids)  # (test_shm pins that there are some, deterministically)
    subprocess.run(
        [sys.executable, "-c", "import aiomp; aiomp.zeros(1)"],
        cwd=REPO,
        check=True,
        timeout=TIMEOUT,
    )
    leaked = names_of(pids)
    assert not leaked, "the next start swept the dead tree"
    _chaos.record(
        "sigkill-parent",
        strategy=strategy,
        seed=seed,
        kills=1,
        processes=len(pids),
        names_left_by_kill=len(left_by_kill),
        leaked=len(leaked),
        orphans=0,
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_sigint_to_the_parent(loop: str) -> None:
    """Ctrl-C to a parent under load, on each loop: it exits (not with success), its
    children are terminated and reaped, and nothing it made is left in /dev/shm."""
    seed = _chaos.RANDOM_SEED
    proc, pids = _start_tree(loop, "file_system", seed)
    try:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=TIMEOUT)
        wait_gone(pids)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert rc != 0, "Ctrl-C is never reported as success"
    leaked = names_of(pids)
    assert not leaked
    _chaos.record(
        "sigint",
        loop=loop,
        seed=seed,
        processes=len(pids),
        returncode=rc,
        leaked=len(leaked),
        orphans=0,
    )


# -- fd exhaustion and recovery ---------------------------------------------------------------

_FD = textwrap.dedent("""
    import asyncio, gc, os, random, resource, sys
    import anyio
    import numpy as np
    import aiomp
    from tests.chaos import _chaos
    from tests.children import memory as memory_funcs

    loop, strategy, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])

    async def main():
        aiomp.set_sharing_strategy(strategy)
        rng = random.Random(seed)
        q = aiomp.Queue()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        keep, sent, error = [], 0, None
        try:
            while True:  # shared arrays the producer keeps, of seeded sizes
                arr = aiomp.zeros(rng.choice([3 << 20, 5 << 20]), np.uint8)
                arr[0] = sent % 251
                keep.append(arr)
                await q.put(arr)
                sent += 1
        except aiomp.TransportError as exc:
            error = str(exc)
        del keep, arr
        gc.collect()
        with anyio.fail_after(60):
            async with aiomp.spawn(memory_funcs.drain, 1, args=(q, sent, strategy)) as ctx:
                pass
        assert ctx.results[0] == [i % 251 for i in range(sent)]
        assert q.qsize() == 0
        print(os.getpid(), sent, error, flush=True)

    if loop == "trio":
        import trio
        trio.run(main)
    elif loop == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
""")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fd_exhaustion_and_recovery(loop: str, strategy: str) -> None:
    """RLIMIT_NOFILE=256 and shared arrays kept until the fds run out: a TransportError
    that says so (not a raw EMFILE); the arrays dropped, a consumer started afterwards
    drains the queue exactly once; the process leaves no name behind."""
    seed = _chaos.RANDOM_SEED
    proc = run_python("-c", _FD, loop, strategy, str(seed), timeout=120)
    pid, sent, error = proc.stdout.strip().split(" ", 2)
    assert "file descriptors open" in error and "RLIMIT_NOFILE) is 256" in error, error
    leaked = names_of([int(pid)])
    assert not leaked
    _chaos.record(
        "fd-exhaustion",
        loop=loop,
        strategy=strategy,
        seed=seed,
        messages=sent,
        lost=0,
        duplicated=0,
        leaked=len(leaked),
    )
