"""Shared memory: the block pool (reuse, unsent messages, exhaustion), arrays in spawn
args and return values, and the same memory seen by every process.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from aiomp._memory import blocks as _blocks
from aiomp._memory import janitor as _janitor
from aiomp._memory import registry as _registry
from tests.children import common as funcs
from tests.children import memory as funcs_shm
from tests.children import queue as qfuncs
from tests.memory._shm import (
    BOTH_STRATEGIES,
    GRACE,
    INLINE,
    ONE_LOOP,
    TIMEOUT,
    big,
    fd_count,
    segment_count,
    segment_of,
    shm_names,
)


def own_shm_names() -> set[str]:
    return {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{os.getpid()}-")}


def test_pool_reuses_blocks_in_one_process() -> None:
    q = aiomp.Queue()
    gc.collect()
    before = segment_count()
    fds = fd_count()
    for i in range(500):
        q.sync.put(np.full(INLINE * 2, i % 256, np.uint8))
        got = q.sync.get(timeout=5)
        assert got[0] == i % 256
        del got
    for i in range(20):
        q.sync.put(np.full(3 << 20, i, np.uint8))
        q.sync.get(timeout=5)
    assert segment_count() - before <= 2, "one slab of small blocks, one large segment"
    assert fd_count() - fds <= 2 * 2, "each segment: its fd, and the one mmap dups"


def _segments_after_loopback_sends() -> int:
    q = aiomp.Queue()
    before = segment_count()
    for i in range(100):
        q.sync.put(np.full(INLINE * 2, i, np.uint8))
        q.sync.get(timeout=5)
    for i in range(10):
        q.sync.put(np.full(3 << 20, i, np.uint8))
        q.sync.get(timeout=5)
    gc.collect()
    _blocks.purge_pool()
    return segment_count() - before


def test_pool_reuses_blocks_in_one_process_file_system(file_system: None) -> None:
    leftover = _segments_after_loopback_sends()
    _registry.REGISTRY.pool.trim(0)
    for seg in [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]:
        _registry.REGISTRY.pool.forget(seg)  # let the leak check see a clean /dev/shm either way
    assert leftover == 0


async def _segments_left_by_unsent_messages() -> int:
    shared = aiomp.share_memory(np.arange((3 << 20) // 8, dtype=np.float64))
    plain = big()
    full = aiomp.Queue(maxsize=1)
    full.put_nowait("occupies the only slot")
    with pytest.raises(TypeError):  # a pickling error after the arrays
        full.put_nowait([plain, shared, funcs.Unpicklable()])
    with pytest.raises(aiomp.Full):
        full.put_nowait([plain, shared])
    with pytest.raises(aiomp.Full):
        full.sync.put([plain, shared], timeout=0)

    async def cancelled_put(obj: object) -> None:
        with anyio.move_on_after(0.01):  # handshake-free: cancel a put that waits for room
            await full.put(obj)

    # In a task of its own: the cancelled frames (and the arrays they hold) go with it.
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_put, [plain, shared])
    assert full.qsize() == 1
    del shared, plain
    gc.collect()
    _blocks.purge_pool()
    leftover = [seg for segs in _registry.REGISTRY.pool.segments.values() for seg in segs]
    for seg in leftover:
        _registry.REGISTRY.pool.forget(seg)  # leave /dev/shm clean for the leak check either way
    return len(leftover)


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_unsent_messages_pin_no_blocks(strategy: str) -> None:
    assert await _segments_left_by_unsent_messages() == 0


# -- exhaustion (R4) -----------------------------------------------------------------------


def too_big() -> int:
    """More bytes than /dev/shm has free and than memory has available."""
    st = os.statvfs(_janitor.SHM_DIR)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return max(st.f_bavail * st.f_frsize, avail) + (1 << 30)


def test_exhaustion_at_allocation(strategy: str) -> None:
    size = too_big()
    names = own_shm_names()
    fds = fd_count()
    with pytest.raises(aiomp.SharedMemoryError) as info:
        aiomp.empty(size, np.uint8)
    assert info.value.errno in (12, 28)  # ENOMEM (memfd), ENOSPC (/dev/shm)
    assert "shared memory" in str(info.value)
    with pytest.raises(aiomp.SharedMemoryError):
        aiomp.zeros((size // 8 + 1,))
    assert isinstance(info.value, OSError)
    # (Only this process's names: a concurrent test's may come and go meanwhile.)
    assert own_shm_names() == names and fd_count() == fds, "nothing left behind"


def test_exhaustion_at_put(strategy: str, tmp_path: Path) -> None:
    # A file-backed array as large as all the memory: mapping it costs nothing, copying it
    # into shared memory cannot succeed, and must fail in put, before anything is sent.
    size = too_big()
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(size)
    mapped = np.memmap(path, np.uint8, "r", shape=(size,))
    arr = mapped.view(np.ndarray)
    q = aiomp.Queue()
    with pytest.raises(aiomp.SharedMemoryError):
        q.put_nowait({"data": arr})
    with pytest.raises(aiomp.SharedMemoryError):
        q.sync.put(arr)
    assert q.qsize() == 0
    with pytest.raises(aiomp.Empty):
        q.get_nowait()
    q.put_nowait("still usable")
    assert q.get_nowait() == "still usable"
    del arr, mapped


# -- across processes ----------------------------------------------------------------------


def describe(arr: np.ndarray[Any, Any], shared: bool) -> tuple[object, ...]:
    """What ``funcs_shm.shm_inspect`` reports for an array received as ``arr`` was sent."""
    return ("array", shared, True, arr.dtype.str, arr.shape, arr.strides, arr.tobytes())


@pytest.mark.anyio
@ONE_LOOP
async def test_arrays_in_spawn_args() -> None:
    # (file_system: see test_blocks_sent_twice_are_released; base and base.T share a block)
    base = np.arange(400 * 100, dtype=np.float64).reshape(400, 100)
    small = np.arange(5, dtype=np.int16)
    zero_d = np.zeros((), dtype=[("v", "f8", (INLINE // 8 + 1,))])
    fortran = np.asfortranarray(base)
    args = (
        base,
        small,
        {"nested": [big(np.complex64), small]},
        base.T,
        fortran,
        zero_d,
        np.empty((0, 7)),
        np.array(2.5),
        big("S5"),
        big("datetime64[ms]"),
    )
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs_shm.shm_inspect, 1, args=args, grace_period=GRACE) as ctx:
            pass
    got = ctx.results[0]
    assert got[0] == describe(base, True)
    assert got[1] == describe(small, False)
    assert got[2] == {
        "nested": [
            describe(args[2]["nested"][0], True),  # type: ignore[index]
            describe(small, False),
        ]
    }
    assert got[3] == describe(base.T, True)
    assert got[4] == describe(fortran, True)
    assert got[5] == describe(zero_d, True)
    assert got[6][:5] == describe(args[6], False)[:5]  # type: ignore[arg-type]
    assert got[6][6] == b""  # (numpy's own pickle gives empty arrays zero strides)
    assert got[7] == describe(args[7], False)  # type: ignore[arg-type]
    assert got[8] == describe(args[8], True)  # type: ignore[arg-type]
    assert got[9] == describe(args[9], True)  # type: ignore[arg-type]


async def wait_exited(ctx: aiomp.ProcessContext) -> None:
    """Wait until every child has exited, without reading their reports (join does)."""
    for process in ctx.processes:
        await anyio.wait_readable(process.sentinel)


async def _results_read_after_exit(
    fn: Callable[..., Any], nprocs: int, args: tuple[object, ...]
) -> list[Any] | str:
    """Spawn, let every child exit, then join: the results or the failure's message (so
    that a failure keeps no process object alive through its traceback)."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(fn, nprocs, args=args, grace_period=GRACE)
        await wait_exited(ctx)  # the senders are gone before their results are read
        try:
            await ctx.join()
        except aiomp.ProcessException as exc:
            return str(exc)
    return ctx.results


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_arrays_in_return_values(strategy: str) -> None:
    n = 100_000
    results = await _results_read_after_exit(funcs_shm.shm_return_arrays, 2, (n, strategy))
    assert isinstance(results, list), results
    for rank, result in enumerate(results):
        plain, shared, small = result["plain"], result["shared"], result["small"]  # type: ignore[index]
        assert aiomp.is_shared(plain) and aiomp.is_shared(shared)
        assert not aiomp.is_shared(small)
        assert plain.flags.writeable and shared.flags.writeable
        assert np.array_equal(plain, np.arange(n, dtype=np.float32) + rank)
        assert np.array_equal(shared, np.arange(n) * (rank + 1))
        shared[:] = -1  # the creator has exited: the memory is ours now
    assert np.array_equal(small, np.arange(3) + 1)


