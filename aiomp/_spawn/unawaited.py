"""The warning for a spawn or Pool handle dropped without being awaited or entered.

``aiomp.spawn(fn, 2)`` in a plain ``def main()`` (a torch script ported without its
``await``) returns a handle and starts nothing: without a warning the program exits 0
having run no rank. A coroutine dropped unawaited warns (``RuntimeWarning: coroutine ...
was never awaited``); these handles warn the same way when collected, naming the call,
the line that made it, and the fix. Owns nothing.
"""

from __future__ import annotations

import sys
import warnings

#: What every ported script needs around the call.
FIX = (
    "inside an `async def main()` run by `asyncio.run(main())` or `anyio.run(main)` "
    "(aiomp's calls are awaited: see the README's porting table)"
)


def call_site(depth: int) -> tuple[str, int, str]:
    """``(filename, line, module)`` of the frame ``depth`` levels above the caller."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:  # pragma: no cover - a shallower stack than expected
        return "<unknown>", 0, "aiomp"
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", "")


def warn_never_used(what: str, fix: str, site: tuple[str, int, str]) -> None:
    """Warn (``RuntimeWarning``, at ``site``) that ``what`` was never awaited or entered.

    Called from ``__del__``: an error-level filter makes it an unraisable exception,
    which Python prints (and pytest reports) as it does the coroutine warning.
    """
    filename, line, module = site
    warnings.warn_explicit(
        f"{what} was never awaited or entered, so it started nothing: use {fix}, {FIX}",
        RuntimeWarning,
        filename,
        line,
        module=module,
    )
