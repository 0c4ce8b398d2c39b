"""Running out of file descriptors: the reserve fd, relief, and an error that says what to do.

Owns one fd, the *reserve*: ``/dev/null`` kept open for the process's life so that the
error path can count the open fds (listing ``/proc/self/fd`` needs an fd) even at the
limit. At import it also raises this process's soft ``RLIMIT_NOFILE`` to the hard limit:
each message that carries shared arrays carries an fd while it is in flight, and the
kernel caps a user's in-flight fds at that limit.

A *child* module.
"""

from __future__ import annotations

import errno
import os
import resource  # imported up front: the fd-limit error path must not need an fd
from typing import TYPE_CHECKING

from .._errors import TransportError

if TYPE_CHECKING:
    from collections.abc import Callable

_EMFILE = (errno.EMFILE, errno.ENFILE)


def _open_reserve() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


_reserve = _open_reserve()


def _nothing_to_shed() -> int:
    return 0


def _no_segments() -> int:
    return 0


#: Gives fds back at the limit (idle segments); returns how many it gave. Set by the
#: registry with :func:`relieve_with`.
_shed: Callable[[], int] = _nothing_to_shed
#: How many fds hold shared segments this process maps, for the error message.
_segments_held: Callable[[], int] = _no_segments


def relieve_with(shed: Callable[[], int], segments_held: Callable[[], int]) -> None:
    """Name what :func:`open_fd` calls at the fd limit, and what the error counts."""
    global _shed, _segments_held
    _shed, _segments_held = shed, segments_held


def open_fd(open_: Callable[[], int], what: str) -> int:
    """``open_()``, an fd; at the fd limit, give away idle segments and retry, then raise
    a :class:`~aiomp.TransportError` that says what to do."""
    try:
        return open_()
    except OSError as exc:
        if exc.errno not in _EMFILE:
            raise
        if _shed():
            try:
                return open_()
            except OSError as again:
                if again.errno not in _EMFILE:
                    raise
        raise _fd_limit_error(exc, what) from None


def _fd_limit_error(exc: OSError, what: str) -> TransportError:
    global _reserve
    if _reserve >= 0:
        os.close(_reserve)  # the slot listdir needs
        _reserve = -1
    try:
        in_use = str(len(os.listdir("/proc/self/fd")) - 1)
    except OSError:
        in_use = "all its"
    finally:
        _reserve = _open_reserve()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return TransportError(
        exc.errno,
        f"cannot open {what}: this process has {in_use} file descriptors open and its "
        f"limit (RLIMIT_NOFILE) is {soft}; about {_segments_held()} hold shared-memory "
        "segments that arrays of this process live in. Drop arrays (or other files) you no "
        "longer need, let consumers receive pending messages, or raise the limit (ulimit -n, "
        "resource.setrlimit)",
    )


def _raise_fd_limit() -> None:
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


_raise_fd_limit()
