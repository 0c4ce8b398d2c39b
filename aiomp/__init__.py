"""aiomp: torch.multiprocessing rebuilt async-first.

Only this module is public. Names resolve lazily (PEP 562): a child process imports this
package before ``aiomp._child.bootstrap`` and must load neither anyio nor numpy unless it needs them
(see *Light children* in docs/architecture.md).
"""

from __future__ import annotations

import os as _os
import sys as _sys

from . import _lifecycle  # the standard library only, as a child needs

# Not `from typing import TYPE_CHECKING`: children must not pay for importing typing.
TYPE_CHECKING = False


def _check_platform() -> None:
    """Fail at import, saying what is missing, rather than with an AttributeError later."""
    if not _sys.platform.startswith("linux"):
        raise ImportError(
            f"aiomp runs on Linux only (it needs pidfd, memfd, eventfd, OFD locks and "
            f"SCM_RIGHTS); this is {_sys.platform}"
        )
    try:
        _os.close(_os.pidfd_open(_os.getpid()))
    except (AttributeError, OSError) as exc:
        raise ImportError(
            f"aiomp needs pidfd_open (Linux 5.3 or newer; this kernel is "
            f"{_os.uname().release}): {exc}"
        ) from exc


_check_platform()

__version__ = "0.1.0"

__all__ = (
    "Batched",
    "BrokenPoolError",
    "BrokenWorkerError",
    "DataLoader",
    "Empty",
    "Event",
    "Full",
    "Pool",
    "PoolOverloadedError",
    "PoolStatistics",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "Queue",
    "QueueClosedError",
    "QueueItemError",
    "ResultIterator",
    "SharedMemoryError",
    "SpawnHandle",
    "TransportError",
    "WorkerInfo",
    "empty",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "get_worker_info",
    "is_shared",
    "run_sync",
    "set_sharing_strategy",
    "share_memory",
    "spawn",
    "start_processes",
    "zeros",
)

_WHERE = {
    "get_worker_info": "_child.info",
    "run_sync": "_first.default",
    "BrokenPoolError": "_errors",
    "BrokenWorkerError": "_errors",
    "PoolOverloadedError": "_errors",
    "ProcessException": "_errors",
    "ProcessExitedException": "_errors",
    "ProcessRaisedException": "_errors",
    "QueueClosedError": "_errors",
    "QueueClosed": "_errors",  # its name before 0.1.0's one style of names: an alias
    "QueueItemError": "_errors",
    "SharedMemoryError": "_errors",
    "TransportError": "_errors",
    "ProcessContext": "_spawn.context",
    "SpawnHandle": "_spawn.api",
    "WorkerInfo": "_child.info",
    "Batched": "_pool.batching",
    "ResultIterator": "_pool.iterators",
    "spawn": "_spawn.api",
    "start_processes": "_spawn.api",
    "Queue": "_queue.queue",
    "Event": "_queue.event",
    "Full": "_queue.queue",
    "Empty": "_queue.queue",
    "Pool": "_pool.pool",
    "DataLoader": "_data.loader",
    "PoolStatistics": "_pool.pool",
    "share_memory": "_arrays.shared",
    "is_shared": "_arrays.shared",
    "empty": "_arrays.shared",
    "zeros": "_arrays.shared",
    "get_all_sharing_strategies": "_memory.strategy",
    "get_sharing_strategy": "_memory.strategy",
    "set_sharing_strategy": "_memory.strategy",
    # Subpackages, attributes but not in __all__: ``aiomp.cuda`` (the ``cuda`` extra) and
    # ``aiomp.ray`` (the ``ray`` extra), each imported when first used.
    "cuda": "cuda",
    "ray": "ray",
}

if TYPE_CHECKING:
    from queue import Empty as Empty
    from queue import Full as Full

    from . import cuda as cuda
    from . import ray as ray
    from ._arrays.shared import empty as empty
    from ._arrays.shared import is_shared as is_shared
    from ._arrays.shared import share_memory as share_memory
    from ._arrays.shared import zeros as zeros
    from ._child.info import WorkerInfo as WorkerInfo
    from ._child.info import get_worker_info as get_worker_info
    from ._data.loader import DataLoader as DataLoader
    from ._errors import BrokenPoolError as BrokenPoolError
    from ._errors import BrokenWorkerError as BrokenWorkerError
    from ._errors import PoolOverloadedError as PoolOverloadedError
    from ._errors import ProcessException as ProcessException
    from ._errors import ProcessExitedException as ProcessExitedException
    from ._errors import ProcessRaisedException as ProcessRaisedException
    from ._errors import QueueClosed as QueueClosed
    from ._errors import QueueClosedError as QueueClosedError
    from ._errors import QueueItemError as QueueItemError
    from ._errors import SharedMemoryError as SharedMemoryError
    from ._errors import TransportError as TransportError
    from ._first.default import run_sync as run_sync
    from ._memory.strategy import get_all_sharing_strategies as get_all_sharing_strategies
    from ._memory.strategy import get_sharing_strategy as get_sharing_strategy
    from ._memory.strategy import set_sharing_strategy as set_sharing_strategy
    from ._pool.batching import Batched as Batched
    from ._pool.iterators import ResultIterator as ResultIterator
    from ._pool.pool import Pool as Pool
    from ._pool.pool import PoolStatistics as PoolStatistics
    from ._queue.event import Event as Event
    from ._queue.queue import Queue as Queue
    from ._spawn.api import SpawnHandle as SpawnHandle
    from ._spawn.api import spawn as spawn
    from ._spawn.api import start_processes as start_processes
    from ._spawn.context import ProcessContext as ProcessContext


def _import_spawn() -> None:
    """At the first shared segment of a tree's root: import the spawn API now. Messages in
    flight may then take every fd the process can open, and an import needs one, so that
    a consumer can still be started to drain them."""
    import aiomp._spawn.api  # noqa: F401


_lifecycle.on_first_segment(_import_spawn)


def _publish_tree() -> None:
    """Before each start of a child: name this process's tree in the environment the
    child inherits, so that the names it makes under ``/dev/shm`` record the tree they
    belong to (and the janitor can tell when nothing can read them any more)."""
    from ._memory import tree

    tree.publish()


_lifecycle.on_start_check(_publish_tree)


def _sweep_once() -> None:
    """Before the first start of a child: the root of a tree sweeps what dead trees left
    under ``/dev/shm`` (once per process)."""
    from ._memory import janitor

    janitor.sweep_once()


_lifecycle.on_start_check(_sweep_once)


def _sweep_names() -> None:
    """After a child exited abnormally: remove the ``/dev/shm`` names it left that nobody
    can need any more (the janitor), whether or not this process made a segment itself."""
    from ._memory import janitor

    janitor.sweep()


_lifecycle.on_failed_exit(_sweep_names)


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'aiomp' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(f"aiomp.{module}")
    value = mod if name == module else getattr(mod, name)
    if getattr(value, "__module__", "").startswith("aiomp._"):
        # Printed and pickled under its public name (trio's fixup_module_metadata).
        value.__module__ = "aiomp"
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted((*globals(), *__all__))
