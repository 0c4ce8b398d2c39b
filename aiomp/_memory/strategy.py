"""How this process names the shared segments it creates: ``file_descriptor`` or ``file_system``.

``file_descriptor`` (the default): a segment is an anonymous memfd, and its fd travels
inside the message, so a sender may exit before its message is read. ``file_system``: a
segment is a named file ``/dev/shm/aiomp-<pid>-<random>``, and its name travels (the
janitor removes names nobody can need any more). Owns no OS resource: only the choice.

A *child* module.
"""

from __future__ import annotations

STRATEGIES = frozenset({"file_descriptor", "file_system"})

#: The strategy of segments made from now on; read in place (no call) on the send path.
current = "file_descriptor"


def get_all_sharing_strategies() -> set[str]:
    """The strategies this platform supports: ``{"file_descriptor", "file_system"}``."""
    return set(STRATEGIES)


def get_sharing_strategy() -> str:
    """The strategy used for arrays put into shared memory from now on in this process."""
    return current


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose how new shared segments are named: ``"file_descriptor"`` or ``"file_system"``.

    Affects segments this process creates from now on; arrays already shared keep theirs.
    Children inherit the parent's choice only if they call this too (as in torch).
    """
    global current
    if new_strategy not in STRATEGIES:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}; choose from {sorted(STRATEGIES)}"
        )
    current = new_strategy
