"""The ``apply`` round trip's hot path: what each side runs per call, and that the short
paths keep every outcome of the general ones (see
docs/decisions/0027-apply-critical-path.md).

Guards are counts, not timings: the Python calls into aiomp's modules per ``apply`` in
the worker and in the parent, measured with ``sys.setprofile`` (deterministic, and
independent of the machine's load).
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest

import aiomp
from aiomp._pool import protocol as P
from tests.budgets import budgets as B
from tests.children import counting as f

TIMEOUT = 20
N = 200

pytestmark = pytest.mark.anyio

asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
asyncio_loops = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)


def pool(**kwargs: Any) -> aiomp.Pool:
    return aiomp.Pool(1, start_method="forkserver", grace_period=0.3, **kwargs)


@asyncio_only
async def test_a_worker_runs_fn_in_four_aiomp_calls() -> None:
    """The worker serves ``apply(fn)`` of a sync function it was sent once with four
    calls into aiomp: receive (two: the stream's read), run, send. Pins the hot path that
    replaced six (``P.unpack``, ``run_sync`` and ``P.framed`` per call)."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await p.apply(f.nothing)
            await p.apply(f.start_counting)
            for _ in range(N):
                await p.apply(f.nothing)
            counts = await p.apply(f.stop_counting)
    total = sum(counts.values())
    # The ends of the two counting tasks' own round trips are in the counts too.
    assert total <= B.CALLS["worker: per apply"] * N + 16, counts
    for role in (
        "worker: decode a task frame (general path)",
        "worker: run a sync task (general path)",
    ):
        assert B.count(counts, role) <= B.CALLS[role] * N + 2, (role, counts)


@asyncio_loops
async def test_the_parent_makes_at_most_16_aiomp_calls_per_apply() -> None:
    """``apply(fn)`` in the parent on asyncio and uvloop: at most 16 Python calls into
    aiomp per round trip, sending and receiving included (22 before the hot path was
    trimmed: ``fn_info``, ``_encode``, ``task_frame``, ``_cancel_pending``, ``unpack`` and
    ``_make_available`` each added a frame)."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            for _ in range(20):
                await p.apply(f.nothing)
            f.start_counting()
            try:
                for _ in range(N):
                    await p.apply(f.nothing)
            finally:
                counts = f.stop_counting()
    assert sum(counts.values()) <= B.CALLS["parent: per apply"] * N + 16, counts


def _voluntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/PID/status")


@asyncio_only
async def test_a_worker_sleeps_once_per_apply() -> None:
    """A worker blocks once per ``apply``: waiting for its next task. Pins the bug where
    it woke twice: its results went out on the socket it was blocked on, and the parent's
    read of each result woke it for the room the read freed (a unix socket's write-space
    wake-up is not filtered by what the sleeper waits for), a second wake-up of its idle
    core per round trip (1.8 to 2.0 voluntary context switches per apply, measured).

    The parent and the worker run on different cores, as the bug needs: on one core the
    worker is preempted by the parent it wakes before it goes back to sleep."""
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            (pid,) = p.pids()
            os.sched_setaffinity(pid, {cpus[1]})
            os.sched_setaffinity(0, {cpus[0]})
            try:
                for _ in range(20):
                    await p.apply(f.nothing)
                before = _voluntary_switches(pid)
                for _ in range(N):
                    await p.apply(f.nothing)
                switches = _voluntary_switches(pid) - before
            finally:
                os.sched_setaffinity(0, mine)
    assert switches < B.SYSCALLS["worker: sleeps per apply"] * N, switches


async def test_fn_results_errors_and_coroutines_on_the_short_path() -> None:
    """``apply(fn)`` with no arguments takes the worker's short path: a value, None, an
    exception (same type, the worker's traceback as its cause) and a returned coroutine
    (awaited in the worker) come back as from the general path."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            assert await p.apply(f.forty_two) == 42
            assert await p.apply(f.nothing) is None
            with pytest.raises(LookupError, match="refused") as info:
                await p.apply(f.refuse)
            assert isinstance(info.value.__cause__, P.RemoteTraceback)
            assert "refuse" in str(info.value.__cause__)
            assert await p.apply(f.coroutine) == "awaited"
            # The same functions with arguments take the general path, alike.
            assert await p.apply(f.forty_two, kwds={}) == 42
            assert await p.apply(max, (1, 2)) == 2


@asyncio_only
async def test_a_submitted_task_on_a_broken_pool_fails_without_waiting() -> None:
    """A task the scheduler fails at once (here: a pool broken between the call's check
    and its submission) returns its error without awaiting a future nobody would set.
    (A list argument makes it a pickled message, which is submitted: a small frame sent
    first has nothing between the check and its send.)"""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await p.apply(f.nothing)
            sched = p._engine.sched
            submit = sched.submit

            def break_then_submit(task: Any) -> None:
                sched.break_pool(RuntimeError("broken meanwhile"))
                submit(task)

            sched.submit = break_then_submit  # type: ignore[method-assign]
            try:
                with pytest.raises(aiomp.BrokenPoolError, match="broken meanwhile"):
                    await p.apply(sorted, ([3, 1],))
            finally:
                del sched.submit


def test_no_argument_frame_is_the_general_frame() -> None:
    """``P.noargs_task`` packs the same bytes as ``P.task_frame`` with no pickle."""
    for tid, flags, fid in ((1, P.F_APPLY | P.F_NOARGS, 7), (2**63, 13, 2**32 - 1)):
        assert P.noargs_task(tid, flags, fid) == P.task_frame(tid, flags, fid, b"")


@asyncio_loops
async def test_apply_sends_before_it_makes_its_task() -> None:
    """``apply(fn)`` to an idle worker that knows ``fn`` sends its frame first and makes
    its Task (and the scheduler's record of it) after, while the worker wakes (see
    docs/decisions/0027-apply-critical-path.md); the first call to a worker, which must send
    the function's DEF first, is submitted as before. Results are unchanged."""
    from aiomp._pool import tasks as _tasks

    events: list[str] = []
    init = _tasks.Task.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        events.append("task")
        init(self, *args, **kwargs)

    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            (handle,) = p._engine.handles
            send = handle._sock_send

            def recording_send(data: bytes, flags: int) -> int:
                events.append("send")
                return send(data, flags)

            handle._sock_send = recording_send  # type: ignore[method-assign]
            _tasks.Task.__init__ = recording_init  # type: ignore[method-assign]
            try:
                assert await p.apply(f.forty_two) == 42  # DEF first: submitted
                assert await p.apply(f.forty_two) == 42
                assert await p.apply(f.nothing) is None
                assert await p.apply(f.nothing) is None
            finally:
                _tasks.Task.__init__ = init  # type: ignore[method-assign]
                handle._sock_send = send  # type: ignore[method-assign]
    assert events == ["task", "send", "task", "task", "send", "task"], events


@asyncio_loops
async def test_apply_makes_at_most_three_aiomp_calls_before_its_send() -> None:
    """Between ``await pool.apply(fn)`` and the ``send`` of its frame, at most three
    Python calls into aiomp: ``apply``, the anyio cancel-scope check and
    ``ProcessHandle.try_send_now``: nothing (``make_task``, ``Task.__init__``,
    ``submit``, ``_start``, ``send``, ``try_send``) comes before the send."""
    import socket
    import sys
    import types

    seen: list[B.Key | str] = []

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(B.PACKAGE):
            seen.append(B.key(frame.f_code))
        elif event == "c_call" and isinstance(getattr(arg, "__self__", None), socket.socket):
            seen.append(f"<{arg.__name__}>")

    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            for _ in range(5):
                await p.apply(f.nothing)
            sys.setprofile(profile)
            try:
                await p.apply(f.nothing)
            finally:
                sys.setprofile(None)
    assert "<send>" in seen, seen
    before = seen[: seen.index("<send>")]
    assert len(before) <= B.CALLS["parent: apply before its send"], seen
    assert before[-1] == B.KEYS["parent: send apply's frame before its Task exists"], seen


@asyncio_only
async def test_try_send_now_declines_whenever_the_frame_must_wait() -> None:
    """``ProcessHandle.try_send_now`` sends nothing, and says so, when the worker lacks the
    function, frames wait in the outbox, the channel is closed or the socket is full;
    what it did send arrives whole and in order."""
    import socket
    import types

    from aiomp._pool import process_handle as _handle

    tasks_r, tasks_w = socket.socketpair()
    results_r, results_w = socket.socketpair()
    for s in (tasks_r, tasks_w, results_r, results_w):
        s.setblocking(False)
    events = types.SimpleNamespace(on_result=lambda *a: None)
    h = _handle.ProcessHandle(
        0,
        types.SimpleNamespace(pid=0),  # type: ignore[arg-type]
        tasks_w,
        results_r,
        None,
        0.3,
        events,  # type: ignore[arg-type]
    )
    try:
        frame = P.noargs_task(1, P.F_APPLY | P.F_NOARGS, 7)
        assert not h.try_send_now(frame, 7)  # no DEF of 7 sent yet
        h.fns[7] = None  # as if its DEF had been sent
        assert h.try_send_now(frame, 7)
        assert tasks_r.recv(100) == frame
        h._outbox.append(b"earlier")
        assert not h.try_send_now(frame, 7)  # it must not overtake the outbox
        h._outbox.clear()
        sent = 0
        while h.try_send_now(frame, 7):  # fill the socket buffer
            sent += 1
        assert not h._outbox and h._partial is None  # nothing of the refused one went
        got = b""
        while True:
            try:
                got += tasks_r.recv(1 << 16)
            except BlockingIOError:
                break
        assert got == frame * sent
        h.closed = True
        assert not h.try_send_now(frame, 7)
    finally:
        h.chan.close()
        h.results.close()
        for s in (tasks_r, results_w):
            s.close()
