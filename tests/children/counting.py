"""What Pool workers run in the budget tests (tests/budgets/): a counter of the Python calls
into aiomp, and the small functions whose ``apply`` it counts. The standard library only at
module level: workers import this module by name.
"""

from __future__ import annotations

import collections
import os
import sys
import types
from typing import Any

#: Calls into files under a directory of this name are aiomp's.
AIOMP = os.sep + "aiomp" + os.sep

#: Calls by function, keyed as ``tests.budgets.budgets.key`` keys them.
_calls: collections.Counter[tuple[str, int, str]] = collections.Counter()


def _profile(frame: types.FrameType, event: str, arg: Any) -> None:
    if event == "call" and AIOMP in frame.f_code.co_filename:
        code = frame.f_code
        _calls[(code.co_filename, code.co_firstlineno, code.co_name)] += 1


def start_counting() -> None:
    """Count the Python calls into aiomp's modules in this thread from now on."""
    _calls.clear()
    sys.setprofile(_profile)


def stop_counting() -> dict[tuple[str, int, str], int]:
    """Stop counting; the counts by function (file, first line, name)."""
    sys.setprofile(None)
    out = dict(_calls)
    _calls.clear()
    return out


def nothing() -> None:
    return None


def forty_two() -> int:
    return 42


def refuse() -> None:
    raise LookupError("refused")


async def _later() -> str:
    return "awaited"


def coroutine() -> Any:
    """A sync function that returns a coroutine: the worker awaits it."""
    return _later()
