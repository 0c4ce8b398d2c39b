"""Shared memory names and their janitor: names of SIGKILLed or exited children removed,
live ones spared, blocks in flight never reused, discarded sends undone.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import anyio
import numpy as np
import pytest

import aiomp
from aiomp._arrays import shared as _shared
from aiomp._memory import blocks as _blocks
from aiomp._memory import janitor as _janitor
from aiomp._memory import lease as _lease
from aiomp._memory import registry as _registry
from tests._run import run_python
from tests.children import memory as funcs_shm
from tests.children import queue as qfuncs
from tests.memory._shm import (
    BOTH_STRATEGIES,
    GRACE,
    ONE_LOOP,
    TIMEOUT,
    segment_count,
    segment_of,
    shm_names,
)

# -- file_system: names and the janitor (R3, R5) -------------------------------------------


@pytest.mark.anyio
@ONE_LOOP
async def test_janitor_removes_names_of_a_sigkilled_child() -> None:
    ready = aiomp.Queue()
    n = 3 << 20  # a slab and a large segment
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs_shm.shm_hold_named_then_block, 1, args=(ready, n), grace_period=GRACE
        )
        names = await ready.get()
        assert len(names) == 2 and set(names) <= shm_names()
        os.kill(ctx.pids()[0], signal.SIGKILL)
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    # R5: reaping a child that died abnormally sweeps the names it left (the janitor)
    assert not set(names) & shm_names()
    assert not set(names) & set(_janitor.janitor())


def test_janitor_spares_live_creators_and_held_names(file_system: None) -> None:
    mine = aiomp.zeros(10)
    my_name = segment_of(mine).name
    # A name whose creator is dead but which a live process still holds: fake one.
    dead_pid = _dead_pid()
    held_name = f"{_janitor.PREFIX}{dead_pid}-{'0' * 16}"
    orphan_name = f"{_janitor.PREFIX}{dead_pid}-{'1' * 16}"
    held_fd = os.open(os.path.join(_janitor.SHM_DIR, held_name), os.O_RDWR | os.O_CREAT, 0o600)
    orphan_fd = os.open(os.path.join(_janitor.SHM_DIR, orphan_name), os.O_RDWR | os.O_CREAT, 0o600)
    os.close(orphan_fd)
    try:
        os.ftruncate(held_fd, 4096)
        _lease.hold(held_fd, 0, 4096)
        removed = _janitor.janitor()
        assert orphan_name in removed
        assert held_name not in removed and my_name not in removed
        assert {held_name, my_name} <= shm_names()
        assert orphan_name not in shm_names()
    finally:
        os.close(held_fd)
    assert held_name in _janitor.janitor(), "removed once nobody holds it"
    assert my_name in shm_names()


def test_janitor_tolerates_foreign_and_vanishing_names() -> None:
    foreign = os.path.join(_janitor.SHM_DIR, f"{_janitor.PREFIX}not-a-pid")
    open(foreign, "wb").close()
    try:
        assert _janitor.janitor() == []
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.anyio
@ONE_LOOP
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
@pytest.mark.parametrize(
    "start_method",
    [
        "spawn",
        "fork",
        "forkserver",
    ],
)
async def test_child_names_are_removed_when_it_exits(start_method: str) -> None:
    made, left = await _names_left_by_a_child(start_method)
    assert made == 1
    assert left == set()


async def _names_left_by_a_child(start_method: str) -> tuple[int, set[str]]:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_shm.shm_make_named, 1, start_method=start_method, grace_period=GRACE
        ) as ctx:
            pass
    return ctx.results[0], _left_by(ctx.pids()[0])  # type: ignore[return-value]


def _left_by(pid: int) -> set[str]:
    """Names created by ``pid``; removed before returning so that no test leaks them."""
    left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    _janitor.janitor()
    return left


async def _names_left_after_receiving_from_a_child() -> tuple[set[str], set[str]]:
    q, received = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_shm.shm_send_and_wait, 1, args=(q, received, 100_000), grace_period=GRACE
        ) as ctx:
            arr = await q.get()
            received.set()
    pid = ctx.pids()[0]
    held = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert (arr == np.arange(100_000)).all()
    del arr
    gc.collect()
    return held, _left_by(pid)


@pytest.mark.anyio
@ONE_LOOP
async def test_names_received_from_an_exited_child_are_removed() -> None:
    held, left = await _names_left_after_receiving_from_a_child()
    assert held, "the parent held the child's segment after the child exited"
    assert left == set()


async def _forwarded_block_survives_reuse(strategy: str) -> tuple[bool, bool]:
    n = (3 << 20) // 8  # a large block: a segment of its own, reused first
    q1, q2 = aiomp.Queue(), aiomp.Queue()
    a = aiomp.share_memory(np.full(n, 1.0))
    address = a.ctypes.data
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(qfuncs.q_forward, 1, args=(q1, q2), grace_period=GRACE):
            await q1.put(a)
            q1.close()
        del a  # the only handle left is in the message on q2
        gc.collect()
        fresh = aiomp.zeros(n)
        reused = fresh.ctypes.data == address
        fresh[:] = 2.0
        back = await q2.get()
        intact = bool((back == 1.0).all())
    del fresh, back
    return intact, reused


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_block_in_flight_is_never_reused(strategy: str) -> None:
    intact, reused = await _forwarded_block_survives_reuse(strategy)
    assert intact, "the forwarded array was overwritten by a new allocation"
    assert not reused


async def _segments_after_double_receive() -> int:
    q, reply = aiomp.Queue(), aiomp.Queue()
    a = aiomp.share_memory(np.arange((3 << 20) // 8, dtype=np.float64))
    b = aiomp.share_memory(np.arange(100_000, dtype=np.float64))
    x = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)
    before = segment_count()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs_shm.shm_views, 1, args=(q, reply), grace_period=GRACE):
            await q.put((a, a[10:], b, x[:600], x[400:]))  # a named twice in one message
            await q.put(a)  # and again while the child holds it
            await reply.get()
    del a, b, x
    gc.collect()
    _blocks.purge_pool()
    return before - segment_count()


@pytest.mark.anyio
@ONE_LOOP
async def test_blocks_sent_twice_are_released(file_system: None) -> None:
    released = await _segments_after_double_receive()
    leftover = [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]
    for seg in leftover:
        _registry.REGISTRY.pool.forget(seg)  # leave /dev/shm clean for the leak check either way
    assert released >= 2 and not leftover  # a large segment and one 1 MiB slab


# -- examples ------------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["hogwild.py", "buffer_reuse.py"])
def test_example_runs(example: str) -> None:
    proc = run_python(f"examples/{example}")
    assert "ok" in proc.stdout.splitlines()[-1], proc.stdout


def test_janitor_removes_a_dead_creators_name_whose_message_was_never_read(
    file_system: None,
) -> None:
    """Regression: a name named by a message dropped unread (its queue gone) stayed in
    /dev/shm forever once its creator had died; the janitor now lets such a name go once
    nothing has been sent naming it for STALE_IN_FLIGHT seconds."""
    pid = os.fork()
    if pid == 0:  # the creator: sends a block into a message nobody will read, then dies
        try:
            q = aiomp.Queue()
            q.put_nowait(np.ones(100_000))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    names = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert names, "the child's segment should outlive it while a message names it"
    assert not set(_janitor.janitor()) & names  # in flight, and recent: kept
    for name in names:
        old = time.time() - _janitor.STALE_IN_FLIGHT - 1
        os.utime(os.path.join(_janitor.SHM_DIR, name), (old, old))
    assert set(_janitor.janitor()) >= names


# -- issue 9 item 1: file_system names outlive no one; issue 9 item 3 and issue 18 item 4:
# -- bounded fds and a clear error at the fd limit ------------------------------------------


def test_creator_exit_cleanup_then_last_release_removes_the_name(file_system: None) -> None:
    """Regression (issue 9 item 1a): a producer's exit clean-up ran while a consumer still
    held a lease, then the consumer released while the producer was still alive, and
    neither unlinked: the segment outlived both (2-3 x 8 MiB in 4 of 6 load runs). The
    creator now marks the name abandoned at exit, under the header's lock, and the last
    holder, seeing the mark, removes it."""
    q = aiomp.Queue()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the producer
        try:
            os.close(go_w)
            os.close(done_r)
            q.sync.put(np.arange(100_000, dtype=np.float64))
            os.read(go_r, 1)  # the consumer holds the array
            _registry.REGISTRY.at_exit()  # the exit clean-up runs while the lease is held
            os.write(done_w, b"x")
            os.read(go_r, 1)  # the consumer has released it: exit
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(done_w)
    try:
        arr = q.sync.get(timeout=TIMEOUT)
        names = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
        assert names, "the producer's segment"
        os.write(go_w, b"x")
        assert os.read(done_r, 1) == b"x"
        del arr  # the last release, while the producer is alive
        gc.collect()
        os.write(go_w, b"x")
    finally:
        os.close(go_w)
        os.close(done_r)
        os.waitpid(pid, 0)
    left = names & shm_names()
    _janitor.janitor()  # (the leak check must see a clean /dev/shm either way)
    assert not left


def test_discard_undoes_a_named_send(file_system: None) -> None:
    """The API for a message dropped before it was sent (issue 9 item 1b): pickling counts
    a send in the segment's header; ``Outgoing.discard()`` takes it back, so nothing is in
    flight and the name can go. ``close()`` is for a message that was sent."""
    from aiomp._wire import pickling as _reduction

    arr = aiomp.zeros(100_000)
    ref = _blocks.block_of(_shared.root(arr))
    assert ref is not None
    out = _reduction.dumps({"task": (arr, arr[10:])})
    assert ref.segment.in_flight(ref.index), "pickled: counted as sent"
    out.discard()
    assert not ref.segment.in_flight(ref.index), "discarded: nothing in flight"


@pytest.mark.anyio
@ONE_LOOP
async def test_pool_task_dropped_before_it_was_sent_leaves_no_name(file_system: None) -> None:
    """Regression (issue 9 item 1b): under file_system, a task's send count was taken when
    it was pickled; a task cancelled while it waited for a busy worker was never sent and
    never opened, so its name stayed in /dev/shm after the run."""
    started, go = aiomp.Event(), aiomp.Event()
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, grace_period=GRACE) as pool, anyio.create_task_group() as tg:
                tg.start_soon(pool.apply, funcs_shm.signal_then_wait, (started, go))
                await started.wait()
                with anyio.move_on_after(0.1):  # the worker is busy: this one never starts
                    await pool.apply(funcs_shm.nbytes, (np.ones(1 << 17),))
                go.set()
        gc.collect()
        _blocks.purge_pool()
        left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{os.getpid()}-")}
    finally:
        for seg in [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]:
            _registry.REGISTRY.pool.forget(seg)
        for name in shm_names():
            if name.startswith(f"{_janitor.PREFIX}{os.getpid()}-"):
                _janitor.unlink(name)  # pinned by the dropped task: the leak check must pass
    assert not left
