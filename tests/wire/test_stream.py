"""The stream channel (``aiomp._wire.stream``: the Pool's worker channel): framing, end of
stream, a full buffer, async receives, on a socket pair in this process (no child)."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Iterator

import anyio
import pytest

import aiomp
from aiomp._wire import datagram as t
from aiomp._wire import stream as st
from tests._fds import devnulls, same_file


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