@pytest.mark.anyio
async def test_hogwild_writes_are_seen_by_every_process() -> None:
    nprocs, n = 4, 1000
    w = aiomp.zeros(n)
    flag = aiomp.zeros(1)  # small, but already shared: travels by handle
    q, go = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_shm.shm_stripe, nprocs, args=(nprocs, w, flag, q, go), grace_period=GRACE
        ) as ctx:
            for _ in range(nprocs):
                await q.put(w)
            flag[0] = 42.0  # after the children started
            go.set()
    assert ctx.results == [42.0] * nprocs
    for rank in range(nprocs):
        assert (w[rank::nprocs] == rank + 1 + 100).all()


@pytest.mark.anyio
async def test_forwarded_array_is_still_the_same_memory(strategy: str) -> None:
    a = aiomp.share_memory(np.zeros(50_000))
    q1, q2, reply = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs_shm.shm_write_marks, 1, args=(q2, reply), grace_period=GRACE):
            async with aiomp.spawn(qfuncs.q_forward, 1, args=(q1, q2), grace_period=GRACE):
                await q1.put((a, "first"))
                assert await reply.get() == "first"
                assert a[0] == 1.0, "written by the second child, through the first one"
                a[1] = 7.0
                await q1.put((a[1:], "view"))
                assert await reply.get() == "view"
                assert a[1] == 1.0
                q1.close()
            q2.close()


