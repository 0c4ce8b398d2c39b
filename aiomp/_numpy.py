"""numpy arrays in aiomp messages, and the shared-array constructors.

An array inside a message (a Queue item, ``spawn`` args, a Pool task or result):

- already in shared memory (made by :func:`share_memory`, :func:`zeros`, :func:`empty`,
  or received): only its handle travels (block, offset, shape, dtype, strides): the cost
  does not grow with its size, and the receiver sees the same memory (writes are shared);
- otherwise, if it holds at least :data:`INLINE_THRESHOLD` bytes (and no Python objects):
  it is copied once into a pooled shared block, and the receiver gets a writable view of
  that block. A C- or Fortran-contiguous array keeps its layout; any other view is
  compacted to C order, unless it is a view of a base array no more than
  :data:`VIEW_SLACK` times its size, in which case the whole base is copied once per
  message and every view of it in that message stays a view of one buffer;
- smaller arrays, and object arrays, are pickled inline, as by numpy itself.

Why 64 KiB: below it a copy through the socket (about 5 us for 64 KiB) costs less than
preparing a shared block (a lease syscall and an fd in the message, and on the receiver a
stat, a lock and an exporter), and small items keep the datagram small.
"""

from __future__ import annotations

import ctypes
from typing import Any, Literal, cast

import numpy as np

from . import _reduction, _shm

#: Arrays with fewer bytes than this travel inside the message.
INLINE_THRESHOLD = 64 * 1024
#: A view is sent together with its whole base when the base is at most this much larger.
VIEW_SLACK = 4

__all__ = ("empty", "is_shared", "share_memory", "zeros")


def _root(arr: np.ndarray[Any, Any]) -> object:
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def _address(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.__array_interface__["data"][0])


def _shared_block(arr: np.ndarray[Any, Any]) -> tuple[_shm.BlockRef, object] | None:
    exporter = _root(arr)
    if exporter is None:
        return None
    ref = _shm.block_of(exporter)
    return None if ref is None else (ref, exporter)


def is_shared(arr: np.ndarray[Any, Any]) -> bool:
    """True if ``arr`` lives in aiomp shared memory (sending it sends only a handle)."""
    return isinstance(arr, np.ndarray) and _shared_block(arr) is not None


def _new_like(shape: tuple[int, ...], dtype: np.dtype[Any], order: Literal["C", "F"],
              zero: bool) -> np.ndarray[Any, Any]:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"arrays of dtype {dtype} hold Python objects and cannot be shared")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    exporter = _shm.allocate(nbytes, zero=zero)
    return np.ndarray(shape, dtype, buffer=exporter, order=order)  # type: ignore[arg-type]


def empty(shape: int | tuple[int, ...], dtype: Any = float) -> np.ndarray[Any, Any]:
    """A new uninitialised array in shared memory. Raises SharedMemoryError when full."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return _new_like(shape, np.dtype(dtype), "C", zero=False)


def zeros(shape: int | tuple[int, ...], dtype: Any = float) -> np.ndarray[Any, Any]:
    """A new zero-filled array in shared memory. Raises SharedMemoryError when full."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return _new_like(shape, np.dtype(dtype), "C", zero=True)


def _layout(arr: np.ndarray[Any, Any]) -> Literal["C", "F"]:
    return "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"


def share_memory(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An array with ``arr``'s contents in shared memory; ``arr`` itself if it already is.

    The copy keeps a C or Fortran layout; other strides are compacted to C order.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"share_memory() needs a numpy.ndarray, not {type(arr).__name__}")
    if _shared_block(arr) is not None:
        return arr
    out = _new_like(arr.shape, arr.dtype, _layout(arr), zero=False)
    np.copyto(out, arr, casting="no")
    return out


def _rebuild(exporter: ctypes.Array[ctypes.c_char], offset: int, shape: tuple[int, ...],
             dtype: np.dtype[Any] | str, strides: tuple[int, ...]) -> np.ndarray[Any, Any]:
    return np.ndarray(shape, dtype, buffer=exporter,  # type: ignore[arg-type]
                      offset=offset, strides=strides)


_dtype_tokens: dict[np.dtype[Any], np.dtype[Any] | str] = {}


def _dtype_token(dtype: np.dtype[Any]) -> np.dtype[Any] | str:
    """A plain dtype travels as its string (a fifth of the cost); others as themselves."""
    token = _dtype_tokens.get(dtype)
    if token is None:
        token = dtype
        if dtype.fields is None and dtype.subdtype is None and np.dtype(dtype.str) == dtype:
            token = dtype.str
        if len(_dtype_tokens) < 1024:
            _dtype_tokens[dtype] = token
    return token


def reducers() -> dict[type, object]:
    """Reducers for :mod:`aiomp._reduction` (installed once numpy is imported)."""
    return {np.ndarray: _reduce}


def _reduce(arr: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    shared = _shared_block(arr)
    if shared is None:
        if arr.nbytes < INLINE_THRESHOLD or arr.dtype.hasobject:
            return cast("tuple[Any, ...]", arr.__reduce_ex__(5))
        copy = _copy_for_message(arr)
        # The copy's only owner is this message until it is sent: keep it alive so its
        # block is not retired (and reused) before the message's lease holds it.
        _reduction.current().memo[("aiomp-np-copy", id(copy))] = copy
        shared = _shared_block(copy)
        assert shared is not None
        if copy.shape == arr.shape and copy.dtype == arr.dtype:
            arr = copy
    ref, exporter = shared
    offset = _address(arr) - ctypes.addressof(exporter)  # type: ignore[arg-type]
    return _rebuild, (ref, offset, arr.shape, _dtype_token(arr.dtype), arr.strides)


def _copy_for_message(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A shared copy to send in place of ``arr``.

    Either a copy of ``arr`` itself, or, for a view of a base not much larger, the view's
    counterpart inside a copy of the base, made once per message so that views sent
    together stay views of one buffer.
    """
    base = arr
    while isinstance(base.base, np.ndarray):
        base = base.base
    memo = _reduction.current().memo
    key = ("aiomp-np-base", id(base))
    hit = memo.get(key)
    if hit is None:
        if base is not arr and (
            not (base.flags.c_contiguous or base.flags.f_contiguous)
            or base.nbytes > VIEW_SLACK * arr.nbytes
        ):
            return share_memory(arr)
        # the memo keeps ``base`` alive, so its id cannot be reused within this message
        hit = memo[key] = (base, share_memory(base))
    base_copy: np.ndarray[Any, Any] = cast("tuple[object, Any]", hit)[1]
    if base is arr:
        return base_copy
    offset = _address(base_copy) + (_address(arr) - _address(base))
    exporter = cast("ctypes.Array[ctypes.c_char]", _root(base_copy))
    return np.ndarray(arr.shape, arr.dtype, buffer=exporter,  # type: ignore[arg-type]
                      offset=offset - ctypes.addressof(exporter), strides=arr.strides)
