"""CUDA IPC: slot bookkeeping in one process: round trips, shared slots, messages in
flight or never received, failed dumps, the outstanding and event limits, handles.

With a fake CUDA backend (``tests.children.cuda_backend.FakeBackend``, a model of CuPy's memory
pool and the driver's allocator) driven through aiomp's real message path: no GPU, no cupy.
"""

from __future__ import annotations

import gc
import os
import pickle
import weakref
from typing import Any

import pytest

import aiomp
from aiomp._cuda import ipc as _cuda
from aiomp._cuda import producer as _producer
from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction
from tests.children import common as _funcs
from tests.children.cuda_backend import FakeBackend
from tests.children.cuda_device import FakeArray
from tests.cuda._cuda import MiB, received

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


def roundtrip(obj: object) -> Any:
    """Pickle for a message and unpickle in this process (fds: dups of the message's)."""
    out = _reduction.dumps(obj)
    try:
        fds = [os.dup(fd) for fd in out.fds]
        return _reduction.loads(out.body, fds)
    finally:
        out.close()


# -- the protocol in one process (fake backend) -----------------------------------------------


def test_same_process_roundtrip_keeps_then_frees_the_block(fake: FakeBackend) -> None:
    arr = fake.array((3 * MiB,), "|u1")
    chunk = weakref.ref(arr.mem)
    view = roundtrip(arr.view(8192, (4, 1 << 19), (1 << 19, 1)))  # 2 MiB: in place
    assert isinstance(view, FakeArray)
    assert view.ptr == arr.ptr + 8192  # no IPC open: our own memory
    assert (view.shape, view.strides) == ((4, 1 << 19), (1 << 19, 1))
    assert _cuda.ipc_collect() == 1
    stats = aiomp.cuda.statistics()
    assert (stats.sent_held, stats.events, stats.received_held) == (1, 1, 1)
    assert "wait_local" in fake.names() and "open" not in fake.names()
    del arr
    gc.collect()
    assert chunk() is not None  # the producer keeps it: a consumer holds it
    del view
    gc.collect()
    assert ("sync", 0) in fake.calls  # the consumer synchronised before releasing
    assert _cuda.ipc_collect() == 0
    assert chunk() is None and fake.pool.in_use == 0
    assert aiomp.cuda.statistics()[:4] == (0, 0, 0, 0)
    assert "recycle" in fake.names()


def test_arrays_from_one_allocation_share_one_slot(fake: FakeBackend) -> None:
    whole = fake.array((8 * MiB,), "|u1")
    other = fake.array((2 * MiB,), "|u1")
    a = whole.view(0, (3 * MiB,))
    msg = (a, whole.view(4 * MiB, (MiB, 2)), other, a)
    out = _reduction.dumps(msg)
    try:
        assert len(out.fds) == 1  # one handoff description per message
        assert _cuda.ipc_collect() == 2  # two allocations, two slots
        got = _reduction.loads(out.body, [os.dup(out.fds[0])])
    finally:
        out.close()
    assert isinstance(got, tuple)
    assert got[0].mem._owner is got[1].mem._owner is got[3].mem._owner
    assert got[2].mem._owner is not got[0].mem._owner
    assert fake.names().count("record") == 2  # one event per slot
    assert aiomp.cuda.statistics().received_held == 2
    del got
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_in_flight_message_holds_the_block(fake: FakeBackend) -> None:
    arr = fake.array((MiB,))
    chunk = weakref.ref(arr.mem)
    out = _reduction.dumps(arr)
    del arr
    in_flight = os.dup(out.fds[0])  # what a queued datagram holds
    out.close()
    gc.collect()
    assert _cuda.ipc_collect() == 1
    assert chunk() is not None
    os.close(in_flight)
    assert _cuda.ipc_collect() == 0
    assert chunk() is None


def test_message_never_received_releases_with_its_socket(fake: FakeBackend) -> None:
    a, b = _transport.socketpair()
    out = _reduction.dumps([fake.array((16,))])
    try:
        assert _transport.try_send(a, *out.datagram())
    finally:
        out.close()
    assert _cuda.ipc_collect() == 1
    a.close()
    b.close()  # the kernel drops the fds queued in the socket
    assert _cuda.ipc_collect() == 0


