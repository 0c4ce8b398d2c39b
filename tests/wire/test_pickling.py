"""Pickling aiomp messages: fds carried by index, cleanups, errors in the caller.

Pure: ``dumps`` and ``loads`` are called in this process, with ``os.dup`` standing in for
the fds that ``SCM_RIGHTS`` would deliver. R1 and R11 (errors at the call site,
no fd leaked on any path).
"""

from __future__ import annotations

import gc
import os
import pickle
import weakref

import numpy as np
import pytest

import aiomp
from aiomp._memory import blocks as _blocks
from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction
from tests._fds import devnulls, is_open


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def devnull() -> int:
    return devnulls(1)[0]


class FdBox:
    """Carries an fd the way aiomp's own objects do; rebuilt owning the received fd."""

    def __init__(self, fd: int, owned: bool = False) -> None:
        self.fd = fd
        if owned:
            weakref.finalize(self, os.close, fd)

    def __reduce__(self) -> tuple[object, ...]:
        return _take_box, (_reduction.add_fd(self.fd),)


def _take_box(index: int) -> FdBox:
    return FdBox(_reduction.take_fd(index), owned=True)


class PeekBox(FdBox):
    """Looks at its fd while unpickling but leaves it for ``loads`` to close."""

    def __reduce__(self) -> tuple[object, ...]:
        return _peek_box, (_reduction.add_fd(self.fd),)


def _peek_box(index: int) -> int:
    fd = _reduction.peek_fd(index)
    return os.fstat(fd).st_ino


class Unpicklable:
    def __reduce__(self) -> object:
        raise TypeError("Unpicklable refuses to be pickled")


class FailsOnLoad:
    def __reduce__(self) -> tuple[object, ...]:
        return _fail_on_load, ()


def _fail_on_load() -> None:
    raise ValueError("cannot rebuild this here")


def received(out: _reduction.Message) -> list[int]:
    """The fds a receiver would get for ``out``: its own copies."""
    return [os.dup(fd) for fd in out.fds]


# -- dumps ---------------------------------------------------------------------------------


def test_plain_objects_carry_no_fds() -> None:
    obj = {"a": [1, 2.5, "x", b"y", None], "t": (1,)}
    out = _reduction.dumps(obj)
    assert out.fds == []
    assert _reduction.loads(out.body, []) == obj
    out.close()


def test_fds_are_indexed_once_per_message() -> None:
    f1, f2 = devnull(), devnull()
    try:
        out = _reduction.dumps([FdBox(f1), PeekBox(f1), FdBox(f2), PeekBox(f2)])
        assert out.fds == [f1, f2], "an fd named twice travels once"
        fds = received(out)
        box1, inode1, box2, inode2 = _reduction.loads(out.body, fds)  # type: ignore[misc]
        assert (box1.fd, box2.fd) == (fds[0], fds[1])
        assert (inode1, inode2) == (os.fstat(f1).st_ino, os.fstat(f2).st_ino)
        assert all(is_open(fd) for fd in fds), "taken fds belong to the rebuilt objects"
        del box1, box2
        gc.collect()
        assert not any(is_open(fd) for fd in fds)
        out.close()
    finally:
        _transport.close_fds([f1, f2])


def test_a_new_message_starts_new_indexes() -> None:
    f1, f2 = devnull(), devnull()
    try:
        assert _reduction.dumps(FdBox(f2)).fds == [f2]
        assert _reduction.dumps([FdBox(f1), FdBox(f2)]).fds == [f1, f2]
    finally:
        _transport.close_fds([f1, f2])


def test_peeked_fds_are_closed_by_loads() -> None:
    fd = devnull()
    try:
        out = _reduction.dumps(PeekBox(fd))
        fds = received(out)
        assert _reduction.loads(out.body, fds) == os.fstat(fd).st_ino
        assert not is_open(fds[0])
    finally:
        os.close(fd)


def test_loads_closes_fds_no_object_took() -> None:
    out = _reduction.dumps("no fds needed")
    extra = [devnull(), devnull()]
    assert _reduction.loads(out.body, extra) == "no fds needed"
    assert not any(is_open(fd) for fd in extra)


