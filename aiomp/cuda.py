"""CuPy arrays between processes, as CUDA IPC handles: ``aiomp.cuda``.

A ``cupy.ndarray`` anywhere in an aiomp message (a :class:`aiomp.Queue` item,
``aiomp.spawn(args=...)``, a Pool task's arguments or result) travels as a CUDA IPC handle
of the allocation holding it, plus its offset, shape, strides, dtype and device, and an
event recorded on the sender's current stream. The receiver gets a ``cupy.ndarray`` on
the *same device memory* (no copy), and its current stream waits for that event, so
kernels the sender launched before ``put`` have finished before the receiver's work on
the array runs. Importing aiomp never imports cupy: this machinery loads the first time a
message is pickled after your program has imported cupy.

Which arrays travel in place: the 2 MiB rule
--------------------------------------------
A CUDA IPC handle shares the *whole* memory block under an allocation, and the driver
packs small cudaMallocs (CuPy rounds requests to 512 bytes) side by side into shared
blocks: a consumer of one small array would map its neighbours too, and two small
arrays could need two handles backed by one block. The CUDA programming guide
recommends sharing only allocations of whole 2 MiB multiples. So:

- Arrays from :func:`empty` / :func:`zeros` live in **IPC-safe blocks** (whole,
  2 MiB-multiple allocations, outside CuPy's pool) and always travel **in place**:
  the consumer's writes are seen by the producer, as with ``aiomp.zeros`` on the host.
  Blocks are pooled and reused once neither the producer nor any consumer holds them.
- Any other CuPy array whose bytes span less than :data:`IPC_BLOCK` (2 MiB) travels as
  a **copy**: at ``put``, aiomp copies it (device to device, on the producer's current
  stream, before the event is recorded) into an IPC-safe staging block that the small
  arrays of one message share. The consumer gets the copy; its writes are not seen by
  the producer, and views of one small buffer arrive as separate copies.
- Larger arrays travel in place, in their CuPy allocation (2 MiB or more, which the
  driver does not pack with others).

Build arrays that consumers should write into, or that you send often, with
:func:`empty`; small scratch arrays can stay in CuPy's pool and be copied.

Out of memory
-------------
When an IPC-safe block cannot be allocated (by :func:`empty`, or for a staging copy
at ``put``), aiomp frees sent blocks that every consumer has released
(:func:`ipc_collect`), its idle IPC-safe blocks and CuPy's cached blocks
(``free_all_blocks``), and retries once; a second failure raises CuPy's error.
torch does the same from its allocator's out-of-memory callback. CuPy's own
allocations (``cupy.empty``) do not call back into aiomp: if they run out while
released blocks await collection, call :func:`ipc_collect` and retry.

Lifetime: who keeps what alive
-------------------------------
CUDA requires an exported allocation to stay valid while other processes use it. aiomp
handles that for you, with reference counts kept by the kernel:

- The **producer** (the sending process) keeps every block it sent alive, even when you
  drop your own array, until every process that received it has released it; that
  is every array's own memory, even when CuPy's pool split several of them from one
  allocation. Blocks
  whose consumers have released them are freed at the next send, or when you call
  :func:`ipc_collect`.
- A **consumer** releases a block when the last array view it got from it is garbage
  collected, or when it exits (SIGKILL included: the kernel drops its references).
  Before releasing, it synchronises its current stream, so that kernels still reading
  the memory finish before the producer may reuse it, and closes its IPC mapping
  (the driver forbids freeing memory that an importer still maps).

Best practices
--------------
- **Keep the producer alive** until its consumers are done with what it sent. If a
  producer exits first, the consumers' arrays become invalid (aiomp warns at exit with
  the number of blocks still held). In particular, do not *return* a CuPy array from a
  spawned function or a Pool task whose process then exits: return ``cupy.asnumpy(x)``,
  or send the array on a queue and keep the process alive until the receiver replies.
- **Consumers: drop received arrays promptly** (``del batch`` once used), or copy what
  you keep (``x.copy()``). A held view pins the producer's memory. At most
  :func:`get_ipc_limit` blocks (1000 by default) may be outstanding per producer; past
  that, ``put`` raises :class:`IpcLimitError` rather than letting GPU memory grow
  without bound. A request/reply protocol (send the result back, and let the producer
  wait for it before sending more than a window of batches) keeps this bounded.
- **Stream order**: the event is recorded on the producer's *current stream* at ``put``;
  if you filled the array on another stream, ``put`` inside ``with that_stream:`` (or
  synchronise it first). The consumer's *current stream* waits for that event; if you
  use the array on another stream, make that stream wait on the current one first, and
  synchronise any non-current stream that used the array before dropping it (aiomp
  synchronises only the current stream before releasing).
- **Do not send a received array onward** (a pipeline stage forwarding its input):
  the memory belongs to the original producer, which tracks only the consumers it sent
  to. aiomp raises :class:`CudaIpcError` (before any CUDA call); send a copy, or have
  the producer send it.
- **Never fork with CUDA initialised**: ``start_method="fork"`` raises in a process that
  has initialised CUDA. Use ``"spawn"`` (the default) or ``"forkserver"``, and create
  CUDA state in the children.
- **Every receiver must see the device**: arrays are matched to devices by PCI bus id,
  so different ``CUDA_VISIBLE_DEVICES`` orders are fine, but a process that cannot see
  the device raises :class:`CudaIpcError` on ``get``.
- Only memory from ``cudaMalloc`` can be exported in place: CuPy's default
  ``MemoryPool`` and :func:`empty` work; arrays of 2 MiB or more from
  ``MemoryAsyncPool`` (``cudaMallocAsync``), managed memory and virtual-memory
  allocators cannot (``put`` raises :class:`CudaIpcError`); copy them into
  :func:`empty` first. (Smaller ones are copied anyway.)
- **No usable GPU** (no driver, no device visible): ``put`` and ``get`` of CuPy arrays
  and :func:`empty` raise :class:`CudaIpcError` with the runtime's reason.
- Sending the same large array again costs an IPC handle and an event, not a copy;
  a consumer opens each allocation once however many arrays in it arrive, and several
  arrays from one allocation in one message share one lease slot.

Limits
------
- :data:`DEFAULT_IPC_LIMIT` outstanding blocks per producer (change with
  :func:`set_ipc_limit`).
- :data:`MAX_IPC_EVENTS` live interprocess events per producer (as torch): past it a
  send synchronises the producer's current stream instead of recording an event.
- :data:`IPC_BLOCK` (2 MiB): the unit of IPC-safe blocks and the size under which
  arrays from CuPy's pool travel as copies.

Errors
------
::

    RuntimeError
     +-- CudaIpcError      an array could not be sent (put) or received (get)
          +-- IpcLimitError    too many sent blocks still held by consumers (put)
"""

from __future__ import annotations

from typing import Any

from ._cuda import (
    DEFAULT_IPC_LIMIT,
    IPC_BLOCK,
    MAX_IPC_EVENTS,
    CudaIpcError,
    IpcLimitError,
    IpcStatistics,
)
from ._cuda import empty as _empty
from ._cuda import get_ipc_limit as _get_ipc_limit
from ._cuda import ipc_collect as _ipc_collect
from ._cuda import set_ipc_limit as _set_ipc_limit
from ._cuda import statistics as _statistics

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


def empty(shape: Any, dtype: Any = float) -> Any:
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


def zeros(shape: Any, dtype: Any = float) -> Any:
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
