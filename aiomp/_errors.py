"""The exceptions aiomp raises, and who raises them.

::

    Exception
     +-- ProcessException               a child process failed (spawn, join)
     |    +-- ProcessRaisedException    ...by raising; the message holds its traceback
     |    +-- ProcessExitedException    ...by dying or exiting non-zero without a Python error
     |    +-- BrokenWorkerError         a Pool worker died while it held the task
     +-- RuntimeError
     |    +-- BrokenPoolError           the Pool can run no more tasks (not a task's failure)
     |    +-- PoolOverloadedError       a Pool call refused at once: max_pending tasks wait
     |    +-- aiomp.cuda.CudaIpcError   a CuPy array could not be sent (put) or received (get)
     |         +-- aiomp.cuda.IpcLimitError  too many sent CUDA blocks still held (put)
     +-- QueueClosedError               put on a closed Queue; get on a closed, drained one
     +-- QueueItemError                 get: an item could not be rebuilt here (it is lost)
     +-- OSError
          +-- SharedMemoryError         shared memory could not be allocated (raised at put)
          +-- TransportError            a message could not travel (fd limit, truncation)
    queue.Full, queue.Empty             put_nowait / get_nowait (re-exported as aiomp.Full/Empty)

Every exception here pickles with its attributes, so a child can send it to its parent
and a parent can hand it on to another process.

A *child* module: standard library only (see *Light children* in docs/architecture.md).
"""

from __future__ import annotations

import copyreg
import signal as _signal

__all__ = (
    "BrokenPoolError",
    "BrokenWorkerError",
    "CudaIpcError",
    "IpcLimitError",
    "PoolOverloadedError",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "QueueClosed",
    "QueueClosedError",
    "QueueItemError",
    "SharedMemoryError",
    "TransportError",
)


def _rebuilt(exc: BaseException) -> tuple[object, ...]:
    """``__reduce__`` of the exceptions with attributes: rebuilt from ``args`` without
    calling ``__init__`` (pickle's NEWOBJ: ``cls.__new__(cls, *args)``, no private name
    in the pickle), then every attribute restored from ``__dict__``."""
    return _NEWOBJ, (type(exc), *exc.args), exc.__dict__


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # not in typeshed


class _Carried(Exception):
    """An exception with attributes: its message as ``msg``, and every attribute a subclass
    sets carried in its pickle (:func:`_rebuilt`)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg

    __reduce__ = _rebuilt


class ProcessException(_Carried):
    """A child process of a :class:`aiomp.ProcessContext` failed.

    Raised by ``join()`` and by leaving ``async with aiomp.spawn(...)``; ``error_index``
    is the failed process's rank and ``pid`` its process id (``error_pid``, torch's name
    for it, is the same).
    """

    def __init__(self, msg: str, error_index: int, pid: int | None) -> None:
        super().__init__(msg)
        self.error_index = error_index
        self.pid = pid

    @property
    def error_pid(self) -> int | None:
        """torch's name for :attr:`pid`."""
        return self.pid


class ProcessRaisedException(ProcessException):
    """The child's function raised; the message holds the child's formatted traceback.

    Raised by spawn: its ``__cause__`` is the child's exception itself, rebuilt in the
    parent (when it pickles), whose own ``__cause__`` holds the child's traceback: a
    handler tells a child's ``ValueError`` by ``isinstance(exc.__cause__, ValueError)``.
    """


