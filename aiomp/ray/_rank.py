"""One rank of :func:`aiomp.ray.spawn`: an async Ray actor that runs ``fn(rank, *args)`` once.

The parent makes it with ``ray.remote(RankActor)`` and a ``ctl`` concurrency group (its own
thread and event loop in Ray), in one bundle of the job's placement group, and calls:

* ``init(rank, nprocs, want_port, capture)`` (default group): records ``(rank, nprocs)`` as
  ``aiomp.get_worker_info()``; with ``capture``, points fds 1 and 2 at pipes this actor reads
  (see :meth:`output`); answers ``(node id, node address, pid, port)``, ``port`` a TCP port
  free on the node now (rank 0 of a ``rendezvous=True`` job: its ``MASTER_PORT``) or None;
* ``run(blob, env)`` (default group): merges ``env`` into ``os.environ``, unpickles ``(fn,
  args)`` and runs ``fn(rank, *args)``, awaiting a coroutine it returns on the actor's loop;
  answers ``(True, result)`` or ``(False, ErrorPayload)``. A sync ``fn`` holds the default
  group's loop while it runs; the ``ctl`` group answers meanwhile;
* ``output()`` (``ctl``): a long poll for the bytes written to fds 1 and 2 since the last
  call, as ``[(stream index, bytes), ...]``; None once ``run`` has finished and all it wrote
  has been read. The parent labels them (``aiomp._output.lines``);
* ``cancel()`` (``ctl``): cancels an ``async def`` fn (it sees ``CancelledError``); a sync one
  runs on until the parent kills the actor after the grace period;
* ``alive()`` (``ctl``): never returns; its ref fails when the actor dies.

Owns the capture pipes' read ends (closed with the process: the parent kills the actor
once the job is over). Imports Ray only inside methods, as ``aiomp.ray._actor`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pickle
import socket
import sys
from typing import Any

from .._child.info import set_worker_info
from .._pool.protocol import ErrorPayload

#: The most bytes one ``output()`` answer carries per stream.
READ_MAX = 1 << 20


class RankActor:
    """One rank. See the module docstring."""

    def __init__(self) -> None:
        self._rank = 0
        self._fds: list[int] = []  # the capture pipes' read ends: stdout's, stderr's
        self._task: asyncio.Task[Any] | None = None  # an async fn's, while it runs
        self._loop: asyncio.AbstractEventLoop | None = None  # the default group's
        self._cancelled = False
        self._finished = False  # run() is over and flushed what it wrote
        self._ctl: asyncio.AbstractEventLoop | None = None  # the ctl group's, once output()
        self._wake: asyncio.Event | None = None  # on the ctl loop

    async def init(
        self, rank: int, nprocs: int, want_port: bool, capture: bool
    ) -> tuple[str, str, int, int | None]:
        import ray

        self._rank = rank
        set_worker_info(rank, nprocs)
        if capture:
            self._capture()
        ctx = ray.get_runtime_context()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return ctx.get_node_id(), address, os.getpid(), free_port() if want_port else None

    def _capture(self) -> None:
        """Point fds 1 and 2 at pipes whose read ends :meth:`output` reads."""
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            with contextlib.suppress(Exception):
                stream.flush()
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.dup2(w, fd)
            os.close(w)
            self._fds.append(r)
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:  # a line reaches the parent as it is printed
                with contextlib.suppress(Exception):
                    reconfigure(line_buffering=True)

    async def run(self, blob: bytes, env: dict[str, str] | None) -> tuple[bool, Any]:
        try:
            if env:
                os.environ.update(env)
            fn, args = pickle.loads(blob)
            result = fn(self._rank, *args)
            if inspect.iscoroutine(result):  # not asyncio.iscoroutine: it takes generators
                self._loop = asyncio.get_running_loop()
                self._task = asyncio.current_task()
                if self._cancelled:  # cancel() came first
                    result.close()
                    raise asyncio.CancelledError
                result = await result
        except BaseException as exc:  # noqa: BLE001 - the rank's outcome, whatever it is
            return False, ErrorPayload.of(exc)
        finally:
            self._task = None
            self._finish()
        return True, result

    def _finish(self) -> None:
        """``run`` is over: flush what it wrote, and wake :meth:`output` to read the rest."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._finished = True
        ctl, wake = self._ctl, self._wake
        if ctl is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                ctl.call_soon_threadsafe(wake.set)

    async def output(self) -> list[tuple[int, bytes]] | None:
        """(``ctl``) What fds 1 and 2 got since the last call, once there is some; None at
        the end (see the module docstring)."""
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
            self._ctl = loop
        wake = self._wake
        while True:
            finished = self._finished  # before reading: what it wrote is in the pipes then
            chunks = self._read()
            if chunks:
                return chunks
            if finished or not self._fds:
                return None
            wake.clear()
            for fd in self._fds:
                loop.add_reader(fd, wake.set)
            try:
                if not self._finished:
                    await wake.wait()
            finally:
                for fd in self._fds:
                    loop.remove_reader(fd)

    def _read(self) -> list[tuple[int, bytes]]:
        chunks = []
        for i, fd in enumerate(self._fds):
            try:
                data = os.read(fd, READ_MAX)
            except BlockingIOError:
                continue
            if data:
                chunks.append((i, data))
        return chunks

    async def cancel(self) -> None:
        """(``ctl``) Cancel an async fn on the default group's loop (see the module
        docstring)."""
        self._cancelled = True
        task, loop = self._task, self._loop
        if task is not None and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    async def alive(self) -> None:
        """(``ctl``) Never returns: its ref fails when the actor dies."""
        await asyncio.get_running_loop().create_future()


def free_port() -> int:
    """A TCP port that no one listens on, on any address of this node, now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
    return port
