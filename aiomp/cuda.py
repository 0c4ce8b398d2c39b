"""CuPy arrays between processes, as CUDA IPC handles: ``aiomp.cuda``.

A ``cupy.ndarray`` anywhere in an aiomp message (a :class:`aiomp.Queue` item,
``aiomp.spawn(args=...)``, a Pool task's arguments or result) arrives as a
``cupy.ndarray`` on the *same device memory*, and the receiver's current stream waits for
an event recorded on the sender's current stream at ``put``. Importing aiomp never
imports cupy. How it works: docs/decisions/0030-cuda-ipc.md.

What travels in place, and what as a copy:

- arrays from :func:`empty` / :func:`zeros` (IPC-safe blocks, whole multiples of
  :data:`IPC_BLOCK`, 2 MiB): always in place, so a consumer's writes are seen by the
  producer. Build arrays that are written by consumers, or sent often, this way;
- other arrays of 2 MiB or more: in place, in their CuPy allocation;
- smaller arrays from CuPy's pool: as a copy made at ``put`` on the producer's stream
  (the driver shares whole blocks, neighbours included); writes are not seen back, and
  views of one small buffer arrive as separate copies.

Rules:

- **Keep the producer alive** until its consumers are done: what it sent is valid only
  while it lives (it warns at exit with the count still held). Do not *return* a CuPy
  array from a spawned function or a Pool task; return ``cupy.asnumpy(x)``, or keep the
  process alive until the receiver replies.
- **Consumers drop received arrays promptly** (or copy them): a held view pins the
  producer's memory. Past :func:`get_ipc_limit` blocks (1000 by default) outstanding per
  producer, ``put`` raises :class:`IpcLimitError`; a request/reply window keeps it bounded.
- **Stream order**: ``put`` inside ``with stream:`` if the array was filled on a
  non-current stream. A consumer using it on another stream makes that stream wait on the
  current one, and synchronises it before dropping the array.
- A received array cannot be sent onward (:class:`CudaIpcError`): send a copy.
- ``start_method="fork"`` raises in a process that has initialised CUDA: use ``"spawn"``
  or ``"forkserver"`` and create CUDA state in the children.
- Every receiver must see the device (matched by PCI bus id, so device order may differ);
  otherwise ``get`` raises :class:`CudaIpcError`, as do ``put``, ``get`` and
  :func:`empty` without a usable GPU. ``cudaMallocAsync`` pools, managed and virtual
  memory cannot be exported in place (:class:`CudaIpcError`): copy into :func:`empty`.
- Out of device memory in :func:`empty` or a copy at ``put``, aiomp frees released sent
  blocks, its idle blocks and CuPy's cache, and retries once. CuPy's own allocations do
  not call back into aiomp: call :func:`ipc_collect` and retry.

Limits: :data:`DEFAULT_IPC_LIMIT` outstanding blocks per producer (:func:`set_ipc_limit`);
:data:`MAX_IPC_EVENTS` live IPC events per producer (past it, a send synchronises the
stream instead of recording an event).

Errors::

    RuntimeError
     +-- CudaIpcError      an array could not be sent (put) or received (get)
          +-- IpcLimitError    too many sent blocks still held by consumers (put)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._cuda.ipc import (
    IPC_BLOCK,
    MAX_IPC_EVENTS,
    IpcStatistics,
)
from ._cuda.ipc import empty as _empty
from ._cuda.ipc import get_ipc_limit as _get_ipc_limit
from ._cuda.ipc import ipc_collect as _ipc_collect
from ._cuda.ipc import set_ipc_limit as _set_ipc_limit
from ._cuda.ipc import statistics as _statistics
from ._cuda.slots import DEFAULT_IPC_LIMIT
from ._errors import CudaIpcError, IpcLimitError

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = (
    "DEFAULT_IPC_LIMIT",
    "IPC_BLOCK",
    "MAX_IPC_EVENTS",
    "CudaIpcError",
    "IpcLimitError",
    "IpcStatistics",
    "empty",
    "get_ipc_limit",
    "ipc_collect",
    "set_ipc_limit",
    "statistics",
    "zeros",
)


# ``Any`` results: a ``cupy.ndarray`` (cupy ships no type information).


def empty(shape: int | tuple[int, ...], dtype: DTypeLike = float) -> Any:
    """A ``cupy.ndarray`` in an IPC-safe block: it travels in place, whatever its size.

    The block is a whole cudaMalloc of a multiple of :data:`IPC_BLOCK` (2 MiB) bytes,
    allocated on the current device outside CuPy's pool, so a consumer that opens it sees
    this array's memory and nothing else. Blocks are pooled: once neither this process nor
    any consumer it was sent to holds the array, its block is reused by the next call.
    Contents are uninitialised. Out of device memory: collects released sent blocks,
    frees cached ones (aiomp's and CuPy's) and retries once; a second failure raises
    CuPy's error. Without a usable GPU: :class:`CudaIpcError`.
    """
    return _empty(shape, dtype)


def zeros(shape: int | tuple[int, ...], dtype: DTypeLike = float) -> Any:
    """:func:`empty`, filled with zeros on the current stream."""
    return _empty(shape, dtype, zero=True)


def ipc_collect() -> int:
    """Free the CUDA blocks this process sent that every consumer has released.

    Returns the number of sent blocks still held by some consumer (or still in flight).
    aiomp also collects at every send; call this to free memory sooner, or to check that
    consumers are done (0) before this process exits. Never blocks; costs a few
    syscalls, no CUDA calls.
    """
    return _ipc_collect()


def get_ipc_limit() -> int:
    """The most blocks this process may have sent and not seen released."""
    return _get_ipc_limit()


def set_ipc_limit(limit: int) -> None:
    """Set the outstanding-block limit (an int >= 1; default :data:`DEFAULT_IPC_LIMIT`).

    Past the limit, sending a CuPy array raises :class:`IpcLimitError` at ``put``.
    """
    _set_ipc_limit(limit)


def statistics() -> IpcStatistics:
    """A snapshot of this process's CUDA IPC state, as sender and as receiver.

    ``sent_held`` is as of the last collection: call :func:`ipc_collect` first for a
    current figure.
    """
    return _statistics()
