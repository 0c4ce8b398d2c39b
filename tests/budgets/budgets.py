"""The call and syscall budgets of aiomp's hot paths, in one table keyed on roles.

A budget test counts what one operation costs (Python calls into aiomp, some C calls,
context switches), never how long it takes, so it holds on a loaded machine. It names
what it counts by role ("the worker decodes a task frame"), never by file or function
name: when a module or function is renamed, :data:`ROLES` changes here and nothing else.

Each role's function is looked up on the imported module when this module loads, so a
stale name fails the collection of the budget tests loudly instead of counting nothing.
Counts are keyed on a function's code object (:func:`key`), so the same key names the
same function in a worker process, where the counts are taken and sent back.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiomp

#: The functions that play a role on a hot path, by qualified name. The one place to edit
#: when one of them moves or is renamed.
ROLES: dict[str, str] = {
    # The Pool's apply round trip.
    "worker: decode a task frame (general path)": "aiomp._pool.protocol.unpack",
    "worker: run a sync task (general path)": "aiomp._pool.worker_main.Server.run_sync",
    "parent: send apply's frame before its Task exists": (
        "aiomp._pool.process_handle.ProcessHandle.try_send_now"
    ),
    # A queue's put and get.
    "queue: put without waiting": "aiomp._queue.queue.Queue.put_nowait",
    "queue: put a plain item": "aiomp._queue.core.QueueCore._put_plain",
    "queue: send a datagram now": "aiomp._queue.core.QueueCore._send_now",
    "queue: get without waiting": "aiomp._queue.queue.Queue.get_nowait",
    "queue: take an item": "aiomp._queue.core.QueueCore._try_get",
    "queue: load an item's body": "aiomp._queue.items.load",
    "overflow log: append": "aiomp._queue.overflow.Overflow.append",
    "overflow log: pop": "aiomp._queue.overflow.Overflow.pop",
    # The general ways to wait on and send to a socket, which hot paths bypass.
    "loop: wait on an fd through FdWaiters": "aiomp._loop.waiters.FdWaiters.wait",
    "loop: wait until an fd is readable": "aiomp._loop.readers.wait_readable",
    "wire: send a datagram with fds": "aiomp._wire.datagram.try_send",
}

#: Python calls into aiomp per operation, at most.
CALLS: dict[str, int] = {
    # The worker's side of apply(fn), fn sent once: the stream's read (two), run, a look
    # at what came meanwhile (a task queued ahead, a CANCEL of it: issue 41), send.
    "worker: per apply": 5,
    # The parent's side of apply(fn) on asyncio and uvloop, sending and receiving.
    "parent: per apply": 16,
    # From `await pool.apply(fn)` to the send of its frame: apply, anyio's cancel-scope
    # check, and the send itself (the last of them).
    "parent: apply before its send": 3,
    # A get that waited, woken by a put: the whole hand-over.
    "queue: woken get (asyncio, uvloop)": 20,
    "queue: woken get (trio)": 16,
    # The general-path roles the short paths bypass: none per call (the counting calls'
    # own round trips may pass through them once or twice).
    "worker: decode a task frame (general path)": 0,
    "worker: run a sync task (general path)": 0,
}

#: The exact calls, in order, of a plain item through the overflow log (the socket full).
SEQUENCES: dict[str, list[str]] = {
    "overflow log: put": [
        "queue: put without waiting",
        "queue: put a plain item",
        "overflow log: append",
    ],
    "overflow log: get": [
        "queue: get without waiting",
        "queue: take an item",
        "overflow log: pop",
        "queue: load an item's body",
    ],
}

#: System-level costs per operation: polls, reader churn, wake-ups.
SYSCALLS: dict[str, float] = {
    # A woken get: one look at the fd before the wait on asyncio's own loop and on trio;
    # none on uvloop (it runs a woken task before it looks at fds again).
    "queue: poll per woken get (asyncio)": 1,
    "queue: poll per woken get (uvloop)": 0,
    "queue: poll per woken get (trio)": 1,
    # A woken get keeps its reader: no add_reader or remove_reader.
    "queue: reader changes per woken get": 0,
    # Scheduler steps of the woken consumer on trio: the one that reads the item.
    "queue: consumer steps per woken get (trio)": 1,
    # A worker's voluntary context switches per apply (below this): it sleeps once, on
    # its next task, not again for the room the parent's read freed.
    "worker: sleeps per apply": 1.5,
}

#: Where aiomp's source lives: calls into files under it count as aiomp's.
PACKAGE = os.path.dirname(aiomp.__file__) + os.sep

#: A function's identity that survives pickling: where its code is.
Key = tuple[str, int, str]


def resolve(qualified: str) -> Callable[..., Any]:
    """The function named ``package.module.Class.function``, found on the imported module
    (the longest importable prefix); raises if any part is missing."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError: ROLES names a function that is gone
        return obj  # type: ignore[no-any-return]
    raise ModuleNotFoundError(f"no module in {qualified!r}")


def key(code: types.CodeType) -> Key:
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _key_of(qualified: str) -> Key:
    fn = resolve(qualified)
    return key(getattr(fn, "__func__", fn).__code__)


#: Each role's key, resolved when this module loads: a stale name fails here.
KEYS: dict[str, Key] = {role: _key_of(name) for role, name in ROLES.items()}
_ROLE_OF: dict[Key, str] = {k: role for role, k in KEYS.items()}
assert len(_ROLE_OF) == len(KEYS), "two roles name the same function"
assert all(role in ROLES for sequence in SEQUENCES.values() for role in sequence)


def name_of(k: Key) -> str:
    """The role of ``k``, or ``module/function`` for a function that plays none."""
    return _ROLE_OF.get(k) or f"{os.path.basename(k[0]).removesuffix('.py')}/{k[2]}"


def count(counts: dict[Key, int], role: str) -> int:
    """How often the function of ``role`` was called, in ``counts`` by key."""
    return counts.get(KEYS[role], 0)


class Calls:
    """What one thread called while :func:`calls` recorded, in order: aiomp's Python
    functions (by key), and the rest (Python functions by name, C functions by qualified
    name, ``"poll.poll"``)."""

    def __init__(self) -> None:
        self.own: list[Key] = []
        self.outside: list[str] = []

    def roles(self) -> list[str]:
        """:func:`name_of` each of aiomp's calls, in order."""
        return [name_of(k) for k in self.own]

    def count(self, role: str) -> int:
        return self.own.count(KEYS[role])


@contextmanager
def calls() -> Iterator[Calls]:
    """Record this thread's calls meanwhile (``sys.setprofile``)."""
    seen = Calls()

    def hook(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code.co_filename.startswith(PACKAGE):
                seen.own.append(key(frame.f_code))
            else:
                seen.outside.append(frame.f_code.co_name)
        elif event == "c_call":
            seen.outside.append(getattr(arg, "__qualname__", repr(arg)))

    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(None)
