"""Functions that Pool workers run in the budget tests (tests/budgets/) (importable by children)."""

from __future__ import annotations

import collections
import os
import sys
import types
from typing import Any

_AIOMP = os.sep + "aiomp" + os.sep
_calls: collections.Counter[str] = collections.Counter()


def _profile(frame: types.FrameType, event: str, arg: Any) -> None:
    if event == "call" and _AIOMP in frame.f_code.co_filename:
        code = frame.f_code
        _calls[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1


def start_counting() -> None:
    """Count the Python calls into aiomp's modules in this thread from now on."""
    _calls.clear()
    sys.setprofile(_profile)


def stop_counting() -> dict[str, int]:
    """Stop counting; the counts by ``module:function``."""
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
