"""What a CuPy array becomes in a message, and where it sits in its allocation. Pure.

:class:`IpcArrayMeta` is one small tuple per array: the ``cudaIpcMemHandle`` of the block
holding it, the byte offset of element 0 in it, shape, strides, dtype, the device (index
and PCI bus id), a ``cudaIpcEventHandle`` recorded on the sender's current stream, and the
lease slot that keeps the block alive. :func:`extent`, :func:`locate` and
:func:`check_extent` are the offset arithmetic; :func:`held_ranges` asks the kernel which
slots of a lease file some description holds. Owns no OS resource.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .._memory import lease as _lease

if TYPE_CHECKING:
    from .driver import Described


class IpcArrayMeta(NamedTuple):
    """What a CuPy array becomes in an aiomp message."""

    handle: bytes | None  #: cudaIpcMemHandle of the base allocation; None: empty array
    alloc_size: int  #: bytes in the base allocation
    offset: int  #: byte offset of element 0 from the base
    shape: tuple[int, ...]
    strides: tuple[int, ...]  #: in bytes, as cupy reports them
    dtype: str  #: numpy dtype string, e.g. ``"<f4"``
    device: int  #: device index in the sender
    bus_id: str  #: PCI bus id of the device ("" if unknown): indices differ between processes
    event: bytes | None  #: cudaIpcEventHandle to wait on; None: the sender synchronised
    pid: int  #: the sender's pid
    slot: int  #: lease slot in the sender's lease file; -1 for empty arrays
    fd_index: int  #: index of the lease handoff fd among the message's fds; -1 if none


class ArrayView(NamedTuple):
    """Where a new array lies in its block (what a backend's ``wrap`` reads)."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  #: in bytes
    dtype: str  #: numpy dtype string


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` an array touches, relative to its element 0.

    ``lo`` is negative when some stride is; ``(0, 0)`` for an empty array.
    """
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    if any(n == 0 for n in shape):
        return 0, 0
    lo = hi = 0
    for n, s in zip(shape, strides, strict=True):
        if n < 0:
            raise ValueError(f"negative dimension in shape {shape}")
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def locate(desc: Described, base: int, size: int) -> int:
    """The offset of the element 0 of the array ``desc`` describes in the allocation
    ``[base, base+size)``.

    Raises ValueError if any byte the array touches falls outside the allocation.
    """
    offset = desc.ptr - base
    check_extent(offset, size, desc.shape, desc.strides, desc.itemsize)
    return offset


def check_extent(
    offset: int, size: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> None:
    """Raise ValueError unless the array at ``offset`` lies inside ``size`` bytes."""
    lo, hi = extent(shape, strides, itemsize)
    if hi == lo:
        return
    if offset + lo < 0 or offset + hi > size:
        raise ValueError(
            f"array bytes [{offset + lo}, {offset + hi}) fall outside its allocation "
            f"of {size} bytes (shape {shape}, strides {strides}, itemsize {itemsize})"
        )


# -- lease bookkeeping (producer side) ------------------------------------------------------


def held_ranges(fd: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` that some other description holds a lease on.

    ``F_OFD_GETLK`` names one conflicting lock per call, not necessarily the lowest, so
    this splits around each answer: about two calls per held range, one if none is held.
    Returns sorted, possibly adjacent, ``(start, stop)`` pairs.
    """
    out: list[tuple[int, int]] = []
    todo = [(start, stop)]
    while todo:
        a, b = todo.pop()
        if a >= b:
            continue
        holder = _lease.a_holder(fd, a, b - a)
        if holder is None:
            continue
        lstart, length = holder
        lstop = b if length == 0 else lstart + length
        lo, hi = max(a, lstart), min(b, lstop)
        if lo >= hi:  # defensive: the kernel only reports overlapping locks
            continue
        out.append((lo, hi))
        todo.append((a, lo))
        todo.append((hi, b))
    out.sort()
    return out
