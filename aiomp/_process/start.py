"""What a parent tells every child it starts besides the target's own arguments.

Made by :func:`aiomp._process.launch.launch`, read by :func:`aiomp._child.bootstrap.begin`
in the child. A :data:`Start` holds:

- ``parent_pid``;
- ``output``: the ends of the parent's output forwarder (``aiomp._output.forwarder``),
  or None where the child inherits the parent's fds;
- ``who``: its rank or slot and how many (``_child.placement``), or None;
- ``env``: its env, or None (``spawn``: in the new interpreter's initial environment
  instead);
- ``seed``: the global generators' seed of a child a fork started (None: it seeds itself).

A *child* module: standard library only, and not ``typing`` (a child does not pay for
importing it): hence a plain named tuple.
"""

from __future__ import annotations

import collections

Start = collections.namedtuple("Start", ["parent_pid", "output", "who", "env", "seed"])
