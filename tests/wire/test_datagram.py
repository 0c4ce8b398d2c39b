"""The datagram channel (``aiomp._wire.datagram``): framing (pure), and a socket pair in
this process.

No child processes: the kernel behaviour the queue relies on (one datagram to one reader,
fds riding with it, EOF after shutdown, truncation) is all visible on an in-process
``socketpair()``. R1 in docs/architecture.md (typed errors, bounded fds).
"""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator

import anyio
import pytest

import aiomp
from aiomp._wire import datagram as t
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
