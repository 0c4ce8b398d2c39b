"""What a forked child undoes of its parent's event-loop library.

Owns nothing; standard library only (every child runs it before the user's code). sniffio
is only looked up: a process that never imported it carries no mark to clear.
"""

from __future__ import annotations

import sys


def forget_async_library() -> None:
    """A fork of a trio task keeps sniffio's mark that trio runs this thread (and anyio's,
    that asyncio does): clear both, or this child's own event loop would be taken for the
    parent's by anyio and every library that asks sniffio."""
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None:
        sniffio.thread_local.name = None
        sniffio.current_async_library_cvar.set(None)
