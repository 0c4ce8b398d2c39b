"""What a parent tells every child it starts besides the target's own arguments.

Made by :func:`aiomp._process.launch.launch`, read by :func:`aiomp._child.bootstrap.begin`
in the child. A *child* module: standard library only.
"""

from __future__ import annotations

import socket
from typing import NamedTuple


class Start(NamedTuple):
    """The target's third argument (see the module docstring)."""

    parent_pid: int
    #: The ends of the parent's output forwarder (``aiomp._output.forwarder``); None: the
    #: child inherits the parent's fds.
    output: tuple[socket.socket, socket.socket, bool, socket.socket, int] | None = None
    #: Its rank or slot and how many (``_child.placement``).
    who: tuple[int, int] | None = None
    #: Its env (``spawn``: in the new interpreter's initial environment instead).
    env: dict[str, str] | None = None
    #: The global generators' seed of a child a fork started (None: it seeds itself).
    seed: int | None = None
