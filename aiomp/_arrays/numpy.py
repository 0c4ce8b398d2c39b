"""numpy arrays in aiomp messages: the ndarray reducer and one-array messages.

An array inside a message (a Queue item, ``spawn`` args, a Pool task or result):

- already in shared memory (made by :func:`share_memory`, :func:`zeros`, :func:`empty`,
  or received): only its handle travels (block, offset, shape, dtype, strides): the cost
  does not grow with its size, and the receiver sees the same memory (writes are shared);
- otherwise, if it holds at least :data:`INLINE_THRESHOLD` bytes (and no Python objects):
  it is copied once into a pooled shared block, and the receiver gets a writable view of
  that block. The bytes it spans are copied as they are, so it keeps its strides, unless
  it spans more than :data:`VIEW_SLACK` times its own size (a sparse view of a large
  base), in which case it is compacted to C order (Fortran order if it is F-contiguous);
- smaller arrays, and object arrays, are pickled inline, as by numpy itself;
- views stay views: arrays of one message that view overlapping memory (``[x, x[2],
  x[:, 1]]``) are rebuilt as views of one shared copy of the bytes they span together,
  whatever their own sizes. Arrays whose memory does not overlap travel independently.

Why 64 KiB: docs/decisions/0011-inline-threshold.md. Owns no OS resource: the blocks
and the descriptions a message carries are the memory layer's (:mod:`aiomp._memory.blocks`).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import pickle
import struct
from typing import Any, cast

import numpy as np

from .._memory import blocks as _blocks
from .._memory.segment import Segment
from .._wire import pickling as _reduction
from .shared import address as _address
from .shared import root as _root
from .shared import share_memory
from .shared import shared_block as _shared_block

#: Arrays with fewer bytes than this travel inside the message.
INLINE_THRESHOLD = 64 * 1024
#: A view is sent together with its whole base when the base is at most this much larger.
VIEW_SLACK = 4


def _rebuild(
    exporter: ctypes.Array[ctypes.c_char],
    offset: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any] | str,
    strides: tuple[int, ...],
) -> np.ndarray[Any, Any]:
    return np.ndarray(
        shape,
        dtype,
        buffer=exporter,  # type: ignore[arg-type]  # a ctypes array (see aiomp._arrays.shared)
        offset=offset,
        strides=strides,
    )


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


def init_reductions() -> None:
    """Register numpy's reducer for aiomp messages (called once numpy has been imported)."""
    _reduction.register(np.ndarray, _reduce)
    _reduction.register_alone(np.ndarray, _send_alone)


# -- one array alone in a message: no pickler (see
# docs/decisions/0013-one-array-messages.md). The body is a pickle all the same, of one call:
# ``_receive(head)``, the handle packed by hand.

#: segment size, block size, block index, device, inode, offset in the block, ndim; then
#: shape and strides (``<q`` each), then the dtype's string
_HEAD = struct.Struct("<QQQQQQB")
_dims_structs: dict[int, struct.Struct] = {}


def _dims(ndim: int) -> struct.Struct:
    packer = _dims_structs.get(ndim)
    if packer is None:
        packer = _dims_structs[ndim] = struct.Struct(f"<{2 * ndim}q")
    return packer


def _global(name: str) -> bytes:
    """Pickle opcodes that push this module's ``name`` (PROTO 5, two strings, STACK_GLOBAL)."""
    module = __name__.encode()
    return (
        b"\x80\x05\x8c" + bytes((len(module),)) + module
        + b"\x8c" + bytes((len(name),)) + name.encode() + b"\x93"
    )  # fmt: skip


_CALL_RECEIVE = _global("_receive")