class ProcessExitedException(ProcessException):
    """The child died by a signal or exited non-zero without a Python exception.

    ``exit_code`` is the process's exit status (negative for a signal, as in
    :attr:`multiprocessing.Process.exitcode`); ``signal_name`` is e.g. ``"SIGSEGV"``.
    ``oom_killed``: the kernel's OOM killer killed it (its cgroup's ``oom_kill`` count
    rose as it died of SIGKILL); ``peak_rss``: its peak resident set in bytes, from its
    rusage once reaped. Both are known for a :class:`aiomp.Pool`'s workers (``peak_rss``
    is None for a forkserver worker, which the server reaps), False and None elsewhere.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int | None,
        exit_code: int,
        signal_name: str | None = None,
        *,
        oom_killed: bool = False,
        peak_rss: int | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name
        self.oom_killed = oom_killed
        self.peak_rss = peak_rss


class BrokenWorkerError(ProcessExitedException):
    """A :class:`aiomp.Pool` worker died while it held this task.

    Only the tasks that worker held fail with it; the pool starts a replacement.
    """


class BrokenPoolError(_Carried, RuntimeError):
    """A :class:`aiomp.Pool` can run no more tasks: its initializer raised, or its workers
    kept dying during start-up (``__cause__`` says which).

    Raised by every call on the pool from then on, and by the tasks that were waiting.
    Unlike :class:`BrokenWorkerError` it is not one task's failure: ``imap`` and
    ``imap_unordered`` raise it rather than end, with ``not_run`` the number of inputs
    read that were never run (inputs not yet read are not counted).
    """

    def __init__(self, msg: str, not_run: int = 0) -> None:
        super().__init__(msg)
        self.not_run = not_run


class PoolOverloadedError(_Carried, RuntimeError):
    """A call on a :class:`aiomp.Pool` made with ``max_pending=N`` was refused at once: it
    would have been the (N+1)-th task not started yet (load shedding).

    Raised by the call itself, before anything is sent: nothing of it runs. A service
    answers 503; calls are accepted again as the queue drains. ``max_pending`` is the
    pool's limit. A ``pool.batched`` caller gets it when the batch it would join is full
    and cannot be queued (one closed batch is one task).
    """

    def __init__(self, msg: str, max_pending: int = 0) -> None:
        super().__init__(msg)
        self.max_pending = max_pending


class QueueClosedError(Exception):
    """The queue was closed: no more items can be put, and a drained queue yields none."""


#: QueueClosedError's name before the exceptions took one style (``...Error``; torch's
#: ``Process...Exception`` names excepted): the same class.
QueueClosed = QueueClosedError


class QueueItemError(Exception):
    """An item taken from a Queue could not be rebuilt in this process (``get``).

    The message names the classes the item refers to; ``__cause__`` is the original error
    (an exception class whose ``__init__`` does not accept its own ``args``, a module the
    consumer cannot import). That item is lost; the queue, its counts and the items after
    it are intact.
    """


class SharedMemoryError(OSError):
    """Shared memory for an array could not be allocated (``/dev/shm`` or memory is full).

    Raised at the call that needed the memory (``put``, ``share_memory``, ``zeros``),
    never later as a SIGBUS when the memory is touched.
    """


class TransportError(OSError):
    """A message could not be sent or received whole (the file-descriptor limit, mostly)."""


class CudaIpcError(RuntimeError):
    """A CuPy array could not be sent or received as a CUDA IPC handle.

    Raised by ``put`` (and anything else that pickles an aiomp message) in the sender,
    or by ``get`` in the receiver, as itself (not a :class:`QueueItemError`). The message
    says why and what to do.
    """


class IpcLimitError(CudaIpcError):
    """Too many sent CUDA blocks are still held by consumers (raised at ``put``)."""


CudaIpcError.__module__ = "aiomp.cuda"  # public in aiomp.cuda, not aiomp
IpcLimitError.__module__ = "aiomp.cuda"

for _cls in (
    BrokenPoolError,
    BrokenWorkerError,
    PoolOverloadedError,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    QueueClosedError,
    QueueItemError,
    SharedMemoryError,
    TransportError,
):
    _cls.__module__ = "aiomp"  # printed and pickled under the public name


def exit_description(exit_code: int) -> tuple[str, str | None]:
    """Return ``("terminated with signal SIGSEGV", "SIGSEGV")`` or ``("... exit code 7", None)``."""
    if exit_code < 0:
        try:
            name = _signal.Signals(-exit_code).name
        except ValueError:
            name = f"<unknown signal {-exit_code}>"
        return f"terminated with signal {name}", name
    return f"terminated with exit code {exit_code}", None
