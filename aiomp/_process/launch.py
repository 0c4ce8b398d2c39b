"""Starting one child: :func:`launch`, the fork server's preparation, and hiding an
unreadable ``__main__`` from the children.

Owns the child's end of the caller's channel until the child has started (it is closed
here, started or not), and the process until a :class:`~aiomp._process.child.Child`
owns it. Nothing here waits on the event loop but the fork server's first start, which
runs in a thread.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio

from .. import _lifecycle
from .._output.forwarder import Forwarder
from . import groups as _groups
from . import mp_private
from .child import Child
from .placement import spawn_environment
from .start import Start

#: What the fork server imports once, so that the children it forks start with it loaded:
#: unpickling the sockets a child is given imports popen_forkserver; arming the
#: parent-death signal loads ``_ctypes`` (a dlopen of libffi); the two child mains (the
#: Pool's worker, spawn's child) import the child bootstrap.
_FORKSERVER_PRELOAD = (
    "multiprocessing.popen_forkserver",
    "_ctypes",
    "aiomp._pool.worker_main",
    "aiomp._spawn.child_main",
)


@contextlib.contextmanager
def unreadable_main_hidden() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that children cannot read while one is started.

    multiprocessing's spawn and forkserver children (and the fork server itself) re-run
    the parent's main script from its path. For ``python -`` that path is ``<stdin>``:
    they die before running anything. Without the path they skip the main module, as
    they do for ``python -c``; functions defined there are refused up front anyway
    (:func:`aiomp._process.checks.check_function`)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (
        main is None
        or getattr(main, "__spec__", None) is not None
        or not isinstance(path, str)
        or os.path.isfile(path)
    ):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


async def prepare_forkserver() -> None:
    """Start the fork server off the event loop (its first start waits for an interpreter).

    The start checks run first. Its preloads gain :data:`_FORKSERVER_PRELOAD`; the
    user's stay. Cancellation leaves the server starting in its thread (anyio waits for
    the thread). Once started, nothing here: each start checks that the server lives
    (``ensure_running``, which restarts a dead one), as it does for ``multiprocessing``'s
    own processes.
    """
    from multiprocessing import forkserver

    # First, as before any start: a process that is importing its parent's main module
    # (a spawn child, or the fork server preloading it) refuses to start a server of its
    # own, which would import that module again, and so on.
    _lifecycle.run_start_checks()
    if mp_private.forkserver_pid() is None:
        preload = list(mp_private.forkserver_preload() or ["__main__"])
        ours = [m for m in _FORKSERVER_PRELOAD if m not in preload]
        if ours:
            forkserver.set_forkserver_preload([*preload, *ours])
        with unreadable_main_hidden():
            await anyio.to_thread.run_sync(forkserver.ensure_running)


def preload_in_forkserver(modules: list[str]) -> None:
    """Have the fork server import ``modules`` too as it starts, so that the children it
    forks start with them loaded; nothing where the server runs already (its imports
    are done), nor for a module that is not imported here from a file (``__main__``, a
    module of ``python -c``: the server could not import it)."""
    if mp_private.forkserver_pid() is not None:
        return
    from multiprocessing import forkserver

    preload = list(mp_private.forkserver_preload() or ["__main__"])
    for name in modules:
        module = sys.modules.get(name)
        if name not in preload and getattr(module, "__spec__", None) is not None:
            preload.append(name)
    forkserver.set_forkserver_preload(preload)


def _defer_helpers(start_method: str) -> None:
    """See :func:`launch`'s ``defer_helpers``: the keeper's socket is made now (what is
    registered waits in it), and under ``spawn`` the resource tracker's pipe likewise."""
    _groups.start_keeper(defer=True)
    if start_method == "spawn":
        mp_private.defer_resource_tracker()


def start_deferred_helpers() -> None:
    """Start the helper processes a launch deferred (nothing if none is): when that child
    is ready, when another child is launched, when its owner closes."""
    _groups.start_deferred_keeper()
    mp_private.start_deferred_tracker()


C = TypeVar("C", bound=Child)


def launch(
    make: Callable[[int, multiprocessing.process.BaseProcess, str, Forwarder | None], C],
    target: Callable[..., object],
    rank: int,
    start_method: str,
    daemon: bool,
    channel: socket.socket,
    *,
    extra: tuple[object, ...] = (),
    name: str | None = None,
    output: Forwarder | None = None,
    who: tuple[int, int] | None = None,
    env: dict[str, str] | None = None,
    seed: int | None = None,
    defer_helpers: bool = False,
) -> C:
    """Start one process running ``target(rank, channel, start, *extra)``, ``start`` the
    :class:`~aiomp._child.bootstrap.Start` the target hands to
    :func:`aiomp._child.bootstrap.begin` first thing; return ``make(rank, process,
    start_method, output)`` (:class:`Child` or a subclass).

    ``channel`` is the child's end of a socket pair the caller made and keeps the other
    end of; it is closed here, started or not. With ``output``, ``start`` holds the ends
    of that forwarder, and the returned child owns it from then on (it is closed here if
    the start fails). ``who`` (``(slot or rank, how many)``), ``env`` and ``seed`` (the
    global generators' seed of a forked child) travel in ``start``; under ``spawn`` the
    env is in the new interpreter's initial environment instead (:mod:`.placement`).
    Returns at once (the child boots concurrently). Call :func:`prepare_forkserver`
    first for ``"forkserver"``. Must run on the event loop's thread, in a task.

    The start checks registered with ``_lifecycle`` run first: ``target``'s module has
    imported the child bootstrap, whose check stops a spawn child re-running its
    parent's unguarded main module.

    With ``defer_helpers``, aiomp's keeper and multiprocessing's resource tracker start
    later (:func:`start_deferred_helpers`), not beside this child: for a child that runs
    none of the caller's code before it says it is ready (``run_sync``'s first worker:
    decisions 0046, 0048). Any other launch starts them first.
    """
    _lifecycle.run_start_checks()
    # Up before the child runs, so that registering it (``Child``) is one message.
    if defer_helpers:
        _defer_helpers(start_method)
    else:
        start_deferred_helpers()
        _groups.start_keeper()
    mp: Any = multiprocessing.get_context(start_method)
    ends = None if output is None else output.child_ends()
    start = Start(os.getpid(), ends, who, None if start_method == "spawn" else env, seed)
    try:
        proc = mp.Process(
            target=target,
            args=(rank, channel, start, *extra),
            daemon=daemon,
            name=name or f"aiomp-{rank}",
        )
        with unreadable_main_hidden(), spawn_environment(env if start_method == "spawn" else None):
            proc.start()
        if output is not None:
            output.start()
    except BaseException:
        if output is not None:
            output.close()
        raise
    finally:
        channel.close()
    try:
        return make(rank, proc, start_method, output)
    except BaseException:  # no pidfd (EMFILE): nothing may own a process nobody watches
        proc.kill()
        proc.join()
        if output is not None:
            output.close()
        raise
