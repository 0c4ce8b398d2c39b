"""Functions and classes a child cannot import by name travel by value (docs/design.md, R13).

A lambda, a closure, a local function or class, or one typed into a notebook, a REPL,
``python -c`` or ``python -`` (an interactive ``__main__``, which no child can import)
cannot be pickled by reference. :func:`dumps` pickles such objects by value with
cloudpickle (as loky, joblib and Ray do), and everything else as
:func:`aiomp._wire.pickling.dumps` does: a function of an importable module still
travels by its name, and arrays, queues and events keep their reducers inside a
by-value closure too. The receiver needs nothing of this module: the pickle names
cloudpickle's own rebuilding functions, which ``pickle.loads`` imports.

The plain pickler goes first (the common case costs nothing more); only when it fails, or
when its pickle names an interactive ``__main__``, is the object pickled again by value.
Standard library only at module level (children import this package): cloudpickle is
imported on the first by-value pickle.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import ChainMap

from . import pickling

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

_MAIN = b"__main__"
_pickler_class: Callable[..., pickle.Pickler] | None = None


def dumps(obj: object, prefix: bytes = b"") -> pickling.Message:
    """``obj`` pickled as :func:`aiomp._wire.pickling.dumps` does, with what a child cannot
    import by name pickled by value. Raises (``TypeError``, ``pickle.PicklingError``...) if
    it cannot be pickled even by value: it holds a lock, a socket, an open file."""
    try:
        msg = pickling.dumps(obj, prefix)
    except Exception:  # noqa: BLE001 - pickled again by value, which raises what stays
        pass
    else:
        if main_importable() or _MAIN not in msg.body:
            return msg
        msg.discard()  # it names the interactive __main__: no child can import that
    return pickling.dumps_with(_by_value_pickler, obj, prefix)


def main_importable() -> bool:
    """Whether spawn/forkserver children can import ``__main__``: it was run by module
    name (``python -m``) or from a file. A notebook, a REPL and ``python -c`` have no
    file; ``python -`` names ``<stdin>``, which a child cannot read again."""
    global _main_checked
    main = sys.modules.get("__main__")
    if _main_checked[0] is not main:  # once per __main__, not once per task
        path = getattr(main, "__file__", None)
        importable = getattr(main, "__spec__", None) is not None or (
            isinstance(path, str) and os.path.isfile(path)
        )
        _main_checked = (main, importable)
    return _main_checked[1]


#: The ``__main__`` module :func:`main_importable` last looked at, and its answer.
_main_checked: tuple[object, bool] = (None, False)


def _by_value_pickler(buf: io.BytesIO) -> pickle.Pickler:
    global _pickler_class
    if _pickler_class is None:
        _pickler_class = _make_pickler_class()
    return _pickler_class(buf, protocol=5)


def _make_pickler_class() -> Callable[..., pickle.Pickler]:
    import cloudpickle  # type: ignore[import-untyped]

    class ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]
        # aiomp's reducers first (arrays, queues, segments), then cloudpickle's own.
        dispatch_table = ChainMap(  # noqa: RUF012 - read by pickle, never mutated here
            pickling.reducers(), cloudpickle.Pickler.dispatch_table
        )

        def reducer_override(self, obj: object) -> object:
            # A function or class of a script's __main__ that children import (as
            # __mp_main__) stays by reference: its instances keep their class.
            if (
                getattr(obj, "__module__", None) == "__main__"
                and isinstance(obj, type | _FUNCTION)
                and main_importable()
                and _found(obj)
            ):
                return NotImplemented
            return super().reducer_override(obj)

    return ByValuePickler


_FUNCTION = type(main_importable)


def _found(obj: object) -> bool:
    """Whether ``obj`` is what its ``__main__.<qualname>`` names."""
    found: object = sys.modules.get("__main__")
    for part in getattr(obj, "__qualname__", "<locals>").split("."):
        found = getattr(found, part, None)
    return found is obj
