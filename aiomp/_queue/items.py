"""How a queue's item is pickled at ``put`` and rebuilt at ``get``; owns no OS resource.

Errors surface in the caller: an exception that could not be rebuilt is refused at
``put``; an item that cannot be rebuilt here is a :class:`~aiomp.QueueItemError` at
``get`` (that item is lost; the queue goes on). A *child* module.
"""

from __future__ import annotations

import pickle

from .._errors import CudaIpcError, QueueClosedError, QueueItemError
from .._wire import pickling as _pickling

#: What a non-waiting get returns when it took nothing.
MISSING = object()


def load(body: bytes | memoryview, fds: list[int]) -> object:
    """Rebuild an item; one that cannot be rebuilt here is a QueueItemError, except a CuPy
    array this process cannot open, which is the CudaIpcError that aiomp.cuda promises."""
    try:
        # Without fds there is nothing for loads to track. hot path: tests/budgets
        return _pickling.loads(body, fds) if fds else pickle.loads(body)
    except (QueueClosedError, QueueItemError, CudaIpcError):
        raise
    except Exception as exc:
        names = ", ".join(_classes_in(body)) or "no classes"
        raise QueueItemError(
            f"an item taken from the queue could not be rebuilt in this process "
            f"({type(exc).__name__}: {exc}); it refers to {names}. The item is lost; the "
            f"queue goes on."
        ) from exc


def _classes_in(body: bytes | memoryview) -> list[str]:
    """The non-builtin classes and functions a pickle names, in order (for errors)."""
    import pickletools

    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, str | None] = {}
    last: str | None = None
    try:
        for op, arg, _ in pickletools.genops(bytes(body)):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                last = str(arg)
                strings.append(last)
                continue
            if op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                # pickletools types every op's argument as one union; these carry an int.
                value = memo.get(int(arg))  # type: ignore[arg-type]
                if value is not None:
                    strings.append(value)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            last = None
    except Exception:  # noqa: BLE001 - best effort, for an error message
        pass
    seen = [n for n in dict.fromkeys(names) if not n.startswith(("builtins.", "copyreg."))]
    return seen[-5:]


def _check_exceptions(obj: object) -> None:
    """Raise at ``put`` if an exception in ``obj`` (itself, or directly inside a small
    tuple, list or dict) cannot be rebuilt from what it pickles as: the consumer would
    lose it. Cheap: other objects cost one isinstance check."""
    if isinstance(obj, BaseException):
        found: list[BaseException] = [obj]
    elif isinstance(obj, (tuple, list)) and len(obj) <= 16:
        found = [x for x in obj if isinstance(x, BaseException)]
    elif isinstance(obj, dict) and len(obj) <= 16:
        found = [x for x in obj.values() if isinstance(x, BaseException)]
    else:
        return
    for exc in found:
        try:
            rv = exc.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            if isinstance(rv, tuple) and callable(rv[0]):
                rv[0](*rv[1])
        except Exception as error:
            raise pickle.PicklingError(
                f"{type(exc).__module__}.{type(exc).__qualname__} pickles but cannot be "
                f"rebuilt from its args {exc.args!r} ({type(error).__name__}: {error}): the "
                "consumer would lose it. Pass every __init__ argument to "
                "super().__init__, or define __reduce__."
            ) from error


def message(obj: object) -> _pickling.Message:
    """``obj`` pickled for the queue: errors (an exception that could not be rebuilt
    included) raise here, in the caller."""
    if type(obj) not in _pickling.PLAIN:
        _check_exceptions(obj)
    return _pickling.dumps(obj)
