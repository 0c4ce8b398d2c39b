"""Shared memory: numpy arrays as zero-copy handles (README "Queues, events
and shared memory", R1-R5), leases, the segment pool and the janitor.

Pure parts first (leases, constructors, arrays through a queue read back in this
process), then a few contract tests with children. Arrays are checked by value, by
flags (``aiomp.is_shared``, writeable) and by address (``np.shares_memory``). Children
report through queues; every await on a child is bounded by ``anyio.fail_after``.

Layouts observed (documented in ``aiomp._arrays.numpy``): C- and Fortran-contiguous arrays keep
their layout; a non-contiguous view of a base at most ``VIEW_SLACK`` times its size keeps
its strides (the whole base travels once); a view of a much larger base is compacted to
C order.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from aiomp import _lifecycle
from aiomp._arrays import numpy as _numpy
from aiomp._arrays import shared as _shared
from aiomp._memory import allocator as _allocator
from aiomp._memory import blocks as _blocks
from aiomp._memory import janitor as _janitor
from aiomp._memory import lease as _lease
from aiomp._memory import registry as _registry
from aiomp._memory.segment import Segment
from tests._run import run_python
from tests.children import common as funcs
from tests.children import memory as funcs_shm

TIMEOUT = 20
GRACE = 0.5
REPO = Path(__file__).resolve().parents[2]
INLINE = _numpy.INLINE_THRESHOLD
STRATEGIES = ["file_descriptor", "file_system"]
#: Array tests whose subject is the shared-memory layer, not the event loop, run on one.
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
BOTH_STRATEGIES = pytest.mark.parametrize(
    "strategy", ["file_descriptor", "file_system"], indirect=True
)


def shm_names() -> set[str]:
    return {n for n in os.listdir(_janitor.SHM_DIR) if n.startswith("aiomp")}


def own_shm_names() -> set[str]:
    return {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{os.getpid()}-")}


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def roundtrip(obj: object) -> Any:
    """Send ``obj`` through a fresh queue and read it back in this process."""
    q = aiomp.Queue()
    q.sync.put(obj)
    return q.sync.get(timeout=5)


def segment_count() -> int:
    return sum(len(segs) for segs in _registry.REGISTRY.pool.segments.values())


def segment_of(arr: np.ndarray[Any, Any]) -> Segment:
    ref = _blocks.block_of(_shared.root(arr))
    assert ref is not None
    return ref.segment


def big(dtype: Any = np.float64, factor: int = 2) -> np.ndarray[Any, Any]:
    """An array above the inline threshold, filled with distinct values."""
    dtype = np.dtype(dtype)
    n = factor * INLINE // dtype.itemsize + 3
    return np.arange(n).astype(dtype)


# -- leases (the kernel's reference counts) ------------------------------------------------


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("aiomp-test-lease", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 16)
    yield fd
    os.close(fd)


def test_lease_hold_release(memfd: int) -> None:
    other = _lease.reopen(memfd)
    try:
        assert not _lease.is_held(memfd, 0, 4096)
        _lease.hold(other, 0, 4096)
        assert _lease.is_held(memfd, 0, 4096)
        assert _lease.is_held(memfd, 4000, 200), "overlapping ranges are held"
        assert not _lease.is_held(memfd, 4096, 4096), "neighbouring ranges are not"
        assert not _lease.is_held(other, 0, 4096), "a description never sees its own leases"
        _lease.hold(other, 0, 4096)  # holding twice is one lease
        _lease.release(other, 0, 4096)
        assert not _lease.is_held(memfd, 0, 4096)
        assert _lease.is_held(memfd, 0, 0) is False  # length 0: to the end of the file
        _lease.hold(other, 8192, 100)
        assert _lease.is_held(memfd, 0, 0)
    finally:
        os.close(other)
    assert not _lease.is_held(memfd, 0, 0), "closing the description drops its leases"


def test_lease_identity(memfd: int) -> None:
    other = _lease.reopen(memfd)
    dup = os.dup(memfd)
    try:
        assert _lease.identity(other) == _lease.identity(memfd) == _lease.identity(dup)
        fd2 = os.memfd_create("x", os.MFD_CLOEXEC)
        assert _lease.identity(fd2) != _lease.identity(memfd)
        os.close(fd2)
    finally:
        os.close(other)
        os.close(dup)


def test_lease_dup_shares_the_description(memfd: int) -> None:
    # Why a message carries a *fresh* description: a dup (or an SCM_RIGHTS copy) shares
    # its locks with the original, so the owner could not see them.
    dup = os.dup(memfd)
    try:
        _lease.hold(dup, 0, 100)
        assert not _lease.is_held(memfd, 0, 100)
    finally:
        _lease.release(dup, 0, 100)
        os.close(dup)


def test_handoff_holds_until_every_copy_is_closed(memfd: int) -> None:
    fd = _lease.handoff_fd(memfd, [(0, 100), (4096, 100)])
    assert _lease.is_held(memfd, 50, 10) and _lease.is_held(memfd, 4096, 1)
    assert not _lease.is_held(memfd, 200, 100)
    in_flight = os.dup(fd)  # the copy a message carries
    os.close(fd)
    assert _lease.is_held(memfd, 0, 100), "the message's copy keeps the lease"
    os.close(in_flight)
    assert not _lease.is_held(memfd, 0, 0)


def _hold_in_child(memfd: int, ranges: list[tuple[int, int]], inherited: int) -> int:
    """Fork a child that takes leases through a description of its own (and keeps the
    ``inherited`` one), tells us, and waits to be killed. Returns its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            own = _lease.reopen(memfd)
            for start, length in ranges:
                _lease.hold(own, start, length)
            os.write(w, b"x")
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x", "the child died before it held its leases"
    finally:
        os.close(r)
    return pid


def test_leases_of_a_sigkilled_process_are_dropped(memfd: int) -> None:
    handoff = _lease.handoff_fd(memfd, [(0, 4096)])
    pid = _hold_in_child(memfd, [(8192, 4096)], handoff)
    os.close(handoff)  # now only the child holds the handoff description
    try:
        assert _lease.is_held(memfd, 8192, 4096), "the child's own lease"
        assert _lease.is_held(memfd, 0, 4096), "the handoff lease, inherited by the child"
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not _lease.is_held(memfd, 0, 0), "the kernel dropped every lease with the process"


# -- strategies ----------------------------------------------------------------------------


def test_sharing_strategies() -> None:
    assert aiomp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert aiomp.get_sharing_strategy() == "file_descriptor", "the default on Linux"
    all_ = aiomp.get_all_sharing_strategies()
    all_.clear()  # a copy: the caller cannot change the library's set
    assert aiomp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}


@pytest.mark.parametrize("name", ["", "File_System", "file-system", "cuda", None])
def test_unknown_strategy(name: object) -> None:
    with pytest.raises(ValueError, match="sharing strategy"):
        aiomp.set_sharing_strategy(name)  # type: ignore[arg-type]
    assert aiomp.get_sharing_strategy() == "file_descriptor"


def test_set_strategy(strategy: str) -> None:
    assert aiomp.get_sharing_strategy() == strategy
    arr = aiomp.zeros(10)
    name = segment_of(arr).name
    if strategy == "file_system":
        assert name is not None and name.startswith(f"aiomp-{os.getpid()}-")
        assert name in shm_names()
        # R3: collision-proof names: pid plus 64 random bits
        assert len(name.split("-")[2]) == 16
    else:
        assert name is None
        assert os.readlink(f"/proc/self/fd/{segment_of(arr).fd}").startswith("/memfd:aiomp")


