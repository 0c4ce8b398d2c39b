"""Worker health: where a killed worker was, whether the OOM killer killed it, and how
much private memory it has grown (docs/design.md, "Worker health").

Both sides of it, standard library only (every worker imports this module):

* **The stack at the kill.** A worker registers :mod:`faulthandler` on SIGTERM, chained
  to SIGTERM's default action: the signal that terminates it first makes it write every
  thread's Python stack to a socket of its own, from the C signal handler (so a worker
  inside ``time.sleep`` or a blocking ``read`` prints too), and then it dies as before.
  The stack is the one at that moment, complete once the process has exited: the pool
  reads it after the reap, without waiting (:func:`read_stack`). A worker that blocks
  SIGTERM cannot print, and is SIGKILLed after the grace period as ever. Why not a
  signal of its own and a bounded read before SIGTERM: the dump has no end marker, so
  the parent would have to guess when it is whole; here the exit is the end marker.
* **OOM kills.** The parent's :class:`aiomp._process.cgroups.OomWatch` reads the
  worker's memory cgroup's ``oom_kill`` count (v2 ``memory.events``, v1
  ``memory.oom_control``): a worker that died of a SIGKILL the pool did not send, while
  that count rose, was killed by the OOM killer.
* **Memory that only grows.** :class:`MemoryGuard` runs in the worker between tasks, in
  three steps, each only when the one before cannot rule a crossing out: a clock read
  (memory is faulted in at most :data:`MAX_GROWTH_RATE`: too little time has passed for
  the resident set to have grown by the headroom), a ``pread`` of ``/proc/self/statm``
  (about 3-5 us: the resident set has not grown by the headroom), and a read of
  ``smaps_rollup`` (about 300 us: it walks every mapping). Private memory grows only by
  growing the resident set, so no step hides a crossing; shared memory (arrays in shared
  segments, a parent's weights) raises the resident set but not ``Private_Dirty``, and
  only moves the next precise check further out. A statm read per task cost a trivial
  ``apply`` 10%; the clock, nothing measurable.

And :func:`death_error`, what a task fails with when its worker dies: the pool's one
description of a death, which says what the handle learnt of it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time

from .._errors import BrokenWorkerError, exit_description

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: workers must not import typing
if TYPE_CHECKING:
    from .kinds import Handle

#: Most bytes of stack kept (faulthandler prints at most 100 frames of 100 threads).
STACK_LIMIT = 256 << 10
#: Bytes per second a process's resident set can grow at most, with room to spare: fresh
#: pages are faulted in at about 0.5 GiB/s here, and no core zeroes them faster than
#: its memory bandwidth (a few tens of GiB/s at most).
MAX_GROWTH_RATE = 64 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the stack at the kill ----------------------------------------------------------------
def print_stack_on_sigterm(sock: socket.socket) -> None:
    """Worker side: on SIGTERM, write every thread's stack to ``sock``, then die of it.

    A process this worker forks (a nested pool under ``fork``) must not write into the
    pool's socket: it drops both in the child.
    """
    faulthandler.register(signal.SIGTERM, file=sock, all_threads=True, chain=True)

    def forget() -> None:
        faulthandler.unregister(signal.SIGTERM)
        sock.close()

    os.register_at_fork(after_in_child=forget)


def read_stack(sock: socket.socket) -> str | None:
    """Parent side, once the worker has exited: what it printed as it was terminated
    (None: nothing, it could not print). Never waits: reads what is in the buffer."""
    chunks: list[bytes] = []
    size = 0
    while size < STACK_LIMIT:
        try:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
        except OSError:  # nothing more (EAGAIN), or closed
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    text = b"".join(chunks).decode("utf-8", "replace").rstrip()
    return text or None


# -- memory that only grows -------------------------------------------------------------
def private_dirty(pid: int | str = "self") -> int:
    """``Private_Dirty`` of ``pid`` in bytes, from ``/proc/PID/smaps_rollup``."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        for line in f:
            if line.startswith(b"Private_Dirty:"):
                return int(line.split()[1]) * 1024
    return 0


class MemoryGuard:
    """Worker side: whether this process's private memory has grown more than ``limit``
    bytes over its level when the guard was made (after the initializer). See the module
    docstring for the cost."""

    __slots__ = ("_base", "_gate", "_statm", "_until", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        self._base = private_dirty()
        self._gate = 0  # the resident set at which to count private memory again
        self._until = 0.0  # the clock before which it cannot have reached the gate
        self._set_gate(self._rss(), limit)

    def _rss(self) -> int:
        return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE

    def _set_gate(self, rss: int, headroom: int) -> None:
        self._gate = rss + headroom
        self._until = time.monotonic() + headroom / MAX_GROWTH_RATE

    def grown(self) -> int | None:
        """The growth, once past the limit (then the guard is spent); None below it."""
        if time.monotonic() < self._until:
            return None  # (the hot path: one clock read)
        rss = self._rss()
        if rss < self._gate:
            self._until = time.monotonic() + (self._gate - rss) / MAX_GROWTH_RATE
            return None
        grown = private_dirty() - self._base
        if grown > self.limit:
            self.close()
            return grown
        self._set_gate(rss, self.limit - grown)  # private memory grows only as rss does
        return None

    def close(self) -> None:
        if self._statm >= 0:
            os.close(self._statm)
            self._statm = -1


# -- what a task fails with when its worker dies --------------------------------------------
def death_error(
    handle: Handle, exitcode: int | None, during: str, reason: str = ""
) -> BaseException:
    """What fails when ``handle``'s worker dies ``during`` (``"while it ran <task>"``,
    ``"during start-up"``); ``exitcode`` None: the worker survived SIGKILL, in
    uninterruptible sleep, and the pool gives up; ``reason``: the pool's, when it killed it."""
    if exitcode is None:
        return RuntimeError(f"{handle.name} could not be terminated {during}")
    what, sig = exit_description(exitcode)
    if handle.oom_killed:
        what = f"was killed by the OOM killer ({what})"
    peak = "" if handle.peak_rss is None else f"; its peak RSS: {handle.peak_rss >> 20} MiB"
    return BrokenWorkerError(
        f"{handle.name} {what} {during}{reason}{peak}",
        handle.slot,
        handle.pid,
        exitcode,
        sig,
        oom_killed=handle.oom_killed,
        peak_rss=handle.peak_rss,
    )
