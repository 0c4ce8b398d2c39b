"""``aiomp.Pool``'s workers: their lifetime (``maxtasksperchild``, the initializer,
start methods), what they are sent (each function once per worker), the statistics, the
misuses refused, the examples, and the round trip's hot paths (split from test_pool.py;
the same conventions).
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import pickle
import socket
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiomp
from aiomp._pool import calls as _calls
from aiomp._pool import protocol as P
from aiomp._pool import tasks as _tasks
from aiomp._wire import stream as _transport
from tests._gate import Gate
from tests._procs import dead
from tests._run import REPO, run_python
from tests.children import common as funcs
from tests.pool._pools import BACKENDS, GRACE, asyncio_only, cases, pool, remote_text

TIMEOUT = 20

pytestmark = pytest.mark.anyio


# -- lifetime ----------------------------------------------------------------------------


@asyncio_only
async def test_maxtasksperchild_retires_workers() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, maxtasksperchild=2) as p:
            pids = [await p.apply(funcs.pool_pid) for _ in range(5)]
            assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
            assert dead(pids[0]) and dead(pids[2])
            stats = p.statistics()
            assert (stats.workers, stats.replaced) == (1, 2)
            # map chunks count as tasks: the third worker has one left, then 2 + 1
            more = await p.map(funcs.pool_pid, range(4), chunksize=1)
            assert more[0] == pids[4] != more[1] == more[2] != more[3]


async def test_initializer_runs_before_the_first_task() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=funcs.pool_init, initargs=("hello",)) as p:
            assert await p.map(funcs.pool_get_init, range(4)) == ["hello"] * 4
        async with pool(1, initializer=funcs.pool_async_init, initargs=("async",)) as p:
            # an async initializer shares its loop with the worker's async tasks
            assert await p.apply(funcs.pool_async_same_loop) == ("async", True)


@pytest.mark.parametrize(
    "bad, anyio_backend", cases(*[("raise", b) for b in BACKENDS], ("exit", "asyncio"))
)
async def test_failing_initializer_breaks_the_pool(bad: str) -> None:
    init = funcs.pool_init_fail if bad == "raise" else funcs.pool_init_exit
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=init) as p:
            with pytest.raises(aiomp.BrokenPoolError) as info:
                await p.apply(funcs.pool_square, (2,))
            if bad == "raise":
                assert "initializer raised ValueError: the initializer refuses" in str(info.value)
                worker_error = info.value.__cause__
                assert isinstance(worker_error, aiomp.BrokenWorkerError)
                cause = worker_error.__cause__
                assert isinstance(cause, ValueError)
                assert "in pool_init_fail" in remote_text(cause)
            else:
                # an exit during start-up may be the OOM killer: retried, 3 times in a row
                assert "during start-up 3 times in a row" in str(info.value)
                assert "exit code 4" in str(info.value)
            with pytest.raises(aiomp.BrokenPoolError):  # at once, every time after
                await p.map(funcs.pool_square, range(3))
            if bad == "raise":
                assert p.statistics().replaced == 0  # a raising initializer is not retried


@asyncio_only
async def test_statistics(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            stats = p.statistics()
            assert stats.workers == 2 and stats.running == stats.queued == 0
            with pytest.raises(AttributeError):
                stats.workers = 3  # type: ignore[misc]
            for n in range(3):
                tg.start_soon(p.apply, funcs.pool_gate, (n, gate.address))
            await gate.ready(2)
            stats = p.statistics()
            assert (stats.workers, stats.idle, stats.busy, stats.running, stats.queued) == (
                2,
                0,
                2,
                2,
                1,
            )
            gate.release()
            await gate.ready(3)
            gate.release(2)
        stats = p.statistics()
        assert stats.completed == 3 and stats.workers == 0


async def test_numpy_arrays_in_arguments_and_results() -> None:
    arr = np.arange(100_000, dtype=np.float64).reshape(100, 1000)
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            out = await p.apply(funcs.pool_np_double, (arr,))
            np.testing.assert_array_equal(out, arr * 2)
            outs = await p.map(funcs.pool_np_double, [arr[i] for i in range(4)])
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o, arr[i] * 2)


@asyncio_only
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_start_methods(method: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2, start_method=method) as p:
            assert await p.map(funcs.pool_square, range(6)) == [x * x for x in range(6)]
            assert await p.apply(funcs.pool_async_square, (3,)) == 9
            # workers may start processes of their own
            assert await p.apply(funcs.pool_is_daemon) is False


@asyncio_only
async def test_a_sync_worker_does_not_load_an_event_loop() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, grace_period=GRACE) as p:  # spawn: a clean interpreter
            modules = await p.apply(funcs.pool_modules)
            assert "asyncio" not in modules and "anyio" not in modules
            await p.apply(funcs.pool_async_square, (2,))
            modules = await p.apply(funcs.pool_modules)
            assert "asyncio" in modules and "anyio" not in modules


@asyncio_only
async def test_misuse() -> None:
    with pytest.raises(ValueError, match="processes"):
        aiomp.Pool(0)
    with pytest.raises(ValueError, match="concurrency"):
        aiomp.Pool(1, concurrency=0)
    with pytest.raises(ValueError, match="maxtasksperchild"):
        aiomp.Pool(1, maxtasksperchild=0)
    with pytest.raises(ValueError, match="start_method"):
        aiomp.Pool(1, start_method="thread")
    lock = threading.Lock()
    with pytest.raises(pickle.PicklingError, match="initializer"):
        aiomp.Pool(1, initializer=lambda: lock)
    p = pool(1)
    with pytest.raises(RuntimeError, match="not started"):
        await p.apply(funcs.pool_square, (1,))
    with anyio.fail_after(TIMEOUT):
        async with p:
            with pytest.raises(ValueError, match="chunksize"):
                await p.map(funcs.pool_square, [1], chunksize=0)
            with pytest.raises(ValueError, match="buffersize"):
                p.imap(funcs.pool_square, [1], buffersize=0)
    with pytest.raises(RuntimeError, match="closed"):
        p.imap(funcs.pool_square, [1])
    with pytest.raises(RuntimeError, match="once"):
        async with p:
            pass


def test_public_names() -> None:
    assert aiomp.Pool.__module__ == "aiomp"
    with pytest.warns(RuntimeWarning, match="never awaited or entered"):  # issue 31 item 1
        assert "aiomp.Pool" in repr(aiomp.Pool(1))
        gc.collect()
    assert issubclass(aiomp.BrokenWorkerError, aiomp.ProcessExitedException)


# -- examples ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("example", ["pool_service.py", "pool_pipeline.py"])
def test_examples_run(example: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    proc = run_python(f"examples/{example}", env=env)
    assert "ok" in proc.stdout.split()


# -- the wire: functions sent once per worker ------------------------------------------


@pytest.fixture
def ghost() -> Iterator[Callable[[], int]]:
    """A function of a module that exists only in this process: it pickles here, by
    reference, and cannot be unpickled in a worker."""
    mod = types.ModuleType("aiomp_test_ghost_module")

    def ghost_fn() -> int:
        return 1

    ghost_fn.__module__ = mod.__name__
    ghost_fn.__qualname__ = ghost_fn.__name__ = "ghost_fn"
    mod.ghost_fn = ghost_fn  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield ghost_fn
    del sys.modules[mod.__name__]


async def test_a_function_the_worker_cannot_load_fails_each_of_its_tasks(
    ghost: Callable[[], int],
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            for _ in range(2):  # the second task names the function the worker failed on
                with pytest.raises(ModuleNotFoundError, match="aiomp_test_ghost_module") as info:
                    await p.apply(ghost)
                assert "could not be unpickled in the worker" in str(info.value.__cause__)
            assert await p.apply(funcs.pool_square, (3,)) == 9


async def test_a_function_is_sent_to_each_worker_once() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pool_pid)
            for _ in range(3):
                assert await p.apply(funcs.pool_pid) == pid
            assert await p.map(funcs.pool_square, range(4)) == [0, 1, 4, 9]
            (w,) = p._engine.handles
            assert set(w.fns) == {
                _tasks.fn_info(funcs.pool_pid).fid,
                _tasks.fn_info(funcs.pool_square).fid,
            }


async def test_a_replacement_worker_is_taught_the_function_again() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            assert await p.apply(funcs.pool_square, (2,)) == 4
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.pool_exit, (3,))
            assert await p.apply(funcs.pool_square, (5,)) == 25


async def test_other_callables_travel_with_their_current_state() -> None:
    class Box:
        value = 1

        def get(self) -> int:
            return self.value

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert await p.apply(functools.partial(funcs.pool_add, 1), (2,)) == 3
            assert await p.apply(functools.partial(funcs.pool_add, 1, c=10), (2,)) == 13
            assert await p.apply(operator.add, (2, 3)) == 5
            assert await p.apply((7).__add__, (1,)) == 8
            assert await p.apply(funcs.pool_add, (1, 2), {"c": 3}) == 6
            assert await p.starmap(funcs.pool_add, [(1, 2), (3, 4)]) == [3, 7]
            # A local class: by value (issue 29; it was refused), with its current state.
            box = Box()
            box.value = 5
            assert await p.apply(box.get) == 5
            box.value = 6
            assert await p.apply(box.get) == 6


# -- the hot paths (issue 17) ------------------------------------------------------------


def test_a_whole_frame_is_read_without_buffering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17 (the ``apply`` round trip): a frame that arrives whole and without fds is
    returned as read. Linux echoes ``MSG_CMSG_CLOEXEC`` back in ``recvmsg``'s flags, and
    the fast path took any flag for trouble, so every message of the round trip, in the
    pool and in the worker, went through the stream's buffer."""
    a, b = socket.socketpair()
    chan = _transport.Stream(a)

    def absorb(*_: object) -> None:
        raise AssertionError("a whole frame went through the buffer")

    monkeypatch.setattr(_transport.Stream, "_absorb", absorb)
    try:
        for tid, recv in ((1, chan.try_recv), (2, chan.recv_sync)):
            b.send(P.framed(P.OP_OK, tid, 0, pickle.dumps(None)))
            got = recv()
            assert got is not None
            assert P.unpack(*got)[:2] == (P.OP_OK, tid)
    finally:
        chan.close()
        b.close()