def _send_alone(arr: np.ndarray[Any, Any], prefix: bytes) -> _reduction.Message | None:
    """The message for ``arr`` sent alone, or None where only the pickler does it right:
    arrays of Python objects, structured dtypes, the ``file_system`` strategy, and
    arrays to copy that are not C-contiguous and aligned (their strides and views)."""
    if arr.dtype.hasobject:
        return None
    token = _dtype_token(arr.dtype)
    if not isinstance(token, str):
        return None
    exporter = _root(arr)
    if exporter is not None:
        sent = _blocks.send_block(exporter)
        if sent is not None:
            offset = _address(arr) - ctypes.addressof(exporter)  # type: ignore[arg-type]
            return _message(prefix, sent, offset, arr, token)
        if _blocks.block_of(exporter) is not None:
            return None  # shared, in a named segment: the pickler counts its sends
    if arr.nbytes < INLINE_THRESHOLD:
        # what the pickler does for it too: numpy's own reduction, inline
        return _reduction.Message(prefix + pickle.dumps(arr, 5))
    flags = arr.flags
    if not (flags.c_contiguous and flags.aligned):
        return None
    try:
        data = arr.data.cast("B")
    except (ValueError, TypeError, BufferError):  # a dtype numpy does not export
        return None
    sent = _blocks.send_copy(data)
    if sent is None:
        return None
    return _message(prefix, sent, 0, arr, token)


def _message(
    prefix: bytes,
    sent: tuple[int, Segment, int],
    offset: int,
    arr: np.ndarray[Any, Any],
    token: str,
) -> _reduction.Message:
    fd, segment, index = sent
    try:
        ndim = arr.ndim
        head = (
            _HEAD.pack(segment.size, segment.block_size, index, *segment.key, offset, ndim)
            + _dims(ndim).pack(*arr.shape, *arr.strides)
            + token.encode()
        )
        size = len(head)
        op = b"C" + bytes((size,)) if size < 256 else b"B" + size.to_bytes(4, "little")
        body = b"".join((prefix, _CALL_RECEIVE, op, head, b"\x85R."))  # TUPLE1 REDUCE STOP
        return _reduction.Message(body, [fd], [lambda: os.close(fd)])
    except BaseException:
        os.close(fd)
        raise


def _receive(head: bytes) -> np.ndarray[Any, Any]:
    """Rebuild an array sent by :func:`_send_alone` (unpickling its message)."""
    size, block_size, index, dev, ino, offset, ndim = _HEAD.unpack_from(head)
    dims = _dims(ndim).unpack_from(head, _HEAD.size)
    exporter = _blocks.receive_block(size, block_size, index, (dev, ino))
    return np.ndarray(
        dims[:ndim],
        head[_HEAD.size + 16 * ndim :].decode(),
        buffer=exporter,  # type: ignore[arg-type]  # a ctypes array (see aiomp._arrays.shared)
        offset=offset,
        strides=dims[ndim:],
    )


