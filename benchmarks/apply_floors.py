"""Which floor ``Pool.apply`` is measured against, and what separates them (issue 17).

Run as ``python -m benchmarks.apply_floors [batches]``. Prints, in one run and alternating
batches (the ``bench_pool`` method: parent on one core, children on the other), the median
round trip and the CPU per round trip (parent + child) of:

- the raw floor of ``bench_pool``: 64 B over a stream pair to a blocking echo child,
  the parent awaiting the loop's ``sock_sendall``/``sock_recv`` (which add and remove a
  reader on every round trip);
- the same child, the parent reading with a reader callback that stays registered and
  resolves the awaited future (the pattern ``Pool.apply`` uses: see *Dispatch* and
  *Apply critical path* in docs/architecture.md);
- the same, the parent spinning 10 µs after each send (whether the floor's advantage is
  how long its parent has been idle when the reply comes);
- a reader added after each send and removed in its callback (``sock_recv`` without its
  first, failing ``recv``);
- a kept reader with the request and the reply on two socket pairs (see *Two channels*);
- ``Pool.apply(trivial)``;
- ``Pool.apply(trivial)`` with the parent's loop kept busy (not blocked) for 40 µs;
- ``Pool.apply(trivial)`` with a worker that polls 50 µs before it blocks.

With ``--base TREE`` (another checkout, say a ``git worktree`` of the commit before a
change), that tree's ``aiomp`` is copied into a temporary folder as the package
``aiomp_base`` and its ``Pool.apply`` joins the alternation: an A/B of two trees in one
process, against one floor (two trees in two processes disagree by the floor's own
spread). ``--only-apply`` keeps the raw floor and the pools alone; ``--uvloop`` runs the
parent on uvloop.

Nothing is written to RESULTS.md: the figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import PAYLOAD, trivial
from benchmarks.bench_pool import AiompApply


class KeptReaderFloor(h.SocketFloor):
    """The raw floor's child; the parent keeps one reader registered (as the pool does)."""

    name = "raw floor, reader kept (sync echo child)"

    async def start(self) -> None:
        await super().start()
        self.waiter = None
        sock = self.sock

        def readable() -> None:
            try:
                data = sock.recv(64)
            except BlockingIOError:
                return
            self.got += len(data)
            if self.got >= 64 and self.waiter is not None:
                self.waiter.set_result(None)

        self.got = 0
        self.loop.add_reader(sock.fileno(), readable)

    async def once(self) -> None:
        self.got = 0
        self.waiter = waiter = self.loop.create_future()
        self.sock.send(PAYLOAD)
        await waiter

    async def stop(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        await super().stop()


class SpinAfterSendFloor(KeptReaderFloor):
    """A kept reader whose parent stays busy (a spin) for ``spin_ns`` after each send:
    whether the floor's advantage is how long its parent has been idle when the reply
    comes."""

    name = "raw floor, reader kept, parent spins 10 µs after send"
    spin_ns = 10_000

    async def once(self) -> None:
        self.got = 0
        self.waiter = waiter = self.loop.create_future()
        self.sock.send(PAYLOAD)
        until = time.monotonic_ns() + self.spin_ns
        while time.monotonic_ns() < until:
            pass
        await waiter


class ReaderPerCallFloor(h.SocketFloor):
    """A reader registered after each send and removed in its callback (what ``sock_recv``
    does, without its first, failing ``recv``)."""

    name = "raw floor, reader added per call"

    async def once(self) -> None:
        loop, sock = self.loop, self.sock
        waiter = loop.create_future()
        fd = sock.fileno()

        def readable() -> None:
            data = sock.recv(64)
            loop.remove_reader(fd)
            waiter.set_result(data)

        sock.send(PAYLOAD)
        loop.add_reader(fd, readable)
        await waiter


def echo_two_sockets(rx: socket.socket, tx: socket.socket) -> None:
    """The floor's blocking echo child, reading from one pair and answering on another."""
    c.pin_child()
    rx.setblocking(True)
    tx.setblocking(True)
    while True:
        data = rx.recv(64)
        if not data:
            break
        while len(data) < 64:
            data += rx.recv(64 - len(data))
        tx.sendall(data)
    rx.close()
    tx.close()


class TwoPairFloor(KeptReaderFloor):
    """A kept reader and a blocking echo child, with the request and the reply on two
    socket pairs: reading the reply then wakes nobody (on one pair it wakes the child,
    asleep in ``recv`` on the same socket, for the room the read freed)."""

    name = "raw floor, reader kept, two pairs"

    def pair(self) -> socket.socket:
        import multiprocessing

        a, b = socket.socketpair()
        ra, rb = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=echo_two_sockets, args=(b, rb), daemon=True)
        self.proc.start()
        b.close()
        rb.close()
        self.tx = a
        return ra

    async def once(self) -> None:
        self.got = 0
        self.waiter = waiter = self.loop.create_future()
        self.tx.send(PAYLOAD)
        await waiter

    async def stop(self) -> None:
        self.tx.close()
        await super().stop()


