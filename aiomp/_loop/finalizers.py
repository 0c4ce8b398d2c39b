"""What Ctrl-C must not cut short: finalizers, and the kill path's code between awaits.

trio raises KeyboardInterrupt at once in code it does not protect, and delivers it at the
next checkpoint in code it does. This module owns the two ways aiomp asks for that
protection: :func:`finalizer` for code the garbage collector runs, :func:`protect_from_ki`
for the kill path. Standard library only (children import it); trio is only looked up.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    F = TypeVar("F", bound=Callable[..., None])


def finalizer(fn: F) -> F:
    """Mark ``fn``, run by the garbage collector (a ``weakref`` callback, a ``finalize``),
    so that trio does not raise KeyboardInterrupt inside it.

    Python reports an exception raised in a finalizer ("Exception ignored in") and drops
    it, so a Ctrl-C landing there would be lost, and the finalizer cut short. trio
    protects every frame whose code is named ``__del__`` and delivers the interrupt at
    its next checkpoint instead; the function keeps its qualified name.
    """
    fn.__code__ = fn.__code__.replace(co_name="__del__")
    return fn


_protected: set[object] = set()


def protect_from_ki(*fns: Callable[..., object]) -> None:
    """Under trio, let a KeyboardInterrupt reach each of ``fns`` only at its awaits (see
    the module docstring). Only when trio is already imported: aiomp never imports it,
    and a process that never imported it runs no trio code to protect. Once per function.
    """
    trio = sys.modules.get("trio")
    if trio is None:
        return
    for fn in fns:
        if fn not in _protected:
            _protected.add(fn)
            trio.lowlevel.enable_ki_protection(fn)