def _reduce(arr: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    shared = _shared_block(arr)
    if shared is not None:
        return _by_handle(arr, *shared)
    if arr.dtype.hasobject or arr.nbytes == 0:
        return cast("tuple[Any, ...]", arr.__reduce_ex__(5))
    pad = _reduction.current()
    return pad.once(_MessageArrays, lambda: _MessageArrays(pad.first)).reduce(arr, pad)


def _by_handle(
    arr: np.ndarray[Any, Any], ref: _blocks.BlockRef, exporter: object
) -> tuple[Any, ...]:
    offset = _address(arr) - ctypes.addressof(exporter)  # type: ignore[arg-type]
    return _rebuild, (ref, offset, arr.shape, _dtype_token(arr.dtype), arr.strides)


def _bounds(arr: np.ndarray[Any, Any]) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that ``arr`` views (any strides, negative ones included)."""
    lo = hi = _address(arr)
    for n, stride in zip(arr.shape, arr.strides, strict=True):
        if stride < 0:
            lo += stride * (n - 1)
        else:
            hi += stride * (n - 1)
    return lo, hi + arr.itemsize


#: Copies keep each item's address modulo this, so aligned items stay aligned (numpy
#: aligns no dtype beyond 16 bytes).
_ALIGN = 16
_SKIP = (int, (0,))  # what a first pass that will be discarded sends in place of an array


class _Group:
    """Bytes ``[lo, hi)`` of the sender's memory, viewed by items of one message.

    ``exporter`` is their shared copy (the bytes at ``shift`` in it), or None when the one
    item there went inline or compacted: then nothing else may view those bytes.
    """

    __slots__ = ("exporter", "hi", "lo", "ref", "shift")

    def __init__(self, lo: int, hi: int, exporter: ctypes.Array[ctypes.c_char] | None) -> None:
        self.lo, self.hi, self.shift = lo, hi, lo % _ALIGN
        self.exporter = exporter
        self.ref = None if exporter is None else _blocks.block_of(exporter)
        if exporter is not None:
            ctypes.memmove(ctypes.addressof(exporter) + self.shift, lo, hi - lo)

    @classmethod
    def copy(cls, lo: int, hi: int) -> _Group:
        return cls(lo, hi, _blocks.allocate(lo % _ALIGN + hi - lo))

    def view(self, arr: np.ndarray[Any, Any]) -> tuple[Any, ...]:
        offset = self.shift + _address(arr) - self.lo
        return _rebuild, (self.ref, offset, arr.shape, _dtype_token(arr.dtype), arr.strides)


class _MessageArrays:
    """The non-shared arrays of one message, placed by the memory they view.

    Views stay views: arrays of one message whose bytes overlap travel as views of one
    shared copy of the bytes they span together, whatever their own sizes. The first pass
    keeps groups of disjoint byte ranges in address order. An array that falls inside a
    group with a shared copy is sent as a view of it; one that overlaps a group in any
    other way (a small view sent inline before the array it views) asks for a second
    pass, which knows every array's range from the start and copies each overlapping
    cluster once.
    """

    __slots__ = ("clusters", "conflict", "groups", "seen", "starts")

    def __init__(self, first: _reduction.Scratchpad | None) -> None:
        self.starts: list[int] = []
        self.groups: list[_Group] = []
        self.seen: list[tuple[int, int]] = []
        self.conflict = False
        self.clusters: dict[int, _Cluster] | None = None
        previous = (
            None if first is None else cast("_MessageArrays | None", first.get(_MessageArrays))
        )
        if previous is not None:
            self.clusters = _clusters(previous.seen)

    def reduce(self, arr: np.ndarray[Any, Any], pad: _reduction.Scratchpad) -> tuple[Any, ...]:
        lo, hi = _bounds(arr)
        self.seen.append((lo, hi))
        pad.keep_alive(arr)  # no address seen here is reused while pickling
        if self.clusters is not None:
            cluster = self.clusters.get(lo)
            if cluster is not None and cluster.count > 1 and cluster.hi >= hi:
                if cluster.group is None:
                    cluster.group = _Group.copy(cluster.lo, cluster.hi)
                return cluster.group.view(arr)
            return self._alone(arr, lo, hi, pad)
        i = bisect.bisect_right(self.starts, lo) - 1
        for j in (i, i + 1):
            if 0 <= j < len(self.groups):
                group = self.groups[j]
                if group.lo < hi and lo < group.hi:
                    if group.exporter is not None and group.lo <= lo and hi <= group.hi:
                        return group.view(arr)
                    self.conflict = True
                    _reduction.retry()
                    return _SKIP
        if self.conflict:
            return _SKIP  # this pass is discarded: spare the copies
        return self._alone(arr, lo, hi, pad)

    def _alone(
        self, arr: np.ndarray[Any, Any], lo: int, hi: int, pad: _reduction.Scratchpad
    ) -> tuple[Any, ...]:
        if arr.nbytes < INLINE_THRESHOLD:
            reduced, group = cast("tuple[Any, ...]", arr.__reduce_ex__(5)), _Group(lo, hi, None)
        elif hi - lo <= VIEW_SLACK * arr.nbytes:
            group = _Group.copy(lo, hi)
            reduced = group.view(arr)
        else:  # a sparse view of much more memory: compacted
            copy = share_memory(arr)
            pad.keep_alive(copy)
            shared = _shared_block(copy)
            assert shared is not None
            reduced, group = _by_handle(copy, *shared), _Group(lo, hi, None)
        i = bisect.bisect_right(self.starts, lo)
        self.starts.insert(i, lo)
        self.groups.insert(i, group)
        return reduced


class _Cluster:
    """Second pass: the overlapping ranges of the first pass, merged."""

    __slots__ = ("count", "group", "hi", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.count = lo, hi, 0
        self.group: _Group | None = None


def _clusters(seen: list[tuple[int, int]]) -> dict[int, _Cluster]:
    """Every range's start -> the cluster of overlapping ranges it belongs to."""
    out: dict[int, _Cluster] = {}
    current: _Cluster | None = None
    for lo, hi in sorted(seen):
        if current is None or lo >= current.hi:
            current = _Cluster(lo, hi)
        current.hi = max(current.hi, hi)
        current.count += 1
        out[lo] = current
    return out
