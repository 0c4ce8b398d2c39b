"""Shared memory: numpy arrays as zero-copy handles: the constructors, share_memory,
every dtype, layouts and views, arrays in containers and through the async calls.

Layouts observed (documented in ``aiomp._arrays.numpy``): C- and Fortran-contiguous arrays keep
their layout; a non-contiguous view of a base at most ``VIEW_SLACK`` times its size keeps
its strides (the whole base travels once); a view of a much larger base is compacted to
C order.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from aiomp._arrays import numpy as _numpy
from tests.memory._shm import INLINE, big


def roundtrip(obj: object) -> Any:
    """Send ``obj`` through a fresh queue and read it back in this process."""
    q = aiomp.Queue()
    q.sync.put(obj)
    return q.sync.get(timeout=5)


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