def test_failed_dumps_releases_the_slot(fake: FakeBackend) -> None:
    with pytest.raises(TypeError, match="Unpicklable refuses"):
        _reduction.dumps((fake.array((MiB,)), fake.array((4,)), _funcs.Unpicklable()))
    assert _cuda.ipc_collect() == 0
    gc.collect()
    assert fake.pool.in_use == 0


def test_outstanding_limit_raises_at_put(fake: FakeBackend) -> None:
    aiomp.cuda.set_ipc_limit(2)
    assert aiomp.cuda.get_ipc_limit() == 2
    held = [_reduction.dumps(fake.array((16,))) for _ in range(2)]
    with pytest.raises(aiomp.cuda.IpcLimitError, match="still held by their consumers"):
        _reduction.dumps(fake.array((MiB,)))
    assert isinstance(aiomp.cuda.IpcLimitError("x"), aiomp.cuda.CudaIpcError)
    held.pop().close()
    _reduction.dumps(fake.array((16,))).close()  # collected at send: room again
    for out in held:
        out.close()
    with pytest.raises(ValueError):
        aiomp.cuda.set_ipc_limit(0)


def test_event_cap_falls_back_to_synchronising(
    fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_producer, "MAX_IPC_EVENTS", 1)
    first = _reduction.dumps(fake.array((MiB,)))
    fake.calls.clear()
    second = _reduction.dumps(fake.array((MiB,)))
    try:
        names = fake.names()
        assert "record" not in names and names.count("sync") == 1  # no event: synchronised
        assert aiomp.cuda.statistics().events == 1
        fake.calls.clear()
        third = _reduction.dumps((fake.array((4,)), fake.array((4,))))  # staged, no event
        assert fake.names().count("sync") == 2  # after each copy
        third.close()
    finally:
        first.close()
        second.close()


def test_sending_a_received_array_onward_raises(fake: FakeBackend) -> None:
    view = roundtrip(fake.array((MiB,)))
    with pytest.raises(aiomp.cuda.CudaIpcError, match="received from another process"):
        _reduction.dumps({"x": view})
    del view
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_empty_array_needs_no_handle(fake: FakeBackend) -> None:
    view = roundtrip(fake.array((16,)).view(0, (0, 3)))
    assert isinstance(view, FakeArray) and view.shape == (0, 3)
    assert _cuda.ipc_collect() == 0
    assert not {"record", "open", "copy", "malloc"} & set(fake.names())


def test_get_raises_cuda_ipc_error_for_a_device_it_cannot_see(fake: FakeBackend) -> None:
    # Issue 32, first run on a GPU (H100): a consumer with CUDA_VISIBLE_DEVICES="" got
    # QueueItemError at get, where aiomp.cuda and the README promise CudaIpcError.
    q = aiomp.Queue()
    try:
        q.sync.put(fake.array((16,)).view(0, (0, 4)))  # rebuilt on the device it names
        fake.devices = ()  # this process sees no GPU
        with pytest.raises(aiomp.cuda.CudaIpcError, match="is not visible"):
            q.sync.get(timeout=10)
        q.sync.put("next")
        assert q.sync.get(timeout=10) == "next"  # the item is lost; the queue goes on
    finally:
        q.close()


def test_release_syncs_only_the_last_view_of_a_mapping(fake: FakeBackend) -> None:
    # Issue 32 (profile on an H100): the stream sync at each release cost a handoff about
    # 0.1 ms. While another received slot still maps the allocation, the producer cannot
    # free or reuse it, so that release needs no sync; the last one syncs for them all.
    whole = fake.array((8 * MiB,), "|u1")
    first = received(whole.view(0, (3 * MiB,)))
    second = received(whole.view(4 * MiB, (3 * MiB,)))
    fake.calls.clear()
    del first
    gc.collect()
    assert "sync" not in fake.names() and "close" not in fake.names()
    assert _cuda.ipc_collect() == 1
    fake.calls.clear()
    del second
    gc.collect()
    assert fake.names()[:2] == ["sync", "close"]  # synced, closed, then released
    assert _cuda.ipc_collect() == 0


def test_reducer_only_works_inside_a_message(fake: FakeBackend) -> None:
    with pytest.raises(pickle.PicklingError, match="can only travel inside aiomp"):
        _cuda.reduce_array(fake.array((4,)))
