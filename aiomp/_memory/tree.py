"""This process's *tree*: the process at its root, which the names it makes record.

Owns ``AIOMP_TREE`` in this process's environment. A tree's root is the process with no
multiprocessing parent; its descendants learn it from ``AIOMP_TREE`` (or take their
parent, if it was not set when they started). Only a tree's processes can hold its
queues, so a name under ``/dev/shm`` whose tree is gone can no longer be named by a
message anyone reads (see :mod:`.janitor`).

A process publishes its tree before it starts any child (:func:`publish`, a
``_lifecycle`` start check the package registers), not only once it makes a segment: a
child started before then would read its tree from whatever ``AIOMP_TREE`` this process
inherited (the tree of an unrelated process that launched it), and its names would
outlive both trees.

A *child* module.
"""

from __future__ import annotations

import os

from .._lifecycle import start_time

_VARIABLE = "AIOMP_TREE"


def _find() -> tuple[int, int, bool]:
    """(root pid, root start time, whether this process is the root)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return os.getpid(), start_time(os.getpid()) or 0, True
    try:
        pid, start = map(int, os.environ.get(_VARIABLE, "").split(":"))
    except ValueError:
        pid = parent.pid or 0
        start = start_time(pid) or 0
    return pid, start, False


_tree = _find()


def publish() -> None:
    """Name this tree in the environment the children started from now on inherit."""
    os.environ[_VARIABLE] = f"{_tree[0]}:{_tree[1]}"


def root() -> tuple[int, int]:
    """This tree's root: (pid, start time)."""
    return _tree[0], _tree[1]


def is_root() -> bool:
    """True in the root of the tree (a forked child never is)."""
    return _tree[2]


def _after_fork_in_child() -> None:
    """A forked child is not its tree's root."""
    global _tree
    _tree = (_tree[0], _tree[1], False)


publish()
os.register_at_fork(after_in_child=_after_fork_in_child)
