"""Functions that aiomp.ray.Pool actors run in tests/test_ray.py (importable by actors)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any


def square(x: int) -> int:
    return x * x


def add(x: int, y: int) -> int:
    return x + y


def pid(*_: object) -> int:
    return os.getpid()


def fail(message: str) -> None:
    raise ValueError(message)


async def async_square(x: int) -> int:
    await asyncio.sleep(0)
    return x * x
