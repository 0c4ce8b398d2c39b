"""Parent-side machinery for latency comparisons: variants, interleaved batches, the floor.

A *variant* is one way of doing a round trip (aiomp, a baseline, the raw floor). Its child
is started once; then batches of every variant alternate, so a burst of load from another
user of the machine lands on all of them alike, and each figure is the median of all its
samples.
"""

from __future__ import annotations

import multiprocessing

from benchmarks import _common as c
from benchmarks._targets import PAYLOAD, echo_socket

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket


class Variant:
    """One round trip to measure. Subclasses define ``start``, ``once`` and ``stop``."""

    name = "?"
    #: sync variants block the loop in ``once`` (they do not use it at all)
    is_async = True
    #: seconds a batch may take before it stops early (a slow variant must not stall a run)
    budget: float | None = 5.0

    async def start(self) -> None:
        pass

    async def once(self) -> None:
        raise NotImplementedError

    def once_sync(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        pass

    async def batch(self, n: int) -> list[float]:
        if self.is_async:
            return await c.atime_calls(self.once, n, self.budget)
        return c.time_calls(self.once_sync, n, self.budget)


async def interleave(
    variants: list[Variant], batches: int, n: int, warmup: int = 50
) -> dict[str, list[float]]:
    """Start every variant, warm each up, then alternate batches of ``n`` round trips."""
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    started: list[Variant] = []
    try:
        for v in variants:
            await v.start()
            started.append(v)
            await v.batch(warmup)
        for b in range(batches):
            order = variants if b % 2 == 0 else variants[::-1]
            for v in order:
                samples[v.name].extend(await v.batch(n))
    finally:
        for v in reversed(started):
            await v.stop()
    return samples


class SocketFloor(Variant):
    """The raw floor: 64 bytes over a socketpair to a child that echoes them, awaited with
    the event loop's own ``sock_sendall``/``sock_recv``."""

    name = "raw async socketpair"

    async def start(self) -> None:
        import asyncio
        import socket

        self.loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=echo_socket, args=(b,), daemon=True)
        self.proc.start()
        b.close()
        a.setblocking(False)
        self.sock: socket.socket = a

    async def once(self) -> None:
        loop, sock = self.loop, self.sock
        await loop.sock_sendall(sock, PAYLOAD)
        got = 0
        while got < 64:
            data = await loop.sock_recv(sock, 64 - got)
            if not data:
                raise EOFError("echo child went away")
            got += len(data)

    async def stop(self) -> None:
        self.sock.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def loop_name() -> str:
    import asyncio

    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"
