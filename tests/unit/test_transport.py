"""The message channel: framing (pure), and a socket pair in this process.

No child processes: the kernel behaviour the queue relies on (one datagram to one reader,
fds riding with it, EOF after shutdown, truncation) is all visible on an in-process
``socketpair()``. R1 in docs/architecture.md (typed errors, bounded fds).
"""

from __future__ import annotations

import fcntl
import os
import resource
import socket
import threading
from collections.abc import Iterator

import anyio
import pytest

import aiomp
from aiomp._loop import readers as rd
from aiomp._wire import datagram as t
from aiomp._wire import stream as st
from aiomp._wire.pickling import Message
from tests._fds import devnulls, is_open, same_file


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = t.socketpair()
    yield a, b
    a.close()
    b.close()


async def recv_async(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Receive one datagram, waiting on the event loop while empty."""
    while (got := t.try_recv(sock)) is None:
        await anyio.wait_readable(sock)
    return got


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


# -- framing (pure) ------------------------------------------------------------------------


def test_large_header_is_kind_and_size() -> None:
    assert t.large_header(70_000) == bytes((t.KIND_LARGE,)) + (70_000).to_bytes(8, "little")


def test_a_memfd_body_decodes_and_is_consumed() -> None:
    body = os.urandom(t.MAX_INLINE + 1)
    fd = t.memfd_with(body)
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:aiomp-msg")
    kind, decoded, rest = t.decode(t.large_header(len(body)), [fd])
    assert (kind, bytes(decoded), rest) == (t.KIND_DATA, body, [])
    assert not is_open(fd), "decode consumes the LARGE body's memfd"


def test_other_kinds_pass_through() -> None:
    kind, body, fds = t.decode(bytes((2,)), [])
    assert (kind, bytes(body), fds) == (2, b"", [])


def test_close_fds_tolerates_closed_fds() -> None:
    fd = devnulls(1)[0]
    os.close(fd)
    t.close_fds([fd, fd])  # no error


# -- a socket pair in this process ---------------------------------------------------------


def roundtrip(
    pair: tuple[socket.socket, socket.socket], body: bytes, fds: list[int]
) -> tuple[bytes, list[int]]:
    a, b = pair
    with Message(body, fds) as msg:
        assert t.send_sync(a, *msg.datagram(), deadline=None)
    got = t.recv_sync(b)
    assert got is not None
    kind, decoded, rest = t.decode(*got)
    assert kind == t.KIND_DATA
    return bytes(decoded), rest


@pytest.mark.parametrize("size", [0, 10, t.MAX_INLINE, t.MAX_INLINE + 1, 1 << 20])
def test_roundtrip_bodies(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    body = os.urandom(size)
    assert roundtrip(pair, body, []) == (body, [])


@pytest.mark.parametrize("size", [10, 1 << 20])
def test_roundtrip_with_the_most_fds(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    # One message carries at most MAX_FDS: the caller's plus a LARGE body's memfd.
    n = t.MAX_FDS - (1 if size > t.MAX_INLINE else 0)
    sent = devnulls(n)
    try:
        body = os.urandom(size)
        got, received = roundtrip(pair, body, sent)
        try:
            assert got == body
            assert len(received) == n
            assert set(received).isdisjoint(sent), "the receiver gets fds of its own"
            assert all(same_file(s, r) for s, r in zip(sent, received, strict=True))
            assert all(os.get_inheritable(fd) is False for fd in received)  # MSG_CMSG_CLOEXEC
        finally:
            t.close_fds(received)
    finally:
        t.close_fds(sent)


def test_fds_stay_in_order_and_with_their_message(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    files = [os.memfd_create(f"m{i}", os.MFD_CLOEXEC) for i in range(3)]
    try:
        assert t.try_send(a, b"\x00first", [files[0], files[1]])
        assert t.try_send(a, b"\x00none", [])
        assert t.try_send(a, b"\x00second", [files[2]])
        out = []
        while (got := t.try_recv(b)) is not None:
            out.append(got)
        assert [d for d, _ in out] == [b"\x00first", b"\x00none", b"\x00second"]
        assert [len(f) for _, f in out] == [2, 0, 1]
        received = [fd for _, fds in out for fd in fds]
        assert all(same_file(s, r) for s, r in zip(files, received, strict=True))
        t.close_fds(received)
    finally:
        t.close_fds(files)


def test_more_fds_than_the_kernel_allows_fail_at_send(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    fds = devnulls(t.MAX_FDS + 1)
    try:
        with pytest.raises(OSError):
            t.try_send(a, b"\x00x", fds)
        assert t.try_recv(b) is None, "nothing was sent"
    finally:
        t.close_fds(fds)


def test_empty_socket_and_deadlines(pair: tuple[socket.socket, socket.socket]) -> None:
    import time

    _, b = pair
    assert t.try_recv(b) is None
    start = time.monotonic()
    assert t.recv_sync(b, deadline=start + 0.05) is None
    assert time.monotonic() - start >= 0.05
    assert t.recv_sync(b, deadline=start - 1) is None  # a deadline already passed: one look


def test_full_buffer(pair: tuple[socket.socket, socket.socket]) -> None:
    import time

    a, b = pair
    datagram = b"\x00" + bytes(t.MAX_INLINE)
    sent = 0
    while t.try_send(a, datagram, []):
        sent += 1
        assert sent < 10_000, "the send buffer never filled"
    assert sent >= 16, "the buffers were not grown (a queue would hold a few items only)"
    assert t.send_sync(a, datagram, [], deadline=time.monotonic() + 0.02) is False
    assert t.try_recv(b) is not None
    assert t.send_sync(a, datagram, [], deadline=time.monotonic() + 5) is True


def test_eof_is_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    assert t.try_send(a, b"\x00last", [])
    a.shutdown(socket.SHUT_WR)
    assert t.recv_sync(b) == (b"\x00last", [])
    with pytest.raises(t.Closed):
        t.try_recv(b)
    with pytest.raises(t.Closed):
        t.recv_sync(b)
    with pytest.raises(t.Closed):  # sending on the shut-down end
        t.try_send(a, b"\x00more", [])


def test_send_to_a_closed_peer_is_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.close()
    with pytest.raises(t.Closed):
        t.try_send(a, b"\x00x", [])


def test_truncated_message_is_a_typed_error(pair: tuple[socket.socket, socket.socket]) -> None:
    # A well-behaved sender never sends more than MAX_INLINE + 1 bytes; a corrupt one may.
    a, b = pair
    fd = devnulls(1)[0]
    try:
        before = len(os.listdir("/proc/self/fd"))
        a.sendmsg(
            [b"\x00" + bytes(t.MAX_INLINE + 100)],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))],
        )
        with pytest.raises(aiomp.TransportError, match="truncated"):
            t.try_recv(b)
        assert len(os.listdir("/proc/self/fd")) == before, "its fds were closed"
        assert t.try_recv(b) is None, "the truncated message is gone, the channel usable"
    finally:
        os.close(fd)


def test_fds_beyond_the_fd_limit_are_a_typed_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    # R1: torch fails with "received 0 items of ancdata"; aiomp says what happened.
    a, b = pair
    sent = devnulls(10)
    try:
        assert t.try_send(a, b"\x00with fds", sent)
        assert t.try_send(a, b"\x00after", [])
    finally:
        t.close_fds(sent)
    before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # fds are numbered from the lowest free one: room for 3 of the 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd() + 3, hard))
    try:
        with pytest.raises(aiomp.TransportError, match="fd limit") as info:
            t.try_recv(b)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert info.value.errno == 24  # EMFILE
    assert len(os.listdir("/proc/self/fd")) == before, "the fds that did arrive were closed"
    assert t.try_recv(b) == (b"\x00after", []), "the next message is intact"


def test_memfd_body_without_memory_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(aiomp.TransportError, match="no memory"):
        t.memfd_with(bytes(t.MAX_INLINE + 1))
    assert len(os.listdir("/proc/self/fd")) == before, "the memfd was closed"


# -- async (asyncio, uvloop, trio) ---------------------------------------------------------


@pytest.mark.anyio
async def test_async_roundtrip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fds = devnulls(3)
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                got: list[tuple[bytes, list[int]]] = []

                async def receive() -> None:
                    for _ in range(2):
                        got.append(await recv_async(b))

                tg.start_soon(receive)
                await anyio.wait_all_tasks_blocked()  # the receiver waits on the loop
                await t.send_async(a, b"\x00one", fds)
                await t.send_async(a, b"\x00two", [])
        assert [d for d, _ in got] == [b"\x00one", b"\x00two"]
        assert len(got[0][1]) == 3 and got[1][1] == []
        t.close_fds(got[0][1])
    finally:
        t.close_fds(fds)


@pytest.mark.anyio
async def test_async_send_waits_for_room(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    datagram = b"\x00" + bytes(t.MAX_INLINE)
    sent = 0
    while t.try_send(a, datagram, []):
        sent += 1
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.send_async, a, b"\x00last", [])
            await anyio.wait_all_tasks_blocked()
            for _ in range(sent):
                assert t.try_recv(b) == (datagram, [])
        assert await recv_async(b) == (b"\x00last", [])


@pytest.mark.anyio
async def test_async_recv_cancelled_consumes_nothing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    with anyio.move_on_after(0.02):  # handshake-free: the point is that nothing arrives
        await recv_async(b)
        pytest.fail("nothing was sent")
    assert t.try_send(a, b"\x00x", [])
    with anyio.fail_after(5):
        assert await recv_async(b) == (b"\x00x", [])


@pytest.mark.anyio
async def test_async_recv_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                with pytest.raises(t.Closed):
                    await recv_async(b)

            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            a.shutdown(socket.SHUT_WR)


# -- stream channels (st.Stream: the Pool's worker channel) ----------------------


@pytest.fixture
def stream_pair() -> Iterator[tuple[st.Stream, st.Stream]]:
    a, b = st.stream_socketpair()
    sa, sb = st.Stream(a), st.Stream(b)
    yield sa, sb
    sa.close()
    sb.close()


def send(s: st.Stream, datagram: bytes, fds: list[int] | None = None) -> None:
    fds = fds or []
    s.send_sync(st.frame(datagram, len(fds)), fds)


# -- framing ---------------------------------------------------------------------------------


def test_frame_is_length_and_fd_count() -> None:
    framed = st.frame(b"\x00abc", 2)
    assert st.FRAME.unpack_from(framed) == (4, 2)
    assert framed[st.FRAME_SIZE :] == b"\x00abc"


def test_messages_arrive_whole_in_order(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    bodies = [b"\x00" + os.urandom(n) for n in (0, 1, 100, 5000, t.MAX_INLINE)]
    for body in bodies:
        send(a, body)
    # all of them may come in one read: each is still handed out alone
    got = [b.recv_sync() for _ in bodies]
    assert got == [(body, []) for body in bodies]
    assert b.try_recv() is None


def test_frames_split_anywhere_are_reassembled(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    data = st.frame(b"\x00first") + st.frame(b"\x00second" * 50)
    for i in range(len(data)):  # one byte per write: every possible split
        a.sock.send(data[i : i + 1])
        got = b.try_recv()
        if i < len(st.frame(b"\x00first")) - 1:
            assert got is None
        elif i == len(st.frame(b"\x00first")) - 1:
            assert got == (b"\x00first", [])
        elif i < len(data) - 1:
            assert got is None
    assert got == (b"\x00second" * 50, [])


def test_a_frame_larger_than_one_read(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    body = b"\x00" + os.urandom(5 * st._STREAM_RECV_SIZE)
    threading.Thread(target=send, args=(a, body)).start()  # larger than what one read takes
    assert b.recv_sync(deadline=None) == (body, [])


def test_fds_stay_with_their_message(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    sent = [devnulls(n) for n in (2, 0, 1, 0, 3)]
    try:
        for i, fds in enumerate(sent):
            send(a, b"\x00" + bytes([i]), fds)
        for i, fds in enumerate(sent):
            body, got = b.recv_sync()  # type: ignore[misc]
            assert body == b"\x00" + bytes([i])
            assert len(got) == len(fds)
            assert all(same_file(x, y) for x, y in zip(got, fds, strict=True))
            t.close_fds(got)
    finally:
        for fds in sent:
            t.close_fds(fds)


def test_unclaimed_fds_are_closed_with_the_stream() -> None:
    a, b = st.stream_socketpair()
    sa, sb = st.Stream(a), st.Stream(b)
    count = len(os.listdir("/proc/self/fd"))
    fds = devnulls(2)
    # half a frame and its fds: the receiver holds both, waiting for the rest
    assert sa.try_send(st.frame(b"\x00two" * 10, 2)[:9], fds) == 9
    t.close_fds(fds)
    assert sb.try_recv() is None
    assert len(os.listdir("/proc/self/fd")) == count + 2
    sb.close()
    sa.close()
    assert len(os.listdir("/proc/self/fd")) == count - 2


# -- end of stream -----------------------------------------------------------------------------


def test_stream_eof_is_closed(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    send(a, b"\x00last")
    a.sock.shutdown(socket.SHUT_WR)
    assert b.recv_sync() == (b"\x00last", [])
    with pytest.raises(t.Closed):
        b.recv_sync()


def test_eof_in_the_middle_of_a_frame_is_closed(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    a.sock.send(st.frame(b"\x00cut short")[:8])
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(t.Closed):
        b.recv_sync()


def test_stream_send_to_a_closed_peer_is_closed(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    b.close()
    with pytest.raises(t.Closed):
        send(a, b"\x00x")
    with pytest.raises(t.Closed):
        a.try_send(st.frame(b"\x00x"), [])


def test_deadline(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    _, b = stream_pair
    assert b.recv_sync(deadline=0) is None


# -- a full buffer ------------------------------------------------------------------------------


def test_try_send_says_how_much_went(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    body = b"\x00" + bytes(t.MAX_INLINE)
    framed = st.frame(body)
    fds = devnulls(1)
    try:
        assert a.try_send(st.frame(body, 1), fds) == len(framed)
        while (n := a.try_send(framed, [])) == len(framed):
            pass
        assert 0 <= n < len(framed)
        assert a.try_send(st.frame(body, 1), fds) == 0  # full: nothing went, fds included
        rest = memoryview(framed)[n:]

        def finish() -> None:
            view = rest
            while view:
                sent = a.try_send(view, [])
                view = view[sent:]
                if not sent:
                    t.wait_fd_sync(a.fileno(), write=True)
            send(a, b"\x00after")

        th = threading.Thread(target=finish)
        th.start()
        first = b.recv_sync()
        assert first is not None and len(first[1]) == 1
        t.close_fds(first[1])
        while (got := b.recv_sync()) != (b"\x00after", []):
            assert got == (framed[st.FRAME_SIZE :], [])
        th.join()
    finally:
        t.close_fds(fds)


def test_send_sync_on_a_non_blocking_socket_waits_for_room(
    stream_pair: tuple[st.Stream, st.Stream],
) -> None:
    # uvloop makes the sockets it watches non-blocking; send_sync must still send it all.
    a, b = stream_pair
    flags = fcntl.fcntl(a.fileno(), fcntl.F_GETFL)
    fcntl.fcntl(a.fileno(), fcntl.F_SETFL, flags | os.O_NONBLOCK)
    body = b"\x00" + os.urandom(t.MAX_INLINE)
    count = 200  # about 13 MiB: more than the socket buffers hold
    fds = devnulls(1)
    try:

        def produce() -> None:
            for _ in range(count):
                send(a, body, fds)

        th = threading.Thread(target=produce)
        th.start()
        for _ in range(count):
            got = b.recv_sync()
            assert got is not None and got[0] == body and len(got[1]) == 1
            t.close_fds(got[1])
        th.join()
    finally:
        t.close_fds(fds)


def test_receiving_at_the_fd_limit_is_a_typed_error(
    stream_pair: tuple[st.Stream, st.Stream],
) -> None:
    # R1. Unlike a datagram, a stream cannot drop one message and go on: once fds are lost
    # the frames and the fds are out of step, so the channel says so and is done.
    import resource

    a, b = stream_pair
    sent = devnulls(10)
    try:
        send(a, b"\x00with fds", sent)
    finally:
        t.close_fds(sent)
    before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd = os.dup(0)
    os.close(fd)  # the lowest free fd: fds are numbered from it; room for 3 of the 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 3, hard))
    try:
        with pytest.raises(aiomp.TransportError, match="fd limit") as info:
            b.recv_sync()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert info.value.errno == 24  # EMFILE
    assert len(os.listdir("/proc/self/fd")) == before, "the fds that did arrive were closed"


# -- async (asyncio, uvloop, trio) ---------------------------------------------------------------


@pytest.mark.anyio
async def test_async_recv(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            got: list[tuple[bytes, list[int]]] = []

            async def receive() -> None:
                for _ in range(3):
                    got.append(await b.recv_async())

            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            send(a, b"\x00one")
            # two frames in one write: the second is handed out without another read
            a.sock.send(st.frame(b"\x00two") + st.frame(b"\x00three"))
    assert got == [(b"\x00one", []), (b"\x00two", []), (b"\x00three", [])]


@pytest.mark.anyio
async def test_stream_async_recv_eof(stream_pair: tuple[st.Stream, st.Stream]) -> None:
    a, b = stream_pair
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                with pytest.raises(t.Closed):
                    await b.recv_async()

            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            a.sock.shutdown(socket.SHUT_WR)


# -- the reader kept on an asyncio loop (see docs/decisions/0005-kept-readers.md) ----------


async def loop_turns(n: int) -> None:
    """Let the event loop run ``n`` iterations: a waiter registers, a level-triggered
    report repeats. Handshake-free: the loop itself is what is tested, no child."""
    import asyncio

    for _ in range(n):
        await asyncio.sleep(0)  # handshake-free: one loop iteration is what is waited for


@pytest.fixture
def watched_pair() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """A datagram pair ``(a, b, b's fd)``; the fd is forgotten and both closed after."""
    a, b = t.socketpair()
    try:
        yield a, b, b.fileno()
    finally:
        rd.forget(b.fileno())
        a.close()
        b.close()


asyncio_loops = pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


@pytest.mark.anyio
@asyncio_loops
async def test_a_report_after_the_wake_neither_wakes_nor_drops_the_reader(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    """asyncio's own loop looks at its fds again after a waiter woke and before that
    waiter's step reads (the reader's callback is queued after the task's): the reader
    takes that one report for what it is and keeps watching; the old reader woke nobody
    only after a ``poll`` of its own per report."""
    import asyncio

    a, b, fd = watched_pair
    reports = 0

    async def get() -> tuple[bytes, list[int]] | None:
        nonlocal reports
        await rd.wait_readable(fd)
        reports = rd._readers[fd].idle
        return t.try_recv(b)  # as a queue's get does: read in the step that woke

    readers = []
    for i in range(3):
        waiter = asyncio.ensure_future(get())
        await loop_turns(3)  # the waiter registers and sleeps
        assert not waiter.done()
        assert t.try_send(a, bytes([0, i]), [])
        got = await asyncio.wait_for(waiter, 30)
        assert got == (bytes([0, i]), [])
        assert reports <= 1
        readers.append(rd._readers[fd])
    assert readers[0] is readers[1] is readers[2], "one reader for every wait"


@pytest.mark.anyio
@asyncio_loops
async def test_many_tasks_wait_on_one_kept_reader_and_a_cancelled_one_leaves(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    a, b, fd = watched_pair
    waiters = [asyncio.ensure_future(rd.wait_readable(fd)) for _ in range(3)]
    await loop_turns(3)
    reader = rd._readers[fd]
    assert len(reader.waiters) == 3
    waiters[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert len(reader.waiters) == 2, "the cancelled wait is gone from the reader"
    assert t.try_send(a, b"\x00x", [])
    await asyncio.wait_for(asyncio.gather(*waiters[1:]), 30)
    assert t.try_recv(b) is not None


@pytest.mark.anyio
@asyncio_loops
async def test_kept_reader_wakes_each_wait_and_stops_when_nobody_waits(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    a, b, fd = watched_pair

    async def get() -> tuple[bytes, list[int]] | None:
        await rd.wait_readable(fd)
        return t.try_recv(b)  # as a queue's get does: read in the step that woke

    readers = []
    for i in range(3):
        waiter = asyncio.ensure_future(get())
        await loop_turns(3)
        assert not waiter.done(), "nothing to read yet"
        assert t.try_send(a, bytes([0, i]), [])
        got = await asyncio.wait_for(waiter, 30)
        assert got is not None and got[0] == bytes([0, i])
        await loop_turns(3)  # a stale report of the datagram just read wakes nobody
        readers.append(rd._readers[fd])
    assert readers[0] is readers[1] is readers[2], "one reader for every wait"
    assert t.try_send(a, b"\x00x", [])
    await loop_turns(5)  # readable, and nobody waits: it stops watching
    assert fd not in rd._readers
    assert t.try_recv(b) is not None


@pytest.mark.anyio
@asyncio_loops
async def test_forget_stops_watching_and_closes_the_duplicate(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    _, _, fd = watched_pair
    waiter = asyncio.ensure_future(rd.wait_readable(fd))
    await loop_turns(1)
    waiter.cancel()  # a cancelled wait leaves only the idle watch
    with pytest.raises(asyncio.CancelledError):
        await waiter
    watched = rd._readers[fd].watched
    assert is_open(watched) and same_file(watched, fd)
    rd.forget(fd)
    assert fd not in rd._readers and not is_open(watched)
    rd.forget(fd)  # idempotent


def test_a_whole_frame_is_read_in_two_python_calls(
    stream_pair: tuple[st.Stream, st.Stream],
) -> None:
    """The Pool's round trip reads one whole frame per message on each side (the parent
    with ``try_recv``, a sync worker with ``recv_sync``): the call, and ``_read``, the one
    read with its fast path, which hands the frame back past the buffer (no ``take``)."""
    import sys

    a, b = stream_pair
    seen: list[str] = []

    def hook(frame: object, event: str, arg: object) -> None:
        if event == "call":
            seen.append(frame.f_code.co_name)  # type: ignore[attr-defined]

    for read in (b.try_recv, b.recv_sync):
        send(a, b"hello")
        seen.clear()
        sys.setprofile(hook)
        try:
            got = read()
        finally:
            sys.setprofile(None)
        assert got == (b"hello", [])
        assert seen == [read.__name__, "_read"], seen
        assert b.take() is None
