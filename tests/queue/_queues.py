"""Helpers shared by the queue tests: bounds, a drain, the vault fillers, unpicklables."""

from __future__ import annotations

from typing import Any

import pytest

import aiomp
from aiomp._queue import queue as _queue
from aiomp._wire import datagram as _transport

#: Bound on every await that depends on a child. Generous: two shared cores, cold starts.
TIMEOUT = 20
#: Bound on awaits that depend on this process only.
QUICK = 5
GRACE = 0.5
#: A timeout the test waits out on purpose (sync twins).
SHORT = 0.05


def drain(q: aiomp.Queue) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except (aiomp.Empty, aiomp.QueueClosedError):
            return items


def fill_until_overflow(q: aiomp.Queue) -> int:
    """Put large-ish items until the socket buffer is full and the overflow is in use."""
    item = bytes(_transport.MAX_INLINE - 100)
    n = 0
    while _queue.overflow_of(q).count() == 0:
        q.put_nowait(item)
        n += 1
        assert n < 10_000, "the socket never filled"
    assert q.qsize() == n
    return n


def shrink_vault(q: aiomp.Queue) -> None:
    """Make the overflow's fd vault hold only a few items (its buffer at the minimum)."""
    import socket

    q._recv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)


def fill_vault(q: aiomp.Queue) -> list[aiomp.Event]:
    """Fill the socket, then the (shrunk) vault with items carrying an fd, until Full."""
    shrink_vault(q)
    fill_until_overflow(q)
    events = []
    with pytest.raises(aiomp.Full):
        while True:
            events.append(aiomp.Event())
            q.put_nowait(events[-1])
            assert len(events) < 1000, "the vault never filled"
    return events


# Each step of an overflow operation, and whether the item is in the queue when the
# process doing it dies there.
PRODUCER_STEPS = [
    ("producer: fds parked", False),
    ("producer: record written", False),
    ("producer: committed", True),
]
