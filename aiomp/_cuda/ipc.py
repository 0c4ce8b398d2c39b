"""CUDA IPC for CuPy arrays, as aiomp's reducer registry and ``aiomp.cuda`` see it: the
reducer's registration, the fork refusal, and the public constructors, limits and
statistics.

The sending side is :mod:`aiomp._cuda.producer`, the receiving side
:mod:`aiomp._cuda.consumer`, the IPC-safe blocks :mod:`aiomp._cuda.blocks`, and this
process's state (one object, reset in a forked child) :mod:`aiomp._cuda.state`. The CUDA
calls sit behind a small backend (:mod:`aiomp._cuda.driver`); the bookkeeping around it is
plain Python that the tests drive with a fake backend on machines without a GPU.
Importing this package imports neither cupy nor ctypes.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from .. import _lifecycle
from .._wire import pickling as _reduction
from .blocks import IPC_BLOCK, IpcBlock
from .consumer import rebuild
from .driver import CUDA_ERROR_NO_DEVICE, CUDA_ERROR_NOT_INITIALIZED, get_backend, libcuda
from .meta import ArrayView
from .producer import MAX_IPC_EVENTS, reduce_array
from .state import state

__all__ = (
    "IPC_BLOCK",
    "MAX_IPC_EVENTS",
    "IpcBlock",
    "IpcStatistics",
    "cuda_initialized",
    "empty",
    "get_ipc_limit",
    "init_reductions",
    "ipc_collect",
    "rebuild",
    "reduce_array",
    "set_ipc_limit",
    "statistics",
)


def init_reductions() -> None:
    """Register aiomp's reducer for ``cupy.ndarray`` (called by
    :func:`aiomp._wire.pickling.init_reductions` once cupy has been imported)."""
    cupy: Any = sys.modules["cupy"]
    _reduction.register(cupy.ndarray, reduce_array)


def cuda_initialized() -> bool:
    """True if CUDA has been initialised in this process (R14: fork would be unsafe).

    Cheap and side-effect free: False when cupy is not imported; otherwise asks an
    *already loaded* libcuda whether ``cuInit`` has run (``cuDeviceGetCount`` answers
    CUDA_ERROR_NOT_INITIALIZED before it), loading nothing and initialising nothing.
    """
    if "cupy" not in sys.modules:
        return False
    if state.producer is not None or state.consumer is not None:
        return True
    lib = libcuda(noload=True)
    if lib is None:
        return False
    import ctypes

    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return rc not in (CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NO_DEVICE)


@_lifecycle.on_fork_check
def _refuse_fork() -> None:
    """A forked child cannot use the CUDA its parent initialised: refuse the fork."""
    if cuda_initialized():
        raise RuntimeError(
            "cannot fork: CUDA is initialised in this process and a forked child "
            "cannot use it; use start_method='spawn' or 'forkserver'"
        )


def empty(shape: Any, dtype: Any = float, *, zero: bool = False) -> Any:
    """See :func:`aiomp.cuda.empty` (``zero``: :func:`aiomp.cuda.zeros`)."""
    import numpy

    dt = numpy.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"a CUDA array cannot hold Python objects (dtype {dt})")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(n, int | numpy.integer) for n in dims):
        raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}")
    dims = tuple(int(n) for n in dims)
    if any(n < 0 for n in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    nbytes = dt.itemsize
    for n in dims:
        nbytes *= n
    backend = get_backend()
    dev = backend.current_device()
    if nbytes == 0:
        return backend.empty(dims, dt.str, dev)
    with state.lock:
        block = state.pool.take(backend, dev, nbytes)
    if zero:
        backend.memset(dev, block.ptr, nbytes)  # on the current stream, like cupy.zeros
    strides, acc = [], dt.itemsize
    for n in reversed(dims):
        strides.append(acc)
        acc *= n
    return backend.wrap(block, ArrayView(0, dims, tuple(reversed(strides)), dt.str))


def ipc_collect() -> int:
    """Free sent blocks that every consumer has released; returns how many are still held."""
    prod = state.own_producer()
    if prod is None:
        return 0
    with state.lock:
        return prod.collect()


def get_ipc_limit() -> int:
    return state.limit


def set_ipc_limit(limit: int) -> None:
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"the limit must be an int >= 1, not {limit!r}")
    with state.lock:
        state.limit = limit
        if state.producer is not None:
            state.producer.table.limit = limit


class IpcStatistics(NamedTuple):
    """A snapshot of this process's CUDA IPC state (see :func:`aiomp.cuda.statistics`)."""

    sent_held: int  #: blocks sent and not yet seen released (as of the last collect)
    sent_bytes: int  #: bytes in those blocks' allocations
    events: int  #: interprocess events held for them
    received_held: int  #: received blocks this process still has views of
    received_open: int  #: IPC memory handles this process has open
    limit: int  #: the outstanding-block limit
    idle_blocks: int  #: IPC-safe blocks (aiomp.cuda.empty, staging) cached for reuse


IpcStatistics.__module__ = "aiomp.cuda"


def statistics() -> IpcStatistics:
    with state.lock:
        prod = state.own_producer()
        cons = state.consumer
        held = sum(1 for r in cons.slots.values() if r() is not None) if cons else 0
        return IpcStatistics(
            len(prod.table) if prod else 0,
            prod.held_bytes() if prod else 0,
            prod.events_live if prod else 0,
            held,
            len(cons.mappings) if cons else 0,
            state.limit,
            state.pool.idle_count(),
        )