def _names_after_switching() -> tuple[bool, bool, bool]:
    aiomp.set_sharing_strategy("file_descriptor")
    old = aiomp.zeros(10)
    aiomp.set_sharing_strategy("file_system")
    new = aiomp.zeros(10)
    return segment_of(old).name is None, segment_of(new).name is not None, aiomp.is_shared(old)


def test_switching_strategy_applies_to_new_arrays(file_system: None) -> None:
    old_unnamed, new_named, old_shared = _names_after_switching()
    assert old_unnamed and old_shared, "arrays already shared keep their segment"
    assert new_named, "arrays made after the switch live in named segments"


# -- constructors --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [aiomp.empty, aiomp.zeros], ids=["empty", "zeros"])
@pytest.mark.parametrize("shape", [0, 10, (3, 4), (2, 0, 5), (1000, 1000)])
@pytest.mark.parametrize("dtype", [float, np.int8, "S3", "datetime64[s]"])
def test_constructors(make: Callable[..., Any], shape: Any, dtype: Any) -> None:
    arr = make(shape, dtype)
    assert isinstance(arr, np.ndarray) and type(arr) is np.ndarray
    assert arr.shape == ((shape,) if isinstance(shape, int) else shape)
    assert arr.dtype == np.dtype(dtype)
    assert arr.flags.c_contiguous and arr.flags.writeable
    assert aiomp.is_shared(arr), "even a small or empty one lives in shared memory"
    if make is aiomp.zeros:
        assert not arr.view(np.uint8).any()
    arr[...] = np.ones(1, dtype)  # writable throughout


def test_constructors_default_dtype() -> None:
    assert aiomp.empty(3).dtype == np.float64
    assert aiomp.zeros((2, 2)).dtype == np.float64


def test_constructors_refuse_object_dtype() -> None:
    with pytest.raises(TypeError, match="object"):
        aiomp.zeros(10, object)
    with pytest.raises(TypeError, match="object"):
        aiomp.share_memory(np.array([None] * 10))


def test_zeros_are_zero_after_block_reuse() -> None:
    n = (3 << 20) // 8  # a large block: one per segment, so the next one reuses it
    dirty = aiomp.empty(n)
    dirty[:] = 7.0
    address = dirty.ctypes.data
    del dirty
    gc.collect()
    again = aiomp.empty(n)
    assert again.ctypes.data == address, "the pool reused the block"
    assert (again == 7.0).all(), "empty() does not clear (no page touched twice)"
    del again
    gc.collect()
    clean = aiomp.zeros(n)
    assert clean.ctypes.data == address
    assert not clean.any()


def test_zeros_are_zero_after_small_block_reuse() -> None:
    blocks = [aiomp.empty(1000) for _ in range(200)]  # more than one slab's worth
    for b in blocks:
        b[:] = 3.0
    del blocks, b
    gc.collect()
    assert all(not aiomp.zeros(1000).any() for _ in range(400))


def test_share_memory() -> None:
    src = np.arange(12.0).reshape(3, 4)
    shared = aiomp.share_memory(src)
    assert aiomp.is_shared(shared) and not aiomp.is_shared(src)
    assert shared is not src and not np.shares_memory(shared, src)
    assert np.array_equal(shared, src) and shared.dtype == src.dtype
    assert aiomp.share_memory(shared) is shared, "already shared: itself"
    view = shared[1:, ::2]
    assert aiomp.is_shared(view) and aiomp.share_memory(view) is view
    shared[0, 0] = 99.0
    assert src[0, 0] == 0.0


def test_share_memory_keeps_layouts() -> None:
    base = np.arange(24.0).reshape(4, 6)
    fortran = np.asfortranarray(base)
    out = aiomp.share_memory(fortran)
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    assert np.array_equal(out, fortran)
    strided = aiomp.share_memory(base[:, ::2])
    assert strided.flags.c_contiguous, "other strides are compacted to C order"
    assert np.array_equal(strided, base[:, ::2])


def test_share_memory_refuses_non_arrays() -> None:
    with pytest.raises(TypeError, match="ndarray"):
        aiomp.share_memory([1, 2, 3])  # type: ignore[arg-type]
    assert aiomp.is_shared([1, 2]) is False  # type: ignore[arg-type]
    assert aiomp.is_shared(np.arange(3)) is False
    assert aiomp.is_shared(np.frombuffer(bytearray(INLINE * 2))) is False


# -- through a queue, read back in this process --------------------------------------------

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
    np.clongdouble,
    "datetime64[ns]",
    "datetime64[D]",
    "timedelta64[ms]",
    ">i4",
    ">f8",
    "S7",
    "U5",
    "V12",
    np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")]),
    np.dtype([("x", "u1"), ("y", ">i2")], align=True),
]


def sample(dtype: np.dtype[Any], n: int) -> np.ndarray[Any, Any]:
    """``n`` distinct-looking values of ``dtype``."""
    if dtype.names:
        arr = np.zeros(n, dtype)
        for name in dtype.names:
            field = arr[name]
            arr[name] = np.arange(field.size).reshape(field.shape).astype(field.dtype)
        return arr
    return np.frombuffer(np.random.default_rng(0).bytes(n * dtype.itemsize), dtype).copy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bufferable_dtype_travels_shared(dtype: Any) -> None:
    dtype = np.dtype(dtype)
    n = INLINE // dtype.itemsize + 7
    arr = sample(dtype, n)
    got = roundtrip(arr)
    assert aiomp.is_shared(got) and got.flags.writeable
    assert got.dtype == dtype and got.shape == arr.shape
    if dtype.names:
        assert (got == arr).all()  # field by field: padding bytes are not copied
    else:
        assert got.tobytes() == arr.tobytes()
    small = arr[:3].copy()
    got_small = roundtrip(small)
    assert not aiomp.is_shared(got_small), "below the threshold: inline"
    assert got_small.dtype == dtype and got_small.tobytes() == small.tobytes()


def test_the_inline_threshold() -> None:
    assert INLINE == 64 * 1024  # documented in aiomp._arrays.numpy
    below = np.zeros(INLINE - 1, np.uint8)
    at = np.zeros(INLINE, np.uint8)
    assert not aiomp.is_shared(roundtrip(below))
    assert aiomp.is_shared(roundtrip(at))


def test_object_arrays_travel_inline() -> None:
    arr = np.array([{"k": i} for i in range(INLINE)], dtype=object)
    got = roundtrip(arr)
    assert not aiomp.is_shared(got) and got.dtype == object
    assert got[12345] == {"k": 12345}