@pytest.mark.anyio
@ONE_LOOP
async def test_a_received_array_sent_back_is_the_same_memory(strategy: str) -> None:
    qin, qout = aiomp.Queue(), aiomp.Queue()
    plain = big()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(qfuncs.q_forward, 1, args=(qin, qout), grace_period=GRACE):
            await qin.put(plain)
            first = await qout.get()  # a shared copy, made by this process's put
            assert aiomp.is_shared(first) and np.array_equal(first, plain)
            await qin.put(first)  # by handle, out and back
            second = await qout.get()
            assert np.shares_memory(first, second)
            second[0] = -5.0
            assert first[0] == -5.0 and plain[0] == 0.0
            qin.close()
    del first, second


@pytest.mark.anyio
@ONE_LOOP
async def test_same_segment_is_mapped_once_and_views_stay_views() -> None:
    # (file_system: the same exchange pins the blocks, see test_blocks_sent_twice_are_released)
    a = aiomp.share_memory(np.arange(100_000, dtype=np.float64))
    b = aiomp.share_memory(np.arange(30_000, dtype=np.float32))
    x = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)  # not shared: copied
    q, reply = aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs_shm.shm_views, 1, args=(q, reply), grace_period=GRACE):
            await q.put((a, a[10:], b, x[:600], x[400:]))
            await q.put(a)
            info = await reply.get()
    # x's copy has a's block size (1 MiB): it lies in a's slab, so the child maps two
    segments = {id(segment_of(a)), id(segment_of(b))}
    assert info == {
        "a_tail_is_view_of_a": True,
        "a_again_same_memory": True,
        "a_again_same_base": True,
        "a_b_separate": True,
        "x_views_share_one_buffer": True,
        "x_write_seen_through_other_view": True,
        "mappings": len(segments),
    }
    assert a[10] == -1.0, "the child's write through its view"
