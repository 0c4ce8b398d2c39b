"""Checks before a child starts: the start-method table, what children will run, fork.

Owns nothing. Everything here raises before any process starts, so a caller's mistake
(an unknown start method, a function that cannot be pickled even by value, ``fork``
with CUDA initialised) surfaces in the parent, in the caller's frame.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import pickle
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import SupportsIndex

from .. import _lifecycle
from .._wire import byvalue
from .._wire import pickling as _reduction

START_METHODS = ("spawn", "forkserver", "fork")


def count(name: str, value: object, least: int = 1) -> int:
    """``value`` as an int >= ``least`` (anything with ``__index__``, a numpy integer too,
    but not a bool): ``TypeError`` for another type, as Python's pools raise,
    ``ValueError`` below ``least``."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{name} must be an int >= {least}, not {type(value).__name__} ({value!r})")
    n = operator.index(value)
    if n < least:
        raise ValueError(f"{name} must be an int >= {least}, not {value!r}")
    return n


def check_start_method(start_method: str) -> None:
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
            f"not {start_method!r}"
        )


def check_function(fn: object, start_method: str, what: str = "fn") -> bool:
    """Validate a function children will run; return whether it is a coroutine function.

    Raises ``TypeError`` for a non-callable or a coroutine object, and, unless children
    inherit it (``fork``), ``pickle.PicklingError`` when it cannot be pickled even by value
    (it captures a lock, a socket, an open file). A lambda, a closure, a local function or
    one typed into a notebook travels by value (:mod:`aiomp._wire.byvalue`).
    """
    if inspect.iscoroutine(fn):
        fn.close()
        raise TypeError(
            f"{what} must be a function, not a coroutine object: pass the async function "
            "itself (aiomp calls it in the child)"
        )
    if not callable(fn):
        raise TypeError(f"{what} must be callable, not {type(fn).__name__}")
    if start_method != "fork":
        check_picklable(fn, what)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def check_picklable(fn: object, what: str = "fn") -> None:
    """Raise ``pickle.PicklingError`` saying why if ``fn`` cannot be pickled, even by value."""
    try:
        byvalue.dumps(fn).discard()  # a trial: undo what it promised
    except Exception as exc:
        raise pickle.PicklingError(
            f"{what}={fn!r} cannot be pickled, even by value ({type(exc).__name__}: {exc}): "
            "it holds something that cannot leave this process (a lock, a socket, an open "
            "file); create that inside the function, or pass what it needs as arguments"
        ) from exc


#: Threads blocked until a start they asked for is done (:func:`waiting_for_start`).
_waiting: set[int] = set()


@contextlib.contextmanager
def waiting_for_start() -> Iterator[None]:
    """Say that this thread waits, blocked, while another thread (a private event loop's)
    starts children for it: the sync ``DataLoader``'s caller. A fork then is no hazard
    from this thread: blocked in a wait, it holds no lock the child could need (the one
    it waits on is its own, and the child never touches it)."""
    ident = threading.get_ident()
    _waiting.add(ident)
    try:
        yield
    finally:
        _waiting.discard(ident)


def running_threads() -> list[str]:
    """The names of the threads a fork from this thread could catch holding a lock: every
    other thread but those :func:`waiting_for_start`."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and t.ident not in _waiting]


def fork_hazard() -> str | None:
    """Why a fork from this thread now would be unsafe, or None: CUDA initialised (a
    fork check refuses it, or torch has initialised CUDA), or another thread running."""
    _reduction.init_reductions()  # the aiomp module of each library imported: its hooks
    try:
        for check in _lifecycle.fork_checks():
            check()
    except RuntimeError as exc:
        return str(exc)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch has initialised CUDA"
    others = running_threads()
    if others:
        return f"{len(others)} other thread(s) running ({', '.join(others[:3])})"
    return None


def check_fork_safe() -> None:
    """Refuse fork when a hook says so (``_cuda``: CUDA initialised); warn when other
    threads are running (a lock one of them holds stays locked in the child)."""
    _reduction.init_reductions()  # the aiomp module of each library imported: its hooks
    for check in _lifecycle.fork_checks():
        check()
    others = running_threads()
    if others:
        warnings.warn(
            f"start_method='fork' with {len(others)} other thread(s) running "
            f"({', '.join(others[:3])}): a lock held by one of them stays locked forever "
            "in the child; prefer 'spawn' or 'forkserver'",
            RuntimeWarning,
            stacklevel=4,
        )