@pytest.mark.parametrize(
    "arr",
    [
        np.array(3.5),
        np.zeros((), dtype=[("v", "f8", (INLINE // 8 + 1,))]),  # a 0-d array above the threshold
        np.empty((0,)),
        np.empty((0, INLINE)),
        np.empty((INLINE, 0), np.float32),
    ],
    ids=["0d", "0d-large", "empty", "empty-wide", "empty-tall"],
)
def test_zero_dimensional_and_empty(arr: np.ndarray[Any, Any]) -> None:
    if arr.dtype.names:
        arr["v"] = np.arange(INLINE // 8 + 1)
    got = roundtrip(arr)
    assert got.shape == arr.shape and got.dtype == arr.dtype
    assert got.tobytes() == arr.tobytes()
    assert aiomp.is_shared(got) == (arr.nbytes >= INLINE)


def test_fortran_order_is_kept() -> None:
    arr = np.asfortranarray(np.arange(300 * 100, dtype=np.float64).reshape(300, 100))
    got = roundtrip(arr)
    assert aiomp.is_shared(got)
    assert got.flags.f_contiguous and not got.flags.c_contiguous
    assert np.array_equal(got, arr)


@pytest.mark.parametrize(
    "view",
    [
        "transpose",
        "every_other_row",
        "reversed",
        "column_block",
        "negative_2d",
    ],
)
def test_views_of_a_modest_base_keep_their_strides(view: str) -> None:
    base = np.arange(400 * 100, dtype=np.float64).reshape(400, 100)
    v = {
        "transpose": base.T,
        "every_other_row": base[::2],
        "reversed": base[::-1],
        "column_block": base[:, 10:60],
        "negative_2d": base[::-2, ::-1],
    }[view]
    got = roundtrip(v)
    assert aiomp.is_shared(got) and got.flags.writeable
    assert np.array_equal(got, v)
    assert got.strides == v.strides, "observed: the whole base travels, the view keeps strides"


def test_views_of_a_large_base_are_compacted() -> None:
    base = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)
    v = base[:, 3:15]  # 96 KB of an 800 KB base: more than VIEW_SLACK times smaller
    assert base.nbytes > _numpy.VIEW_SLACK * v.nbytes and v.nbytes >= INLINE
    got = roundtrip(v)
    assert aiomp.is_shared(got)
    assert np.array_equal(got, v)
    assert got.flags.c_contiguous, "observed: compacted to C order"


def test_arrays_nested_in_containers() -> None:
    a, b = big(np.float32), big(np.int64, 3)
    msg = {"list": [a, 1, "x"], "tuple": (b, {"deep": [a[:3]]}), "small": np.arange(3)}
    got = roundtrip(msg)
    assert aiomp.is_shared(got["list"][0]) and aiomp.is_shared(got["tuple"][0])
    assert np.array_equal(got["list"][0], a) and np.array_equal(got["tuple"][0], b)
    assert got["list"][1:] == [1, "x"]
    assert np.array_equal(got["tuple"][1]["deep"][0], a[:3])
    assert not aiomp.is_shared(got["small"])


def test_views_in_one_message_stay_views_of_one_buffer() -> None:
    x = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)
    head, tail, whole = roundtrip([x[:600], x[400:], x])
    assert all(aiomp.is_shared(v) for v in (head, tail, whole))
    assert np.shares_memory(head, tail) and np.shares_memory(head, whole)
    head[500] = -1.0
    assert (tail[100] == -1.0).all() and (whole[500] == -1.0).all()
    assert (x[500] != -1.0).all(), "the sender's array is not shared: it was copied"


def test_the_same_array_twice_in_one_message_is_one_copy() -> None:
    x = big()
    a, b = roundtrip([x, x])
    assert a is b or np.shares_memory(a, b)


def test_already_shared_array_travels_by_handle() -> None:
    # The message's size does not grow with the array's.
    from aiomp._wire import pickling as _reduction

    sizes = []
    for n in (10, 1 << 10, 1 << 16, 1 << 22):
        arr = aiomp.zeros(n)
        out = _reduction.dumps(arr)
        sizes.append(len(out.body))
        assert len(out.fds) == 1
        out.close()
    assert max(sizes) - min(sizes) < 16, sizes
    assert max(sizes) < 512


def test_already_shared_array_arrives_as_the_same_memory() -> None:
    shared = aiomp.zeros(10)  # small, but shared: still by handle, never inline
    got = roundtrip(shared)
    assert np.shares_memory(got, shared)
    got[3] = 5.0
    assert shared[3] == 5.0
    view = roundtrip(shared[2:8:2])
    assert np.shares_memory(view, shared) and view.strides == (16,)


@pytest.mark.anyio
async def test_arrays_through_the_async_calls() -> None:
    q = aiomp.Queue(maxsize=2)
    arrays = [big(np.float64), aiomp.zeros(5), np.arange(4)]
    with anyio.fail_after(5):
        for arr in arrays:
            await q.put(arr)
            got = await q.get()
            assert np.array_equal(got, arr)
            assert aiomp.is_shared(got) == (arr.nbytes >= INLINE or aiomp.is_shared(arr))


def test_pool_reuses_blocks_in_one_process() -> None:
    q = aiomp.Queue()
    gc.collect()
    before = segment_count()
    fds = fd_count()
    for i in range(500):
        q.sync.put(np.full(INLINE * 2, i % 256, np.uint8))
        got = q.sync.get(timeout=5)
        assert got[0] == i % 256
        del got
    for i in range(20):
        q.sync.put(np.full(3 << 20, i, np.uint8))
        q.sync.get(timeout=5)
    assert segment_count() - before <= 2, "one slab of small blocks, one large segment"
    assert fd_count() - fds <= 2 * 2, "each segment: its fd, and the one mmap dups"


def _segments_after_loopback_sends() -> int:
    q = aiomp.Queue()
    before = segment_count()
    for i in range(100):
        q.sync.put(np.full(INLINE * 2, i, np.uint8))
        q.sync.get(timeout=5)
    for i in range(10):
        q.sync.put(np.full(3 << 20, i, np.uint8))
        q.sync.get(timeout=5)
    gc.collect()
    _blocks.purge_pool()
    return segment_count() - before


def test_pool_reuses_blocks_in_one_process_file_system(file_system: None) -> None:
    leftover = _segments_after_loopback_sends()
    _registry.REGISTRY.pool.trim(0)
    for seg in [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]:
        _registry.REGISTRY.pool.forget(seg)  # let the leak check see a clean /dev/shm either way
    assert leftover == 0


async def _segments_left_by_unsent_messages() -> int:
    shared = aiomp.share_memory(np.arange((3 << 20) // 8, dtype=np.float64))
    plain = big()
    full = aiomp.Queue(maxsize=1)
    full.put_nowait("occupies the only slot")
    with pytest.raises(TypeError):  # a pickling error after the arrays
        full.put_nowait([plain, shared, funcs.Unpicklable()])
    with pytest.raises(aiomp.Full):
        full.put_nowait([plain, shared])
    with pytest.raises(aiomp.Full):
        full.sync.put([plain, shared], timeout=0)

    async def cancelled_put(obj: object) -> None:
        with anyio.move_on_after(0.01):  # handshake-free: cancel a put that waits for room
            await full.put(obj)

    # In a task of its own: the cancelled frames (and the arrays they hold) go with it.
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_put, [plain, shared])
    assert full.qsize() == 1
    del shared, plain
    gc.collect()
    _blocks.purge_pool()
    leftover = [seg for segs in _registry.REGISTRY.pool.segments.values() for seg in segs]
    for seg in leftover:
        _registry.REGISTRY.pool.forget(seg)  # leave /dev/shm clean for the leak check either way
    return len(leftover)


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_unsent_messages_pin_no_blocks(strategy: str) -> None:
    assert await _segments_left_by_unsent_messages() == 0


# -- exhaustion (R4) -----------------------------------------------------------------------


def too_big() -> int:
    """More bytes than /dev/shm has free and than memory has available."""
    st = os.statvfs(_janitor.SHM_DIR)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return max(st.f_bavail * st.f_frsize, avail) + (1 << 30)


def test_exhaustion_at_allocation(strategy: str) -> None:
    size = too_big()
    names = own_shm_names()
    fds = fd_count()
    with pytest.raises(aiomp.SharedMemoryError) as info:
        aiomp.empty(size, np.uint8)
    assert info.value.errno in (12, 28)  # ENOMEM (memfd), ENOSPC (/dev/shm)
    assert "shared memory" in str(info.value)
    with pytest.raises(aiomp.SharedMemoryError):
        aiomp.zeros((size // 8 + 1,))
    assert isinstance(info.value, OSError)
    # (Only this process's names: a concurrent test's may come and go meanwhile.)
    assert own_shm_names() == names and fd_count() == fds, "nothing left behind"


def test_exhaustion_at_put(strategy: str, tmp_path: Path) -> None:
    # A file-backed array as large as all the memory: mapping it costs nothing, copying it
    # into shared memory cannot succeed, and must fail in put, before anything is sent.
    size = too_big()
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(size)
    mapped = np.memmap(path, np.uint8, "r", shape=(size,))
    arr = mapped.view(np.ndarray)
    q = aiomp.Queue()
    with pytest.raises(aiomp.SharedMemoryError):
        q.put_nowait({"data": arr})
    with pytest.raises(aiomp.SharedMemoryError):
        q.sync.put(arr)
    assert q.qsize() == 0
    with pytest.raises(aiomp.Empty):
        q.get_nowait()
    q.put_nowait("still usable")
    assert q.get_nowait() == "still usable"
    del arr, mapped


# -- across processes ----------------------------------------------------------------------


def describe(arr: np.ndarray[Any, Any], shared: bool) -> tuple[object, ...]:
    """What ``funcs.shm_inspect`` reports for an array received as ``arr`` was sent."""
    return ("array", shared, True, arr.dtype.str, arr.shape, arr.strides, arr.tobytes())


@pytest.mark.anyio
@ONE_LOOP
async def test_arrays_in_spawn_args() -> None:
    # (file_system: see test_blocks_sent_twice_are_released; base and base.T share a block)
    base = np.arange(400 * 100, dtype=np.float64).reshape(400, 100)
    small = np.arange(5, dtype=np.int16)
    zero_d = np.zeros((), dtype=[("v", "f8", (INLINE // 8 + 1,))])
    fortran = np.asfortranarray(base)
    args = (
        base,
        small,
        {"nested": [big(np.complex64), small]},
        base.T,
        fortran,
        zero_d,
        np.empty((0, 7)),
        np.array(2.5),
        big("S5"),
        big("datetime64[ms]"),
    )
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.shm_inspect, 1, args=args, grace_period=GRACE) as ctx:
            pass
    got = ctx.results[0]
    assert got[0] == describe(base, True)
    assert got[1] == describe(small, False)
    assert got[2] == {
        "nested": [
            describe(args[2]["nested"][0], True),  # type: ignore[index]
            describe(small, False),
        ]
    }
    assert got[3] == describe(base.T, True)
    assert got[4] == describe(fortran, True)
    assert got[5] == describe(zero_d, True)
    assert got[6][:5] == describe(args[6], False)[:5]  # type: ignore[arg-type]
    assert got[6][6] == b""  # (numpy's own pickle gives empty arrays zero strides)
    assert got[7] == describe(args[7], False)  # type: ignore[arg-type]
    assert got[8] == describe(args[8], True)  # type: ignore[arg-type]
    assert got[9] == describe(args[9], True)  # type: ignore[arg-type]


async def wait_exited(ctx: aiomp.ProcessContext) -> None:
    """Wait until every child has exited, without reading their reports (join does)."""
    for process in ctx.processes:
        await anyio.wait_readable(process.sentinel)


async def _results_read_after_exit(
    fn: Callable[..., Any], nprocs: int, args: tuple[object, ...]
) -> list[Any] | str:
    """Spawn, let every child exit, then join: the results or the failure's message (so
    that a failure keeps no process object alive through its traceback)."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(fn, nprocs, args=args, grace_period=GRACE)
        await wait_exited(ctx)  # the senders are gone before their results are read
        try:
            await ctx.join()
        except aiomp.ProcessException as exc:
            return str(exc)
    return ctx.results


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_arrays_in_return_values(strategy: str) -> None:
    n = 100_000
    results = await _results_read_after_exit(funcs.shm_return_arrays, 2, (n, strategy))
    assert isinstance(results, list), results
    for rank, result in enumerate(results):
        plain, shared, small = result["plain"], result["shared"], result["small"]  # type: ignore[index]
        assert aiomp.is_shared(plain) and aiomp.is_shared(shared)
        assert not aiomp.is_shared(small)
        assert plain.flags.writeable and shared.flags.writeable
        assert np.array_equal(plain, np.arange(n, dtype=np.float32) + rank)
        assert np.array_equal(shared, np.arange(n) * (rank + 1))
        shared[:] = -1  # the creator has exited: the memory is ours now
    assert np.array_equal(small, np.arange(3) + 1)


@pytest.mark.anyio
async def test_hogwild_writes_are_seen_by_every_process() -> None:
    nprocs, n = 4, 1000
    w = aiomp.zeros(n)
    flag = aiomp.zeros(1)  # small, but already shared: travels by handle
    q, go = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.shm_stripe, nprocs, args=(nprocs, w, flag, q, go), grace_period=GRACE
        ) as ctx:
            for _ in range(nprocs):
                await q.put(w)
            flag[0] = 42.0  # after the children started
            go.set()
    assert ctx.results == [42.0] * nprocs
    for rank in range(nprocs):
        assert (w[rank::nprocs] == rank + 1 + 100).all()


@pytest.mark.anyio
async def test_forwarded_array_is_still_the_same_memory(strategy: str) -> None:
    a = aiomp.share_memory(np.zeros(50_000))
    q1, q2, reply = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.shm_write_marks, 1, args=(q2, reply), grace_period=GRACE):
            async with aiomp.spawn(funcs.q_forward, 1, args=(q1, q2), grace_period=GRACE):
                await q1.put((a, "first"))
                assert await reply.get() == "first"
                assert a[0] == 1.0, "written by the second child, through the first one"
                a[1] = 7.0
                await q1.put((a[1:], "view"))
                assert await reply.get() == "view"
                assert a[1] == 1.0
                q1.close()
            q2.close()


@pytest.mark.anyio
@ONE_LOOP
async def test_a_received_array_sent_back_is_the_same_memory(strategy: str) -> None:
    qin, qout = aiomp.Queue(), aiomp.Queue()
    plain = big()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.q_forward, 1, args=(qin, qout), grace_period=GRACE):
            await qin.put(plain)
            first = await qout.get()  # a shared copy, made by this process's put
            assert aiomp.is_shared(first) and np.array_equal(first, plain)
            await qin.put(first)  # by handle, out and back
            second = await qout.get()
            assert np.shares_memory(first, second)
            second[0] = -5.0
            assert first[0] == -5.0 and plain[0] == 0.0
            qin.close()
    del first, second


@pytest.mark.anyio
@ONE_LOOP
async def test_same_segment_is_mapped_once_and_views_stay_views() -> None:
    # (file_system: the same exchange pins the blocks, see test_blocks_sent_twice_are_released)
    a = aiomp.share_memory(np.arange(100_000, dtype=np.float64))
    b = aiomp.share_memory(np.arange(30_000, dtype=np.float32))
    x = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)  # not shared: copied
    q, reply = aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.shm_views, 1, args=(q, reply), grace_period=GRACE):
            await q.put((a, a[10:], b, x[:600], x[400:]))
            await q.put(a)
            info = await reply.get()
    # x's copy has a's block size (1 MiB): it lies in a's slab, so the child maps two
    segments = {id(segment_of(a)), id(segment_of(b))}
    assert info == {
        "a_tail_is_view_of_a": True,
        "a_again_same_memory": True,
        "a_again_same_base": True,
        "a_b_separate": True,
        "x_views_share_one_buffer": True,
        "x_write_seen_through_other_view": True,
        "mappings": len(segments),
    }
    assert a[10] == -1.0, "the child's write through its view"


@pytest.mark.anyio
@ONE_LOOP
async def test_sender_exits_before_the_receiver_reads() -> None:
    # R2: the file_descriptor strategy has no sender-liveness dependency.
    n = 50_000
    q = aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.shm_send_then_exit, 1, args=(q, n, "file_descriptor"), grace_period=GRACE
        ):
            pass  # leaving the block joins: the child has exited
        plain = await q.get()
        shared = await q.get()
        view, tail = await q.get()
    assert np.array_equal(plain, np.arange(n, dtype=np.float64)) and aiomp.is_shared(plain)
    assert (shared == 7).all() and aiomp.is_shared(shared)
    assert np.array_equal(view, np.arange(2 * n, dtype=np.int16)[::2]) and tail == "tail"
    assert aiomp.is_shared(view) and view.strides == (4,)
    shared[:] = 0  # still writable memory


@pytest.mark.anyio
@ONE_LOOP
async def test_file_system_sender_exits_before_the_receiver_reads() -> None:
    # Under file_system a name stays while a message naming it is unread (the segment
    # header counts sends and opens), so a reader may come after its sender has exited;
    # the last one to drop the arrays removes the names.
    q = aiomp.Queue()
    n = 50_000
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.shm_send_then_exit, 1, args=(q, n, "file_system"), grace_period=GRACE
        ) as ctx:
            pass
        first, second, (third, tail) = await q.get(), await q.get(), await q.get()
    assert (first == np.arange(n)).all() and (second == 7).all()
    assert (third == np.arange(2 * n, dtype=np.int16)[::2]).all() and tail == "tail"
    pid = ctx.pids()[0]
    assert {x for x in shm_names() if x.startswith(f"{_janitor.PREFIX}{pid}-")}
    del first, second, third
    gc.collect()
    assert not {x for x in shm_names() if x.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert q.qsize() == 0


@pytest.mark.anyio
@ONE_LOOP
async def test_fds_stay_flat_over_thousands_of_arrays() -> None:
    # file_descriptor only: under file_system this echo returns corrupted arrays (seen:
    # 155 where 145 was sent), the bug pinned by test_block_in_flight_is_never_reused.
    count = 2000
    qin, qout = aiomp.Queue(maxsize=8), aiomp.Queue(maxsize=8)
    gc.collect()
    fds_before, segments_before = fd_count(), segment_count()
    most_fds = most_segments = 0

    async def produce() -> None:
        for i in range(count):
            await qin.put(np.full(INLINE + i % 5000, i % 251, np.uint8))
        qin.close()

    with anyio.fail_after(TIMEOUT):
        async with (
            aiomp.spawn(funcs.shm_echo_many, 1, args=(qin, qout), grace_period=GRACE) as ctx,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(produce)
            for i in range(count):
                got = await qout.get()
                assert got[0] == i % 251 and aiomp.is_shared(got)
                del got
                most_fds = max(most_fds, fd_count())
                most_segments = max(most_segments, segment_count())
    child_first, child_most = ctx.results[0]  # type: ignore[misc]
    assert child_most - child_first <= 8, "the child's fds stayed flat"
    assert most_fds - fds_before <= 16, "this process's fds stayed flat"
    assert most_segments - segments_before <= 4, "a few pooled slabs serve them all"


@pytest.mark.anyio
@ONE_LOOP
async def test_thousands_of_arrays_in_flight(strategy: str) -> None:
    count = 1000
    q, back = aiomp.Queue(), aiomp.Queue()
    fds = fd_count()
    for i in range(count):
        await q.put(np.full(INLINE, i % 251, np.uint8))
    assert q.qsize() == count
    assert fd_count() - fds <= 16, "arrays in flight hold no fds of the sender's"
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.shm_echo_many, 1, args=(q, back), grace_period=GRACE):
            q.close()
            for i in range(count):
                got = await back.get()
                assert got[-1] == i % 251
            del got


_UNPRIVILEGED = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    import aiomp
    # imported before losing /root
    from aiomp._arrays import numpy as _numpy  # noqa: F401
    from aiomp._memory import blocks as _blocks  # noqa: F401
    from aiomp._queue import queue as _queue  # noqa: F401
    from aiomp._wire import pickling as _reduction  # noqa: F401
    from aiomp._wire import datagram as _transport  # noqa: F401
    q = aiomp.Queue()
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # CAP_SYS_RESOURCE would lift the kernel's in-flight limit
    sent = 0
    try:
        for i in range(1000):
            q.put_nowait(np.full(_numpy.INLINE_THRESHOLD, i % 251, np.uint8))
            sent += 1
    except Exception as exc:
        print(sent, type(exc).__name__, exc)
        sys.exit(1)
    print(sent)
""")


@pytest.mark.xfail(
    strict=True,
    reason="design limit: a message in flight carries one fd per "
    "segment it names, and the kernel caps an unprivileged user's in-flight fds "
    "at RLIMIT_NOFILE; aiomp raises the soft limit to the hard one, which this "
    "test pins at 256",
)
def test_thousands_of_arrays_in_flight_unprivileged() -> None:
    proc = run_python("-c", _UNPRIVILEGED)
    assert proc.stdout.strip() == "1000", proc.stdout + proc.stderr


# -- file_system: names and the janitor (R3, R5) -------------------------------------------


@pytest.mark.anyio
@ONE_LOOP
async def test_janitor_removes_names_of_a_sigkilled_child() -> None:
    ready = aiomp.Queue()
    n = 3 << 20  # a slab and a large segment
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.shm_hold_named_then_block, 1, args=(ready, n), grace_period=GRACE
        )
        names = await ready.get()
        assert len(names) == 2 and set(names) <= shm_names()
        os.kill(ctx.pids()[0], signal.SIGKILL)
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    # R5: reaping a child that died abnormally sweeps the names it left (the janitor)
    assert not set(names) & shm_names()
    assert not set(names) & set(_janitor.janitor())


def test_janitor_spares_live_creators_and_held_names(file_system: None) -> None:
    mine = aiomp.zeros(10)
    my_name = segment_of(mine).name
    # A name whose creator is dead but which a live process still holds: fake one.
    dead_pid = _dead_pid()
    held_name = f"{_janitor.PREFIX}{dead_pid}-{'0' * 16}"
    orphan_name = f"{_janitor.PREFIX}{dead_pid}-{'1' * 16}"
    held_fd = os.open(os.path.join(_janitor.SHM_DIR, held_name), os.O_RDWR | os.O_CREAT, 0o600)
    orphan_fd = os.open(os.path.join(_janitor.SHM_DIR, orphan_name), os.O_RDWR | os.O_CREAT, 0o600)
    os.close(orphan_fd)
    try:
        os.ftruncate(held_fd, 4096)
        _lease.hold(held_fd, 0, 4096)
        removed = _janitor.janitor()
        assert orphan_name in removed
        assert held_name not in removed and my_name not in removed
        assert {held_name, my_name} <= shm_names()
        assert orphan_name not in shm_names()
    finally:
        os.close(held_fd)
    assert held_name in _janitor.janitor(), "removed once nobody holds it"
    assert my_name in shm_names()


def test_janitor_tolerates_foreign_and_vanishing_names() -> None:
    foreign = os.path.join(_janitor.SHM_DIR, f"{_janitor.PREFIX}not-a-pid")
    open(foreign, "wb").close()
    try:
        assert _janitor.janitor() == []
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.anyio
@ONE_LOOP
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
@pytest.mark.parametrize(
    "start_method",
    [
        "spawn",
        "fork",
        "forkserver",
    ],
)
async def test_child_names_are_removed_when_it_exits(start_method: str) -> None:
    made, left = await _names_left_by_a_child(start_method)
    assert made == 1
    assert left == set()


async def _names_left_by_a_child(start_method: str) -> tuple[int, set[str]]:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.shm_make_named, 1, start_method=start_method, grace_period=GRACE
        ) as ctx:
            pass
    return ctx.results[0], _left_by(ctx.pids()[0])  # type: ignore[return-value]


def _left_by(pid: int) -> set[str]:
    """Names created by ``pid``; removed before returning so that no test leaks them."""
    left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    _janitor.janitor()
    return left


async def _names_left_after_receiving_from_a_child() -> tuple[set[str], set[str]]:
    q, received = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.shm_send_and_wait, 1, args=(q, received, 100_000), grace_period=GRACE
        ) as ctx:
            arr = await q.get()
            received.set()
    pid = ctx.pids()[0]
    held = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert (arr == np.arange(100_000)).all()
    del arr
    gc.collect()
    return held, _left_by(pid)


@pytest.mark.anyio
@ONE_LOOP
async def test_names_received_from_an_exited_child_are_removed() -> None:
    held, left = await _names_left_after_receiving_from_a_child()
    assert held, "the parent held the child's segment after the child exited"
    assert left == set()


async def _forwarded_block_survives_reuse(strategy: str) -> tuple[bool, bool]:
    n = (3 << 20) // 8  # a large block: a segment of its own, reused first
    q1, q2 = aiomp.Queue(), aiomp.Queue()
    a = aiomp.share_memory(np.full(n, 1.0))
    address = a.ctypes.data
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.q_forward, 1, args=(q1, q2), grace_period=GRACE):
            await q1.put(a)
            q1.close()
        del a  # the only handle left is in the message on q2
        gc.collect()
        fresh = aiomp.zeros(n)
        reused = fresh.ctypes.data == address
        fresh[:] = 2.0
        back = await q2.get()
        intact = bool((back == 1.0).all())
    del fresh, back
    return intact, reused


@pytest.mark.anyio
@ONE_LOOP
@BOTH_STRATEGIES
async def test_block_in_flight_is_never_reused(strategy: str) -> None:
    intact, reused = await _forwarded_block_survives_reuse(strategy)
    assert intact, "the forwarded array was overwritten by a new allocation"
    assert not reused


async def _segments_after_double_receive() -> int:
    q, reply = aiomp.Queue(), aiomp.Queue()
    a = aiomp.share_memory(np.arange((3 << 20) // 8, dtype=np.float64))
    b = aiomp.share_memory(np.arange(100_000, dtype=np.float64))
    x = np.arange(1000 * 100, dtype=np.float64).reshape(1000, 100)
    before = segment_count()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.shm_views, 1, args=(q, reply), grace_period=GRACE):
            await q.put((a, a[10:], b, x[:600], x[400:]))  # a named twice in one message
            await q.put(a)  # and again while the child holds it
            await reply.get()
    del a, b, x
    gc.collect()
    _blocks.purge_pool()
    return before - segment_count()


@pytest.mark.anyio
@ONE_LOOP
async def test_blocks_sent_twice_are_released(file_system: None) -> None:
    released = await _segments_after_double_receive()
    leftover = [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]
    for seg in leftover:
        _registry.REGISTRY.pool.forget(seg)  # leave /dev/shm clean for the leak check either way
    assert released >= 2 and not leftover  # a large segment and one 1 MiB slab


# -- examples ------------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["hogwild.py", "buffer_reuse.py"])
def test_example_runs(example: str) -> None:
    proc = run_python(f"examples/{example}")
    assert "ok" in proc.stdout.splitlines()[-1], proc.stdout


def test_janitor_removes_a_dead_creators_name_whose_message_was_never_read(
    file_system: None,
) -> None:
    """Regression: a name named by a message dropped unread (its queue gone) stayed in
    /dev/shm forever once its creator had died; the janitor now lets such a name go once
    nothing has been sent naming it for STALE_IN_FLIGHT seconds."""
    pid = os.fork()
    if pid == 0:  # the creator: sends a block into a message nobody will read, then dies
        try:
            q = aiomp.Queue()
            q.put_nowait(np.ones(100_000))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    names = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert names, "the child's segment should outlive it while a message names it"
    assert not set(_janitor.janitor()) & names  # in flight, and recent: kept
    for name in names:
        old = time.time() - _janitor.STALE_IN_FLIGHT - 1
        os.utime(os.path.join(_janitor.SHM_DIR, name), (old, old))
    assert set(_janitor.janitor()) >= names


# -- issue 9 item 1: file_system names outlive no one; issue 9 item 3 and issue 18 item 4:
# -- bounded fds and a clear error at the fd limit ------------------------------------------


def test_creator_exit_cleanup_then_last_release_removes_the_name(file_system: None) -> None:
    """Regression (issue 9 item 1a): a producer's exit clean-up ran while a consumer still
    held a lease, then the consumer released while the producer was still alive, and
    neither unlinked: the segment outlived both (2-3 x 8 MiB in 4 of 6 load runs). The
    creator now marks the name abandoned at exit, under the header's lock, and the last
    holder, seeing the mark, removes it."""
    q = aiomp.Queue()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the producer
        try:
            os.close(go_w)
            os.close(done_r)
            q.sync.put(np.arange(100_000, dtype=np.float64))
            os.read(go_r, 1)  # the consumer holds the array
            _registry.REGISTRY.at_exit()  # the exit clean-up runs while the lease is held
            os.write(done_w, b"x")
            os.read(go_r, 1)  # the consumer has released it: exit
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(done_w)
    try:
        arr = q.sync.get(timeout=TIMEOUT)
        names = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
        assert names, "the producer's segment"
        os.write(go_w, b"x")
        assert os.read(done_r, 1) == b"x"
        del arr  # the last release, while the producer is alive
        gc.collect()
        os.write(go_w, b"x")
    finally:
        os.close(go_w)
        os.close(done_r)
        os.waitpid(pid, 0)
    left = names & shm_names()
    _janitor.janitor()  # (the leak check must see a clean /dev/shm either way)
    assert not left


def test_discard_undoes_a_named_send(file_system: None) -> None:
    """The API for a message dropped before it was sent (issue 9 item 1b): pickling counts
    a send in the segment's header; ``Outgoing.discard()`` takes it back, so nothing is in
    flight and the name can go. ``close()`` is for a message that was sent."""
    from aiomp._wire import pickling as _reduction

    arr = aiomp.zeros(100_000)
    ref = _blocks.block_of(_shared.root(arr))
    assert ref is not None
    out = _reduction.dumps({"task": (arr, arr[10:])})
    assert ref.segment.in_flight(ref.index), "pickled: counted as sent"
    out.discard()
    assert not ref.segment.in_flight(ref.index), "discarded: nothing in flight"


@pytest.mark.anyio
@ONE_LOOP
async def test_pool_task_dropped_before_it_was_sent_leaves_no_name(file_system: None) -> None:
    """Regression (issue 9 item 1b): under file_system, a task's send count was taken when
    it was pickled; a task cancelled while it waited for a busy worker was never sent and
    never opened, so its name stayed in /dev/shm after the run."""
    started, go = aiomp.Event(), aiomp.Event()
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, grace_period=GRACE) as pool, anyio.create_task_group() as tg:
                tg.start_soon(pool.apply, funcs_shm.signal_then_wait, (started, go))
                await started.wait()
                with anyio.move_on_after(0.1):  # the worker is busy: this one never starts
                    await pool.apply(funcs_shm.nbytes, (np.ones(1 << 17),))
                go.set()
        gc.collect()
        _blocks.purge_pool()
        left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{os.getpid()}-")}
    finally:
        for seg in [s for segs in _registry.REGISTRY.pool.segments.values() for s in segs]:
            _registry.REGISTRY.pool.forget(seg)
        for name in shm_names():
            if name.startswith(f"{_janitor.PREFIX}{os.getpid()}-"):
                _janitor.unlink(name)  # pinned by the dropped task: the leak check must pass
    assert not left


_TREE = textwrap.dedent("""
    import os, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    async def main():
        aiomp.set_sharing_strategy("file_system")
        q, ready = aiomp.Queue(), aiomp.Queue()
        await aiomp.spawn(_funcs_shm.put_unread_and_wait, 1, args=(q, ready, "file_system"))
        child = await ready.get()
        await q.put(np.full(200_000, 9.0))  # the parent's own, never read either
        print(os.getpid(), child, flush=True)
        await anyio.Event().wait()  # until SIGKILLed

    anyio.run(main)
""")


def _wait_gone(pid: int, timeout: float = TIMEOUT) -> None:
    """Wait for a process that is not our child to vanish (polling the kernel's view)."""
    deadline = time.monotonic() + timeout
    while _lifecycle.pid_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived its parent"
        time.sleep(0.01)  # handshake-free: polling the kernel's view of a non-child


def _killed_tree() -> set[str]:
    """Start ``_TREE``, SIGKILL its parent, and return the names it made that are still
    there once its child has died too."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE], cwd=REPO, text=True, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        parent, child = map(int, proc.stdout.readline().split())
        names = {
            n
            for n in shm_names()
            if n.startswith((f"{_janitor.PREFIX}{parent}-", f"{_janitor.PREFIX}{child}-"))
        }
        assert {n.split("-")[1] for n in names} == {str(parent), str(child)}
        os.kill(parent, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        _wait_gone(child)  # its parent-death signal
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return names & shm_names()


#: The next program's first start, of each kind.
_NEXT_START = {
    "segment": "aiomp.set_sharing_strategy('file_system'); aiomp.zeros(1)",
    "queue": "aiomp.Queue()",
    "spawn": "async with aiomp.spawn(funcs.return_none, 1):\n        pass",
    "pool": "async with aiomp.Pool(1) as pool:\n        await pool.apply(os.getpid)",
}
_NEXT_ASYNC = textwrap.dedent("""
    import os
    import anyio
    import aiomp
    from tests.children import common as funcs

    async def main():
        {}

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("start", list(_NEXT_START))
def test_a_sigkilled_tree_is_swept_by_the_next_start(start: str) -> None:
    """Regression (issue 9 item 1c): after a parent was SIGKILLed, the next aiomp start
    cleaned 0 names, and so did janitor(): names named by unread messages were kept for
    60 s. Nothing is in flight once no live process can hold the queue: the tree is gone.

    Regression (issue 38, item 9): only the next tree's first shared segment swept; a
    program that only spawns, pools or makes a queue never removed them. Any aiomp start
    sweeps now.

    Any aiomp process's first start sweeps dead trees, a concurrent test's child
    included: a tree swept before this test's own next start is made again (three tries).
    """
    for _ in range(3):
        names = _killed_tree()
        if names:
            break
    assert names, "the dead tree's names were swept by others three times in a row"
    code = _NEXT_START[start]
    script = _NEXT_ASYNC.format(code) if "async" in code else "import aiomp\n" + code
    assert run_python("-c", script).stderr == ""
    left = names & shm_names()
    _janitor.janitor()
    assert not left, f"the next program's first {start} swept the dead tree's names"


_TREE_OF_A_CHILD = textwrap.dedent("""
    import os, signal
    import anyio
    import aiomp
    from tests.children import common as funcs

    async def main():
        aiomp.set_sharing_strategy("file_system")
        ready = aiomp.Queue()  # no array made here: this process makes no segment itself
        with anyio.fail_after(20):
            ctx = await aiomp.spawn(funcs.shm_hold_named_then_block, 1, args=(ready, 1000))
            names = await ready.get()
            from aiomp._memory.segment import H_TREE
            for name in names:
                with open(f"/dev/shm/{name}", "rb") as f:
                    f.seek(H_TREE)
                    print(os.getpid(), int.from_bytes(f.read(4), "little"), flush=True)
            os.kill(ctx.pids()[0], signal.SIGKILL)
            try:
                await ctx.join()
            except aiomp.ProcessExitedException:
                pass
        print("left", *[n for n in names if os.path.exists(f"/dev/shm/{n}")], flush=True)

    anyio.run(main)
""")


def test_a_parent_that_makes_no_segment_names_the_tree_and_sweeps() -> None:
    """A process launched with the ``AIOMP_TREE`` of another live tree in its
    environment (this one's) starts a child before it makes any array. The names the child
    makes record the child's own tree, rooted at that process (a stale tree would keep
    them from being swept once their tree is gone: SIGKILL or Ctrl-C to its root).
    And once the child is SIGKILLed, reaping it sweeps its names (R5), though the parent
    never made a segment itself."""
    env = dict(os.environ, AIOMP_TREE=f"{os.getpid()}:{_lifecycle.start_time(os.getpid())}")
    *lines, left = run_python("-c", _TREE_OF_A_CHILD, env=env).stdout.splitlines()
    assert left == "left", "reaping the SIGKILLed child swept its names"
    assert lines  # per name: the parent's pid, then the tree root its header records
    for line in lines:
        parent, root = line.split()
        assert root == parent, "the child's name records the parent as its tree's root"


_FD_LIMIT = textwrap.dedent("""
    import gc, os, resource, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    strategy, keep_alive = sys.argv[1], sys.argv[2] == "keep"

    async def main():
        aiomp.set_sharing_strategy(strategy)
        q = aiomp.Queue()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        keep, sent, error = [], 0, None
        try:
            for i in range(1000):
                arr = np.full((2 << 20) if keep_alive else (1 << 20), i % 251, np.uint8)
                if keep_alive:  # arrays the producer keeps: their segments stay open
                    arr = aiomp.share_memory(arr)
                    keep.append(arr)
                q.put_nowait(arr)
                sent += 1
        except Exception as exc:
            error = exc
        del keep, arr
        gc.collect()
        fds = len(os.listdir("/proc/self/fd"))
        with anyio.fail_after(60):
            async with aiomp.spawn(_funcs_shm.drain, 1, args=(q, sent, strategy)) as ctx:
                pass
        assert ctx.results[0] == [i % 251 for i in range(sent)], "drained exactly once"
        assert q.qsize() == 0
        print(os.getpid(), sent, fds, type(error).__name__, error)

    anyio.run(main)
""")


def _fd_limit_run(strategy: str, keep: str) -> tuple[int, int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _FD_LIMIT, strategy, keep],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pid, sent, fds, kind, message = proc.stdout.strip().split(" ", 4)
    left = {n for n in os.listdir(_janitor.SHM_DIR) if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert not left, "the names the process made went with it"
    return int(sent), int(fds), kind, message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_many_arrays_in_flight_under_a_low_fd_limit(strategy: str) -> None:
    """Regression (issue 9 item 3, issue 18 item 4): with RLIMIT_NOFILE=256, puts of 1 MiB
    arrays with nobody consuming failed at put #969 with a raw EMFILE, and the process
    could not even spawn a consumer. Segments in flight now hold no fd of the sender's
    (past IDLE_SEGMENTS they are given away): all 1000 go, and a consumer drains them."""
    sent, fds, kind, _ = _fd_limit_run(strategy, "drop")
    assert (sent, kind) == (1000, "NoneType")
    assert fds < 64 + _allocator.IDLE_SEGMENTS


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_fd_limit_is_a_clear_error_and_the_queue_drains_after(strategy: str) -> None:
    """Regression (issue 9 item 3): at the fd limit a put raised a raw
    ``OSError: [Errno 24] Too many open files: '/proc/self/fd/254'``. Now: a TransportError
    saying how many fds are open, the limit and what to do; nothing half-sent, and a
    consumer started after the error (the arrays dropped) drains the queue exactly once."""
    sent, fds, kind, message = _fd_limit_run(strategy, "keep")
    assert fds < 64 + _allocator.IDLE_SEGMENTS, "the arrays dropped: their fds went too"
    assert kind == "TransportError", message
    assert 100 < sent < 256
    assert "file descriptors open" in message and "RLIMIT_NOFILE) is 256" in message
    assert "raise the limit" in message


_SPAWN_AT_THE_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    async def main():
        q = aiomp.Queue()
        q.put_nowait(np.full(1 << 20, 7, np.uint8))  # the tree's first segment
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        held = []
        try:
            while True:
                held.append(os.dup(0))
        except OSError:
            pass
        try:
            spawn = aiomp.spawn  # with every fd in use: nothing left to import it with
        finally:
            for fd in held:
                os.close(fd)
        with anyio.fail_after(60):
            async with spawn(_funcs_shm.drain, 1, args=(q, 1, "file_descriptor")) as ctx:
                pass
        print(ctx.results[0])

    anyio.run(main)
""")


def test_the_spawn_api_is_reachable_with_every_fd_in_use() -> None:
    """The root of a tree imports the spawn API at its first shared segment: once
    messages in flight may take every fd, starting a consumer to drain them must not
    need one for an import."""
    proc = subprocess.run(
        [sys.executable, "-c", _SPAWN_AT_THE_LIMIT],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "[7]"


def test_large_arrays_hold_bounded_fds(strategy: str) -> None:
    """Regression (issue 18 item 4): each array over 1 MiB had a segment of its own at two
    fds (the memfd and the mmap's dup), and idle segments were trimmed only past 1 GiB:
    200 x 2 MiB zeros held 400 fds after all of them were dropped. Now a mapping holds no
    fd, and at most IDLE_SEGMENTS segments with no array in them are kept."""
    n = (2 << 20) // 8
    before = fd_count()
    arrays = [aiomp.zeros(n) for _ in range(200)]
    assert fd_count() - before <= 200 + 2, "one fd per segment: the mapping holds none"
    del arrays
    gc.collect()
    assert fd_count() - before <= _allocator.IDLE_SEGMENTS + 2
    q = aiomp.Queue()
    for i in range(1000):  # 1000 sent and dropped, up to 100 in flight at a time
        q.put_nowait(aiomp.zeros(n))
        if i >= 100:
            q.get_nowait()
    while not q.empty():
        q.get_nowait()
    del q
    gc.collect()
    # (arrays that came back after their segment was given away were received as
    # another process's: a few such segments stay mapped a while, see Registry.recent)
    assert fd_count() - before <= _allocator.IDLE_SEGMENTS + _registry.RECENT_SEGMENTS + 2


def test_names_of_unread_messages_go_with_the_root() -> None:
    """Regression (issue 9 item 3): under file_system, the segments named by messages that
    nobody read (about 1 GiB of /dev/shm there) stayed after the process had exited. When
    the root of a tree exits with no child left, nothing can read them any more."""
    script = textwrap.dedent("""
        import os
        import numpy as np
        import aiomp
        aiomp.set_sharing_strategy("file_system")
        q = aiomp.Queue()
        for i in range(40):
            q.put_nowait(np.full((1 << 20) + i, i, np.uint8))
        print(os.getpid(), len([n for n in os.listdir("/dev/shm")
                                if n.startswith(f"aiomp-{os.getpid()}-")]))
    """)
    proc = run_python("-c", script)
    pid, made = map(int, proc.stdout.split())
    assert made >= 6, "the unread messages held names while the process ran"
    left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    for name in left:
        _janitor.unlink(name)  # (the leak check must see a clean /dev/shm either way)
    assert not left


@pytest.mark.parametrize("shape", [-1, (4, -1), (-1, -1), (2.5,)])
def test_empty_and_zeros_refuse_bad_shapes(shape: Any) -> None:
    """``aiomp.empty(-1)`` returned 8192 elements (numpy inferred the -1 from the buffer),
    and ``(-1, -1)`` multiplied to a positive size: they raise as numpy's own do."""
    for make in (aiomp.empty, aiomp.zeros):
        with pytest.raises((ValueError, TypeError)) as numpy_err:
            np.empty(shape)
        with pytest.raises(numpy_err.type):
            make(shape)


def test_a_ctrl_c_is_not_lost_in_a_finalizer_under_trio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: chaos's ``test_sigint_to_the_parent[trio]`` timed out once. trio raised
    the KeyboardInterrupt inside ``Registry.drop_block``, a weak reference's callback, where
    Python reports it ("Exception ignored in") and drops it: the parent never saw its
    Ctrl-C. Finalizers are now protected (see docs/decisions/0022-finalizers-and-ctrl-c.md): trio
    delivers the
    interrupt at its next checkpoint instead."""
    import trio

    protected: list[bool] = []
    retire = _registry.REGISTRY.pool.retire

    def spy(*args: Any) -> None:
        protected.append(trio.lowlevel.currently_ki_protected())
        retire(*args)

    monkeypatch.setattr(_registry.REGISTRY.pool, "retire", spy)

    async def main() -> None:
        a = aiomp.empty(1 << 20, np.uint8)
        assert not trio.lowlevel.currently_ki_protected()  # the user's code is not
        del a
        gc.collect()

    trio.run(main)
    assert protected == [True]
    assert (
        _registry.Registry.drop_block.__qualname__ == "Registry.drop_block"
    )  # tracebacks still name it
