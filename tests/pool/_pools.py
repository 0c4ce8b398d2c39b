"""What the Pool's tests share: the pool they make, and the waits and marks they use."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp

#: The fork server (conftest starts it once) starts a worker in milliseconds.
FAST = "forkserver"
#: How long a worker asked to exit has before it is killed (the pool's ``grace_period``).
GRACE = 0.3

#: For tests whose subject does not depend on the event loop.
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])

BACKENDS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def cases(*pairs: tuple[str, str]) -> list[Any]:
    """``(case, backend name)`` pairs as parameters for ``"case, anyio_backend"``."""
    return [pytest.param(case, BACKENDS[b], id=f"{case}-{b}") for case, b in pairs]


def pool(processes: int = 1, **kwargs: Any) -> aiomp.Pool:
    """``aiomp.Pool(processes, **kwargs)``, its workers started by the fork server and
    given :data:`GRACE` to exit unless ``kwargs`` say otherwise."""
    kwargs.setdefault("start_method", FAST)
    kwargs.setdefault("grace_period", GRACE)
    return aiomp.Pool(processes, **kwargs)


async def settled() -> None:
    """Every task is blocked, and the calls made so far have reached the pool: on asyncio,
    ``apply`` hands its task over from a loop callback once its caller has yielded."""
    await anyio.wait_all_tasks_blocked()
    await anyio.lowlevel.checkpoint()


def remote_text(exc: BaseException) -> str:
    """The worker's traceback a task's exception carries as its ``__cause__``."""
    assert exc.__cause__ is not None, "no remote traceback attached"
    return str(exc.__cause__)
