"""``file_system`` names: who may still need ``/dev/shm/aiomp-*``, and removing those nobody can.

Owns the names under ``/dev/shm`` that start with ``aiomp-``, as far as removing them
goes (the allocator creates them). A name's header page (:mod:`.segment`) records its
creator (pid and start time) and the root of the creator's *process tree*
(:mod:`.tree`): only the tree's processes can hold the queues a message naming it sits
in. A name is removed once

- its creator has let go of it (the ``ABANDONED`` flag: it exited, or gave the segment
  away) or died, SIGKILL included;
- no process holds a lease on it (a receiver's view of a block holds one);
- and no message naming it can still be read: every reference sent was opened, or the
  tree is gone, or nothing was sent naming it for :data:`STALE_IN_FLIGHT` seconds.

The test and the unlink happen under the header's lock, so whichever of the creator
letting go and the last holder releasing comes second removes the name. The janitor
runs when the root of a tree first starts anything of aiomp's (a child, a queue, a
segment: sweeping what dead trees left), after a child exits abnormally, and when the
root exits with no child left.

A *child* module.
"""

from __future__ import annotations

import os
import time

from .. import _lifecycle
from .._lifecycle import pid_alive, start_time
from . import lease as _lease
from . import tree as _tree
from .segment import ABANDONED, COUNTERS, H_CREATOR, H_FLAGS, H_TREE, HEADER

SHM_DIR = "/dev/shm"
PREFIX = "aiomp-"
#: A name whose creator has died and that nobody holds is removed even though a message
#: naming it was never read, once nothing has been sent naming it for this many seconds.
STALE_IN_FLIGHT = 60.0


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _creator(name: str) -> int:
    try:
        return int(name[len(PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1


_me = [os.getpid(), start_time(os.getpid()) or 0]  # read up front: no fd needed later
_started = False
_swept = False


def header_identity() -> bytes:
    """The creator and tree fields of a new name's header page (from ``H_CREATOR``)."""
    me = os.getpid()
    root = _tree.root()
    if _me[0] != me:  # a forked child
        _me[:] = [me, start_time(me) or 0]
    return (
        me.to_bytes(4, "little")
        + bytes(4)
        + _me[1].to_bytes(8, "little")
        + root[0].to_bytes(4, "little")
        + bytes(4)
        + root[1].to_bytes(8, "little")
    )


def first_segment() -> None:
    """This process makes its first segment: the root of a new tree sweeps what dead trees
    left, and runs the lifecycle's first-segment hooks (imports up front of what
    recovering from an fd shortage needs, since an import needs an fd)."""
    global _started
    if _started:
        return
    _started = True
    sweep_once()
    if _tree.is_root():
        _lifecycle.first_segment()


def sweep_once() -> None:
    """This process's first aiomp start of any kind (a child, a queue, a segment): the
    root of a tree sweeps what dead trees left, once. A program that only spawns or
    pools after a SIGKILLed one left names behind removes them too. Costs a listing of
    ``/dev/shm`` (and a look at each ``aiomp-`` name), once per process."""
    global _swept
    if not _swept:
        _swept = True
        if _tree.is_root():
            sweep()


def _field(header: bytes, at: int, size: int) -> int:
    return int.from_bytes(header[at : at + size], "little")


def _unread(header: bytes) -> bool:
    """True if a reference to some block was sent and not yet opened."""
    for at in range(COUNTERS, HEADER - 7, 8):
        if _field(header, at + 4, 4) < _field(header, at, 4):
            return True
    return False


def _unreadable(header: bytes, fd: int, ending: tuple[int, int] | None) -> bool:
    """True if no message naming the segment can still be read: its tree is gone (or is
    ``ending``: its root is exiting with no child left), or it is stale."""
    tree = (_field(header, H_TREE, 4), _field(header, H_TREE + 8, 8))
    if tree[0] and (tree == ending or not pid_alive(*tree)):
        return True
    return time.time() - os.fstat(fd).st_mtime > STALE_IN_FLIGHT


def remove_if_orphan(
    name: str,
    *,
    abandon: bool = False,
    ending: tuple[int, int] | None = None,
    wait: bool = True,
    fd: int = -1,
) -> bool:
    """Unlink ``name`` if nothing can need it any more; True if it was removed.

    With ``abandon``, the caller is its creator letting go of it first. Without ``wait``
    (the janitor), a name whose header is locked right now is left alone. ``fd``: a
    description of the name that holds no lease (one the caller has open already: at the
    fd limit, opening another would fail).
    """
    pid = _creator(name)
    if pid < 0:
        return False
    own = fd < 0
    try:
        if own:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with _lease.exclusive(fd, 0, 1, wait):
            header = os.pread(fd, HEADER, 0)
            complete = len(header) == HEADER
            if abandon:
                os.pwrite(fd, bytes((ABANDONED,)), H_FLAGS)
            elif not (complete and header[H_FLAGS] & ABANDONED):
                start = _field(header, H_CREATOR + 8, 8) if complete else 0
                if pid_alive(pid, start):
                    return False
            if _lease.is_held(fd, 1, 0):  # any lease (all but the lock byte)
                return False
            if complete and _unread(header) and not _unreadable(header, fd, ending):
                return False
            unlink(name)
            return True
    except OSError:
        return False
    finally:
        if own:
            os.close(fd)


def janitor(*, _ending: tuple[int, int] | None = None) -> list[str]:
    """Remove ``/dev/shm/aiomp-*`` names that nothing can need any more.

    A name goes once its creator has let go of it or died (SIGKILL included), no process
    holds it, and no message naming it can still be read (see the module docstring).
    Returns the names removed. Safe to call at any time from any process.
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return []
    return [name for name in names if remove_if_orphan(name, ending=_ending, wait=False)]


def sweep() -> None:
    """A child that died abnormally may have left named segments (``file_system``
    strategy): remove those whose creator is dead and that nobody holds. A ``_lifecycle``
    failed-exit hook, which the package registers: a parent that never made a segment
    itself (its children did) sweeps too."""
    try:
        janitor()
    except OSError:
        pass


def _children() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


def tree_ending() -> tuple[int, int] | None:
    """This tree's root (pid, start time) when this process is the root and no other
    process of the tree is left: none of its children lives but multiprocessing's helpers
    (their children, the fork server's, count). None otherwise, or when it cannot tell."""
    try:
        return _tree.root() if _tree_is_ending() else None
    except (OSError, ImportError):  # out of fds, say
        return None


def _tree_is_ending() -> bool:
    if not _tree.is_root():
        return False
    from multiprocessing import forkserver, resource_tracker

    # The helpers' pids are private attributes of multiprocessing, absent from typeshed.
    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    helpers = {server, resource_tracker._resource_tracker._pid}  # type: ignore[attr-defined]
    others = set()
    try:
        others = _children() - helpers
        if server and pid_alive(server):
            with open(f"/proc/{server}/task/{server}/children") as f:
                others.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return not any(pid_alive(pid) for pid in others)


def _after_fork_in_child() -> None:
    """A forked child is not its tree's root, and the root has swept already."""
    global _started, _swept
    _started = _swept = True


os.register_at_fork(after_in_child=_after_fork_in_child)
