"""Where a child stands, set first thing in it: its worker information and its env.

:func:`enter` is the first call of every child main (the Pool's worker, spawn's child):
it merges the slot's ``env=`` over ``os.environ`` (under ``fork`` and ``forkserver``;
a ``spawn`` child had it in its initial environment already, see
``aiomp._process.placement``) and records ``aiomp.get_worker_info()``. Owns nothing;
standard library and [child] modules only.
"""

from __future__ import annotations

import os

from .info import set_worker_info


def enter(who: tuple[int, int] | None, env: dict[str, str] | None) -> None:
    """Apply ``env`` (a dict of str, checked by the parent) and record ``who``
    (``(slot or rank, how many)``) as this process's worker information."""
    if env:
        os.environ.update(env)
    if who is not None:
        set_worker_info(who[0], who[1])
