"""A user's code, type-checked (never run) by tests/meta/test_typing.py.

Each ``# reveal:`` comment is the type mypy must reveal on that line; each ``# error:``
comment the error code mypy must report there. No other line may have an error.
"""

from __future__ import annotations

from typing import reveal_type

import aiomp


def square(x: int) -> int:
    return x * x


async def greet(name: str) -> str:
    return f"hello {name}"


def worker(rank: int, queue: aiomp.Queue) -> None:
    queue.sync.put(rank)


async def main() -> None:
    queue = aiomp.Queue()
    async with aiomp.Pool(2) as pool:
        reveal_type(await pool.apply(square, (1,)))  # reveal: int
        reveal_type(await pool.apply(greet, ("you",)))  # reveal: str
        reveal_type(await pool.map(square, [1, 2]))  # reveal: list[int]
        reveal_type(await pool.starmap(greet, [("a",)]))  # reveal: list[str]
        await pool.apply(square, 1)  # error: call-overload
        await pool.map(square, ["not an int"])  # error: arg-type
    ctx = await aiomp.spawn(worker, 2, args=(queue,))
    reveal_type(ctx.pids())  # reveal: list[int]
    await aiomp.spawn(worker, "4")  # error: arg-type
    await aiomp.spawn(worker, args=queue)  # error: arg-type
    reveal_type(aiomp.zeros(3))  # reveal: numpy.ndarray[Any, Any]
