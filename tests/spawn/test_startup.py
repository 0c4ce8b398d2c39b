"""What a spawn costs per child at start and at exit, and what it must still do.

Deterministic guards of docs/decisions/0017-spawn-start-up.md,
docs/decisions/0018-one-waiter-per-spawn.md and docs/decisions/0020-output-forwarding.md: calls per
child, not timings. On asyncio, uvloop and
trio; every await on a child bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import socket
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._loop.fdset import FdSet
from aiomp._output import forwarder as _output
from aiomp._process import child as _child
from aiomp._spawn import api as _api
from aiomp._spawn import spawned as _spawned
from aiomp._wire import datagram as _transport
from tests._gate import Gate
from tests.children import common as funcs
from tests.children import spawn as funcs_fork2

TIMEOUT = 20
GRACE = 0.5

pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


@pytest.mark.anyio
async def test_forkserver_children_are_reaped_without_multiprocessing_selector(
    gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 17): every reap of a forkserver child went through
    multiprocessing's ``Popen.poll``, which builds a selector to ask whether the sentinel
    is readable, although the join's epoll had just said so. Now the status is read
    directly, and ``process.exitcode`` agrees."""
    calls: list[object] = []
    wait = multiprocessing.connection.wait

    def counting_wait(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return wait(*args, **kw)

    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.wait_then_return, 4, args=(gate.address,), start_method="forkserver"
        ) as ctx:
            await gate.ready(4)  # started: no more starts (whose cleanup polls) from here
            monkeypatch.setattr(multiprocessing.connection, "wait", counting_wait)
            gate.release(0, 1, 2, 3)
    assert ctx.results == [0, 10, 20, 30]
    assert calls == []
    assert [p.exitcode for p in ctx.processes] == [0, 0, 0, 0]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_a_payload_without_fds_travels_in_the_start(
    start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``(fn, args)`` without fds, up to INLINE_START, goes with each child's start: no
    send per child in the parent, no receive in the child. One that holds fds (a body
    over 64 KiB rides in a memfd), or a larger one, is still sent on the report socket."""
    sends: list[int] = []
    send_async = _transport.send_async

    async def counting_send(sock: socket.socket, datagram: bytes, fds: list[int]) -> None:
        sends.append(len(fds))
        await send_async(sock, datagram, fds)

    monkeypatch.setattr(_transport, "send_async", counting_send)
    big = b"x" * (_transport.MAX_INLINE + 1)
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 3, args=("a",), start_method=start_method) as ctx:
            pass
        assert ctx.results == [(0, ("a",)), (1, ("a",)), (2, ("a",))]
        assert sends == []
        async with aiomp.spawn(funcs.echo, 2, args=(big,), start_method=start_method) as ctx:
            pass
        assert ctx.results == [(0, (big,)), (1, (big,))]
        assert sends == [1, 1]  # the memfd
        # Too large to ride in the start (a spawn start writes it to a pipe that its child
        # reads only once booted: past 64 KiB that write would block the loop), too small
        # for a memfd: sent on the report socket.
        middling = b"m" * (_api.INLINE_START + 1)
        async with aiomp.spawn(funcs.echo, 2, args=(middling,), start_method=start_method) as ctx:
            pass
    assert ctx.results == [(0, (middling,)), (1, (middling,))]
    assert sends == [1, 1, 0, 0]


@pytest.mark.anyio
async def test_a_forkserver_child_reaped_before_its_pidfd_is_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With its payload in its start, a forkserver child can run, exit and be reaped by
    the fork server before the parent opens its pidfd (seen at load 16: the start raised
    ProcessLookupError). Forced here: the pidfd is opened only once the server has
    written the child's status. The child is then watched by its sentinel alone."""
    pidfd_open = os.pidfd_open

    def late_pidfd_open(pid: int, flags: int = 0) -> int:
        procs = [p for p in multiprocessing.process._children if p.pid == pid]  # type: ignore[attr-defined]
        if procs:
            ready, _, _ = select.select([procs[0].sentinel], [], [], TIMEOUT)
            assert ready, "the child did not exit"
        return pidfd_open(pid, flags)

    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 1, start_method="forkserver"):
            pass  # the fork server is up
        monkeypatch.setattr(os, "pidfd_open", late_pidfd_open)
        async with aiomp.spawn(funcs.echo, 2, start_method="forkserver") as ctx:
            assert [c.pidfd for c in ctx._children] == [-1, -1]
            await ctx.terminate()  # nothing to signal: nothing breaks
    assert ctx.results == [(0, ()), (1, ())]
    assert [p.exitcode for p in ctx.processes] == [0, 0]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_clean_childs_report_waits_for_its_exit(start_method: str, gate: Gate) -> None:
    """A child that succeeded costs one wake-up, at its exit: its report, readable
    long before, is read then, not when it arrives (the socket is watched for its
    hang-up). Before: the join woke for the report as soon as it was readable."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_fork2.return_then_hold_exit,
            1,
            args=(gate.address,),
            start_method=start_method,
        ) as ctx:
            await gate.ready(1)
            child = ctx._children[0]
            assert child.sock is not None
            await anyio.wait_readable(child.sock)  # the report is there
            for _ in range(3):
                await anyio.lowlevel.checkpoint()  # turns of the loop, for the join to (not) wake
            assert child.outcome is None
            gate.release(0)
    assert ctx.results == [0]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_an_error_reaches_the_parent_while_the_child_and_a_grandchild_hold_on(
    start_method: str, gate: Gate
) -> None:
    """The child reports its error, then never exits (a non-daemon thread), and a
    grandchild holds a copy of its report socket: there is no exit and no last close to
    hear. The child ends the socket's sending side after its report, so the error still
    ends the block; the child, exiting on its own, is SIGKILLed once the grace period
    has passed (issue 31 item 3: a child that reported its error gets no SIGTERM), and
    the grandchild with it (its process group: issue 25 item 5)."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException, match="rank 0 failed"):
            async with aiomp.spawn(
                funcs_fork2.raise_with_a_grandchild_and_hang,
                1,
                args=(gate.address,),
                start_method=start_method,
                grace_period=GRACE,
            ) as ctx:
                await anyio.sleep_forever()
        assert [p.exitcode for p in ctx.processes] == [-signal.SIGKILL]
        grandchild = (await gate.ready(2))[100]
        try:
            fd = os.pidfd_open(grandchild)
        except ProcessLookupError:
            return  # gone already, and reaped by init
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)