class LoopBusyApply(AiompApply):
    """``Pool.apply(trivial)`` with the parent's loop kept busy for up to ``us`` µs after
    the call starts: a ``call_soon`` chain, so the loop polls its fds with a zero timeout
    and runs its other callbacks and tasks as usual (it is never blocked, unlike the spin
    above), but the parent's core does not halt while the worker runs. Not what aiomp
    does: whether the second halted-core wake-up per round trip is what separates
    ``apply`` from the floor (see benchmarks/RESULTS.md, Findings)."""

    def __init__(self, us: int = 40) -> None:
        self.us = us
        self.name = f"aiomp Pool.apply, loop kept busy <= {us} µs"

    async def start(self) -> None:
        import asyncio

        await super().start()
        self.loop = asyncio.get_running_loop()
        self.until = 0

    def _busy(self) -> None:
        if time.monotonic_ns() < self.until:
            self.loop.call_soon(self._busy)

    async def once(self) -> None:
        self.until = time.monotonic_ns() + self.us * 1000
        self.loop.call_soon(self._busy)  # runs once the call has sent and yielded
        await self.pool.apply(trivial)
        self.until = 0


def worker_polls(us: int = 50) -> None:
    """Pool initializer (a diagnostic, not what aiomp does): pin the worker, and have it
    poll its task socket for up to ``us`` µs before each blocking receive, so that its core
    does not halt between a reply and the next task."""
    c.pin_child()
    from aiomp import _transport

    recv_sync = _transport.Stream.recv_sync

    def polling(self: _transport.Stream, deadline: float | None = None) -> object:
        if deadline is None:
            until = time.monotonic_ns() + us * 1000
            while time.monotonic_ns() < until:
                got = self.try_recv()
                if got is not None:
                    return got
        return recv_sync(self, deadline)

    _transport.Stream.recv_sync = polling  # type: ignore[assignment,method-assign]


class WorkerPollsApply(AiompApply):
    """``Pool.apply(trivial)`` whose worker polls 50 µs before it blocks (see
    :func:`worker_polls`): the other side's halted-core wake-up, measured."""

    name = "aiomp Pool.apply, worker polls <= 50 µs"

    async def start(self) -> None:
        import aiomp

        self.pool = aiomp.Pool(1, initializer=worker_polls, grace_period=1.0)
        await self.pool.__aenter__()


class BaseApply(AiompApply):
    """``Pool.apply(trivial)`` of the tree given with ``--base`` (see :func:`load_base`)."""

    name = "aiomp Pool.apply (base tree)"

    async def start(self) -> None:
        from aiomp_base._pool import Pool  # type: ignore[import-not-found]

        self.pool = Pool(1, grace_period=1.0)
        await self.pool.__aenter__()


def load_base(tree: str) -> str:
    """Copy ``tree``'s ``aiomp`` to a new temporary folder as ``aiomp_base`` and put that
    folder on ``sys.path`` (spawn children inherit it); returns the folder."""
    folder = tempfile.mkdtemp(prefix="apply-ab-")
    dest = os.path.join(folder, "aiomp_base")
    shutil.copytree(os.path.join(tree, "aiomp"), dest, ignore=shutil.ignore_patterns("*.pyc"))
    init = os.path.join(dest, "__init__.py")
    with open(init) as f:
        text = f.read()
    # Its lazy public names import "aiomp.<module>": its own modules instead.
    with open(init, "w") as f:
        f.write(text.replace('f"aiomp.{module}"', 'f"{__name__}.{module}"'))
    sys.path.insert(0, folder)
    return folder


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("batches", nargs="?", type=int, default=20)
    p.add_argument("--base", help="another tree whose Pool.apply joins the alternation")
    p.add_argument("--only-apply", action="store_true", help="the raw floor and the pools only")
    p.add_argument("--uvloop", action="store_true", help="run the parent on uvloop")
    args = p.parse_args()
    batches = args.batches
    pinning = c.pin_parent()
    variants: list[h.Variant] = [h.SocketFloor()]
    if not args.only_apply:
        variants += [KeptReaderFloor(), SpinAfterSendFloor(), ReaderPerCallFloor(), TwoPairFloor()]
    variants.append(AiompApply())
    if not args.only_apply:
        variants += [LoopBusyApply(40), WorkerPollsApply()]
    folder = load_base(args.base) if args.base else None
    if folder is not None:
        variants.append(BaseApply())
    try:
        s = await h.interleave(variants, batches, 120)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    base = c.median(s[variants[0].name])
    print(
        f"{pinning}; {batches} batches of 120; loop {h.loop_name()}; load {os.getloadavg()[0]:.2f}"
    )
    for v in variants:
        m = c.median(s[v.name])
        cpu = v.cpu_medians() or (0.0, 0.0)
        print(
            f"{v.name:55s} {m * 1e6:7.1f} µs {m / base:5.2f}x  CPU {cpu[0] * 1e6:5.1f} + "
            f"{cpu[1] * 1e6:5.1f} µs"
        )
    if folder is not None:
        new, old = c.median(s[AiompApply.name]), c.median(s[BaseApply.name])
        print(f"new / base: {new / old:.3f}")


if __name__ == "__main__":
    import anyio

    c.allow_bytecode()
    anyio.run(main, backend_options={"use_uvloop": "--uvloop" in sys.argv})
