"""Terminating children for good: aiomp's one kill path, spawn's and the Pool's.

:func:`terminate_all`: SIGTERM to every live child, ``grace`` seconds, SIGKILL to the
survivors (each signal logged as torch logs it), then reap. Owns nothing; the children
own their pidfds. Shielded and bounded: see :func:`terminate_all` for cancellation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from .._loop.finalizers import protect_from_ki
from .child import KILL_TIMEOUT, Child, log


async def terminate_all(
    children: Sequence[Child], grace: float, exiting: Sequence[Child] = ()
) -> None:
    """Terminate ``children`` for good: SIGTERM each live one, wait up to ``grace`` seconds
    for them to exit, SIGKILL the survivors, and reap them all.

    Those also in ``exiting`` are already exiting on their own (a spawn child that
    reported its error): they get no SIGTERM, so that their teardown (``atexit``
    functions) runs whole and their own exit code is kept, but the same ``grace``
    seconds to finish, and SIGKILL after it.

    aiomp's one kill path (spawn's contexts and the Pool's workers). Once started, it
    always ends with every child reaped or SIGKILLed, whatever arrives meanwhile:

    * it runs shielded from cancel scopes;
    * an interruption that gets through a shield (a native asyncio ``Task.cancel()``, as
      ``asyncio.run`` sends on Ctrl-C and again when it shuts down; a KeyboardInterrupt,
      raised inside the wait, or anywhere on a loop that does not protect the kill path)
      ends the grace period at once: the survivors get SIGKILL and are reaped, and then
      the first interruption is re-raised. A second Ctrl-C means "now", never "leave them running".

    ``grace <= 0`` means "now": SIGKILL without a SIGTERM first.

    Bounded: it returns (or re-raises) within about ``grace + KILL_TIMEOUT`` seconds. A
    child that outlives SIGKILL by :data:`KILL_TIMEOUT` (uninterruptible sleep) is logged
    and left to the kernel.
    """
    protect_from_ki(
        terminate_all, _wait_all, Child.wait_exit, Child.poll_exit, Child.kill, Child.terminate
    )
    live = [c for c in children if not c.poll_exit()]
    if grace > 0:
        for c in live:
            if c not in exiting:
                c.terminate()
    interrupted: BaseException | None = None
    deadline = time.monotonic() + grace
    killing = False
    try:
        with anyio.CancelScope(shield=True):
            while survivors := [c for c in live if not c.poll_exit()]:
                now = time.monotonic()
                if not killing and (interrupted is not None or now >= deadline):
                    killing, deadline = True, now + KILL_TIMEOUT
                    why = " (interrupted)" if interrupted is not None else ""
                    for c in survivors:
                        c.kill(why)
                elif killing and now >= deadline:
                    log.error(
                        "aiomp: pids %s survived SIGKILL for %s s (uninterruptible sleep?)",
                        [c.pid for c in survivors],
                        KILL_TIMEOUT,
                    )
                    break
                try:
                    await _wait_all(survivors, deadline - now)
                except (KeyboardInterrupt, anyio.get_cancelled_exc_class()) as exc:
                    interrupted = interrupted or exc
    except BaseException:
        for c in live:  # an unexpected error (or an interruption between our awaits)
            c.kill(" (interrupted)")
        raise
    if interrupted is not None:
        raise interrupted


async def _wait_all(children: Sequence[Child], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every child to exit; return whether all did.

    One at a time: each must exit anyway, and no task group stands in the kill path.
    """
    with anyio.move_on_after(timeout):
        for c in children:
            await c.wait_exit()
    return all(c.exited for c in children)