def test_aiomp_objects_resolve_to_themselves_in_their_own_process() -> None:
    q, e = aiomp.Queue(), aiomp.Event()
    out = _reduction.dumps((q, e, q))
    # an unbounded queue: 2 sockets, the room eventfd, its overflow log; an event: its
    # state's memfd and its registry socket
    assert len(out.fds) == 4 + 2
    fds = received(out)
    q2, e2, q3 = _reduction.loads(out.body, fds)  # type: ignore[misc]
    assert q2 is q and q3 is q and e2 is e
    assert not any(is_open(fd) for fd in fds), "the duplicates in the message are closed"


@pytest.mark.parametrize("obj", [aiomp.Queue, aiomp.Event], ids=["Queue", "Event"])
def test_fd_objects_refuse_plain_pickle(obj: type) -> None:
    with pytest.raises(pickle.PicklingError, match="only travel inside aiomp"):
        pickle.dumps(obj())
    with pytest.raises(pickle.PicklingError, match="only travel inside aiomp"):
        _reduction.add_fd(0)


def test_too_many_fds_in_one_message() -> None:
    fits = (_transport.MAX_FDS - 1) // 2  # an Event carries 2 fds
    events = [aiomp.Event() for _ in range(fits + 1)]
    before = open_fds()
    with pytest.raises(aiomp.TransportError, match="at most 252"):  # R1 (issue 25 item 13)
        _reduction.dumps(events)
    assert open_fds() == before
    # the most that fits leaves room for a LARGE body's memfd
    out = _reduction.dumps(events[:fits])
    assert len(out.fds) == 2 * fits == _transport.MAX_FDS - 1
    out.close()


def test_unpicklable_object_raises_in_dumps() -> None:
    with pytest.raises(TypeError, match="refuses"):
        _reduction.dumps({"ok": 1, "bad": Unpicklable()})
    with pytest.raises((pickle.PicklingError, AttributeError)):
        _reduction.dumps(lambda: None)


def test_unpicklable_object_after_a_shared_array_leaks_nothing() -> None:
    # The array is copied into a shared block and a handoff fd is opened for it before
    # pickling reaches the bad object: the fd must be closed and the block left unheld,
    # so that the pool can release its segment.
    arr = np.arange(100_000, dtype=np.float64)
    shared = aiomp.share_memory(np.ones(50_000))
    gc.collect()
    _blocks.purge_pool()
    before = open_fds()
    for _ in range(3):
        with pytest.raises(TypeError, match="refuses"):
            _reduction.dumps([arr, shared, Unpicklable()])
    gc.collect()
    _blocks.purge_pool()
    assert open_fds() == before


def test_loads_error_closes_every_fd() -> None:
    f1, f2 = devnull(), devnull()
    try:
        out = _reduction.dumps([FdBox(f1), PeekBox(f2), FailsOnLoad()])
        fds = received(out)
        with pytest.raises(ValueError, match="cannot rebuild"):
            _reduction.loads(out.body, fds)
        gc.collect()
        # the peeked fd is closed by loads; the taken one with the box that died
        assert not any(is_open(fd) for fd in fds)
        out.close()
    finally:
        _transport.close_fds([f1, f2])


def test_loads_error_closes_fds_taken_by_aiomp_objects() -> None:
    # An Event rebuilt from a message owns its fd; if the rest of the message fails, the
    # half-built Event is collected and its fd closed with it.
    event = aiomp.Event()
    out = _reduction.dumps([event, FailsOnLoad()])
    fds = received(out)
    del event  # so that the message rebuilds a new Event taking the fd
    gc.collect()
    with pytest.raises(ValueError, match="cannot rebuild"):
        _reduction.loads(out.body, fds)
    gc.collect()
    assert not any(is_open(fd) for fd in fds)


def test_outgoing_cleanups_run_once() -> None:
    ran: list[int] = []

    class Tracked:
        def __reduce__(self) -> tuple[object, ...]:
            _reduction.on_sent(lambda: ran.append(1))
            return int, (0,)

    out = _reduction.dumps([Tracked(), Tracked()])
    out.close()
    out.close()
    assert ran == [1, 1]
    _reduction.dumps(Tracked())  # dropped unsent: __del__ runs the cleanup
    gc.collect()
    assert ran == [1, 1, 1]


def test_cleanups_run_when_dumps_fails() -> None:
    ran: list[int] = []

    class Tracked:
        def __reduce__(self) -> tuple[object, ...]:
            _reduction.on_sent(lambda: ran.append(1))
            return int, (0,)

    with pytest.raises(TypeError):
        _reduction.dumps([Tracked(), Unpicklable()])
    assert ran == [1]