@asyncio_only
async def test_map_slices_its_input_and_places_each_chunks_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list, tuple or range is sliced chunk by chunk, never copied whole, and a range's
    chunks stay ranges (a few bytes each on the wire); each chunk's results land in their
    place in the result list as they come, whatever order the chunks finish in."""
    sent: list[type] = []
    make_task = _calls.make_task

    def spy(pool: Any, fn: Any, info: Any, flags: int, items: Any, *args: Any, **kw: Any) -> Any:
        sent.append(type(items))
        return make_task(pool, fn, info, flags, items, *args, **kw)

    monkeypatch.setattr(_calls, "make_task", spy)
    r = range(3, 3000, 7)
    squares = [x * x for x in r]
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert await p.map(funcs.pool_square, r) == squares
            assert set(sent) == {range} and len(sent) == 8
            assert await p.map(funcs.pool_square, tuple(r), chunksize=13) == squares
            assert await p.map(funcs.pool_square, list(r), chunksize=100) == squares
            assert await p.starmap(funcs.pool_add, [(x, 1) for x in r]) == [x + 1 for x in r]
            # A sync function that returns coroutines: each is awaited in the worker.
            assert await p.map(funcs.pool_returns_coroutine, range(5), chunksize=2) == [
                0,
                1,
                4,
                9,
                16,
            ]
