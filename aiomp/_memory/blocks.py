"""A block in a message: its wire form (:class:`BlockRef`), the handoff descriptions that
hold it while in flight, and the receiver's rebuild of it. The array reducers' surface.

Owns the fresh descriptions a message carries (one per segment and message, closed once
the message is sent). Under ``file_descriptor`` the message carries such a description
of the segment, which already holds a lease on the block (:func:`.lease.hold`): the block
stays held while the message is in flight, even if the sender exits first, and the
receiver takes a lease of its own before the message's description is closed. Under
``file_system`` the message names the segment instead and holds nothing, so the segment's
header page counts the references sent and opened (see :mod:`.segment`).

One array alone in a message skips the pickler (:func:`send_copy`, :func:`send_block`,
:func:`receive_block`): the same leases, a fresh description per message.

A *child* module.
"""

from __future__ import annotations

import errno
import os

from .._errors import SharedMemoryError
from .._wire import pickling as _reduction
from . import lease as _lease
from . import strategy as _strategy
from .fdlimit import open_fd
from .janitor import SHM_DIR
from .registry import REGISTRY, Exporter
from .segment import Segment


class BlockRef:
    """A block named inside a message; unpickles to the receiver's exporter of it."""

    __slots__ = ("index", "segment")

    def __init__(self, segment: Segment, index: int) -> None:
        self.segment = segment
        self.index = index

    def __reduce__(self) -> tuple[object, ...]:
        seg, index = self.segment, self.index
        if seg.name is not None:
            seg.count(index, sends=1)
            _reduction.on_unsent(lambda: seg.count(index, sends=-1))
            _reduction.on_copy(lambda: seg.count(index, sends=1))
            return _rebuild_block, (seg.name, -1, seg.size, seg.block_size, index, None)
        handoffs: dict[object, tuple[int, int]] = _reduction.current().once(BlockRef, dict)
        handoff = handoffs.get(seg.key)  # one description per segment and message
        if handoff is None:
            fd = open_fd(lambda: _lease.reopen(seg.fd), "a shared segment to send")
            _reduction.on_sent(lambda: os.close(fd))
            handoff = handoffs[seg.key] = (fd, _reduction.add_fd(fd))
        _lease.hold(handoff[0], seg.offset(index), seg.block_size)  # held while in flight
        return _rebuild_block, (None, handoff[1], seg.size, seg.block_size, index, seg.key)


def allocate(nbytes: int, *, zero: bool = False) -> Exporter:
    """A block of at least ``nbytes`` bytes in shared memory, held by this process.

    Returns its exporter: build arrays on it with ``numpy.ndarray(buffer=exporter)``.
    """
    return REGISTRY.allocate(nbytes, zero=zero)


def purge_pool() -> None:
    """Release every idle pooled segment (tests use it to check for leaks)."""
    REGISTRY.purge()


def block_of(exporter: object) -> BlockRef | None:
    """The block ``exporter`` stands for, if it is one of ours."""
    info = REGISTRY.info.get(id(exporter))
    if info is None or REGISTRY.exported((info[0].key, info[1])) is not exporter:
        return None
    return BlockRef(*info)


def _rebuild_block(
    name: str | None,
    fd_index: int,
    size: int,
    block_size: int,
    index: int,
    key: tuple[int, int] | None,
) -> Exporter:
    reg = REGISTRY
    with reg.lock:
        if name is None:
            # The key (device, inode) names the segment; the fd travelled with it in the
            # same datagram, so it cannot be another segment's.
            fd = _reduction.peek_fd(fd_index)
            key = _lease.identity(fd) if key is None else (key[0], key[1])
        else:
            fd = -1
            key = _named_key(name)
        exporter = reg.exported((key, index))
        if exporter is not None:
            if name is not None:
                reg.segments[key].count(index, opens=1)
            return exporter
        segment = reg.segments.get(key)
        if segment is None:
            segment = reg.segments[key] = _open_segment(name, fd, size, block_size)
        if segment.owned:
            reg.pool.reclaim(segment, index)
        else:
            _lease.hold(segment.fd, segment.offset(index), block_size)
        if name is not None:
            segment.count(index, opens=1)
        return reg.export(segment, index)


def _named_key(name: str) -> tuple[int, int]:
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        raise SharedMemoryError(
            errno.ENOENT,
            f"shared segment {name!r} is gone: its creator exited before this message "
            "was read (use the 'file_descriptor' strategy when senders may exit first)",
        ) from None
    return (st.st_dev, st.st_ino)


def _open_segment(name: str | None, fd: int, size: int, block_size: int) -> Segment:
    """A description and mapping of our own of a segment received (by fd or by name)."""
    if name is None:
        own = open_fd(lambda: _lease.reopen(fd), "a shared segment received")
    else:
        path = os.path.join(SHM_DIR, name)
        try:
            own = open_fd(
                lambda: os.open(path, os.O_RDWR | os.O_CLOEXEC), "a shared segment received"
            )
        except FileNotFoundError:
            raise SharedMemoryError(
                errno.ENOENT, f"shared segment {name!r} vanished before it was opened"
            ) from None
    try:
        return Segment(own, size, block_size, name, owned=False, populate=False)
    except BaseException:
        os.close(own)
        raise


def _handoff(segment: Segment, index: int) -> int:
    ranges = [(segment.offset(index), segment.block_size)]
    return open_fd(lambda: _lease.handoff_fd(segment.fd, ranges), "a shared segment to send")


def send_copy(data: memoryview) -> tuple[int, Segment, int] | None:
    """Copy ``data`` (bytes) into a fresh pooled block of a memfd segment, and hand it on.

    Returns ``(fd, segment, index)``: ``fd`` is a fresh description that holds the
    block's lease, for the message to carry and to close once sent; no view of the block
    is left here, so the block is reused once every receiver has let go. None under the
    ``file_system`` strategy (its names need the pickled path's counters).
    """
    if _strategy.current != "file_descriptor":
        return None
    pool = REGISTRY.pool
    segment, index = pool.lend(len(data))
    try:
        if segment.name is not None:  # another thread switched the strategy meanwhile
            return None
        at = segment.offset(index)
        segment.bytes()[at : at + len(data)] = data
        return _handoff(segment, index), segment, index
    finally:  # held by the description now (or by nobody, after an error)
        with REGISTRY.lock:
            pool.retire(segment, index)


def send_block(exporter: object) -> tuple[int, Segment, int] | None:
    """``(fd, segment, index)`` for the block ``exporter`` stands for: ``fd`` a fresh
    description holding its lease, as :func:`send_copy`. None if ``exporter`` is not a
    block of ours, or is one of a named segment."""
    info = REGISTRY.info.get(id(exporter))
    if info is None:
        return None
    segment, index = info
    if segment.name is not None or REGISTRY.exported((segment.key, index)) is not exporter:
        return None
    return _handoff(segment, index), segment, index


def receive_block(size: int, block_size: int, index: int, key: tuple[int, int]) -> Exporter:
    """The exporter of a block sent by :func:`send_copy` or :func:`send_block`, its
    description the message's only fd (left for :func:`aiomp._wire.pickling.loads` to close)."""
    return _rebuild_block(None, 0, size, block_size, index, key)