def test_the_forwarder_sets_up_a_pair_in_three_syscalls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of a child's three output socket pairs costs its ``socketpair``, one
    ``shutdown`` (the child's reads see EOF) and one ``setsockopt`` (the child's send
    buffer); before, also a ``setblocking``, a second ``shutdown`` and a receive-buffer
    ``setsockopt`` nobody used: 9 syscalls fewer per child."""
    calls: list[str] = []
    for name in ("setsockopt", "shutdown", "setblocking", "settimeout"):
        real = getattr(socket.socket, name)

        def counted(self: socket.socket, *args: Any, _name: str = name, _real: Any = real) -> Any:
            calls.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(socket.socket, name, counted)
    fw = _output.Forwarder(0, "prefix")
    try:
        assert sorted(calls) == ["setsockopt"] * 3 + ["shutdown"] * 3
        out, err, _, records, _ = fw.child_ends()
        for end in (out, err, records):
            assert end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 4 << 20
            assert end.recv(1) == b""  # the child's reads see EOF
    finally:
        fw.close()


def test_join_registers_for_exit_and_hang_up_one_shot() -> None:
    """The fd set's epoll registrations: a child's exit fd for input, its report socket
    for its hang-up, both one-shot (a fired fd leaves the set with no epoll_ctl)."""
    assert _child.EXIT_EVENTS == select.EPOLLIN
    assert _spawned.REPORT_EVENTS == select.EPOLLRDHUP
    fds = FdSet()
    r, w = os.pipe()
    try:
        fds.add(r, _child.EXIT_EVENTS, lambda: False)
        assert fds._sources[r][0] == select.EPOLLIN | select.EPOLLONESHOT
    finally:
        os.close(r)
        os.close(w)
