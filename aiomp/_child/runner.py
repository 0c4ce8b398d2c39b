"""Running the user's function in a child: a coroutine function on a fresh event loop.

Owns the child's event loop while the function runs (uvloop's when installed). Standard
library only at module level (every child imports it); asyncio and uvloop load on demand.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable


def run_fn(fn: object, rank_args: tuple[object, ...], is_async: bool) -> object:
    """Call ``fn(*rank_args)``; run a coroutine function on a fresh loop (uvloop if present)."""
    if not is_async:
        result = fn(*rank_args)  # type: ignore[operator]
        if type(result).__name__ != "coroutine":
            return result
        coro = result
    else:
        coro = fn(*rank_args)  # type: ignore[operator]
    with new_runner() as runner:
        return runner.run(coro)


def new_runner() -> asyncio.Runner:
    """An ``asyncio.Runner`` on a fresh event loop: uvloop when installed."""
    import asyncio

    factory: Callable[[], asyncio.AbstractEventLoop]
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    return asyncio.Runner(loop_factory=factory)