def test_register_affects_aiomp_messages_only() -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    _reduction.register(Point, lambda p: (int, (p.x * 10,)))
    try:
        out = _reduction.dumps(Point(4))
        assert _reduction.loads(out.body, []) == 40
        with pytest.raises((pickle.PicklingError, AttributeError)):
            pickle.dumps(Point(4))  # a local class: the global pickler cannot
    finally:
        del _reduction._dispatch[Point]


def test_nested_dumps_keep_their_own_state() -> None:
    # A reducer may pickle something itself (e.g. check_function): states must not mix.
    f1, f2 = devnull(), devnull()
    inner: list[_reduction.Message] = []

    class Nested:
        def __reduce__(self) -> tuple[object, ...]:
            inner.append(_reduction.dumps(FdBox(f2)))
            return _take_box, (_reduction.add_fd(f1),)

    try:
        out = _reduction.dumps(Nested())
        assert out.fds == [f1]
        assert inner[0].fds == [f2]
    finally:
        _transport.close_fds([f1, f2])


# -- a second pass, and numpy views that stay views ------------------------------------------


def test_retry_pickles_once_more_with_the_first_pass_in_view() -> None:
    passes: list[object] = []

    class Late:
        def __reduce__(self) -> tuple[object, ...]:
            pad = _reduction.current()
            passes.append(pad.first and pad.first.get(Late))
            if pad.first is None:
                pad.once(Late, lambda: "first pass")
                _reduction.on_sent(lambda: passes.append("closed"))
                _reduction.retry()
            return int, (len(passes),)

    out = _reduction.dumps(Late())
    assert passes == [None, "closed", "first pass"], "first pass discarded first"
    assert _reduction.loads(out.body, []) == 3
    out.close()


def pickled_back(obj: object) -> object:
    out = _reduction.dumps(obj)
    try:
        return _reduction.loads(out.body, received(out))
    finally:
        out.close()


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 2, 0), (2, 0, 1)])
def test_numpy_views_sent_together_stay_views(order: tuple[int, int, int]) -> None:
    """Issue 12: ``[x, x[2], x[:, 1]]`` with an 8 MiB ``x`` gave the receiver a row and a
    column that were copies (sent inline, being small), not views of its ``x``."""
    x = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, 1024)
    sent = [x, x[2], x[:, 1]]
    got = pickled_back([sent[i] for i in order])
    rx, row, col = (got[order.index(i)] for i in range(3))  # type: ignore[index]
    assert np.shares_memory(rx, row) and np.shares_memory(rx, col)
    assert (row.strides, col.strides) == (x[2].strides, x[:, 1].strides)
    rx[2, 1] = -7.0
    assert row[1] == -7.0 and col[2] == -7.0 and x[2, 1] == 1.0 * 2 * 1024 + 1
    del got, rx, row, col


def test_numpy_small_overlapping_views_share_one_buffer() -> None:
    x = np.arange(100, dtype=np.int32)
    a, b = pickled_back([x[10:20], x[15:]])  # type: ignore[misc]
    assert np.shares_memory(a, b) and aiomp.is_shared(a)
    a[5] = -1
    assert b[0] == -1 and x[15] == 15
    del a, b


def test_numpy_disjoint_views_travel_on_their_own() -> None:
    x = np.arange(1 << 17, dtype=np.float64).reshape(1 << 10, 1 << 7)  # 1 MiB
    out = _reduction.dumps([x[0], x[5], x[-1]])
    assert out.fds == [], "small views of memory nothing else in the message views: inline"
    out.close()


def test_numpy_copies_keep_alignment_and_the_first_pass_leaks_nothing() -> None:
    raw = np.zeros(1 << 20, dtype=np.uint8)
    x = raw[8:].view(np.float64)[: 1 << 16]  # 8 bytes past a 16-byte boundary
    gc.collect()
    _blocks.purge_pool()
    before = open_fds()
    for _ in range(3):
        got = pickled_back([x[3:9], x])  # the small view first: a second pass
        assert np.shares_memory(got[0], got[1])  # type: ignore[index]
        addresses = [g.__array_interface__["data"][0] for g in got]  # type: ignore[attr-defined]
        assert [a % 16 for a in addresses] == [
            v.__array_interface__["data"][0] % 16 for v in (x[3:9], x)
        ]
        del got
    gc.collect()
    _blocks.purge_pool()
    assert open_fds() == before
