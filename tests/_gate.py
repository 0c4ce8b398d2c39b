"""A rendezvous between a test and its children, over an abstract unix socket.

A child connects and says ``"<key> <pid>"`` (``_funcs.gate_connect``); the test waits for
that with :meth:`Gate.ready` and lets a waiting child go on with :meth:`Gate.release`.
Children block on the gate instead of sleeping, so tests need no timing assumptions.
"""

from __future__ import annotations

import itertools
import os
import socket

import anyio

_gate_ids = itertools.count()


class Gate:
    """A rendezvous with children over an abstract unix socket (nothing on disk to clean up).

    A child connects and says ``"<rank> <pid>"`` (see ``_funcs.gate_connect``); the test
    waits for that with :meth:`ready` and lets a waiting child go on with :meth:`release`.
    """

    def __init__(self) -> None:
        self.address = f"\0aiomp-test-{os.getpid()}-{next(_gate_ids)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._conns: dict[int, socket.socket] = {}
        self.pids: dict[int, int] = {}

    async def ready(self, n: int) -> dict[int, int]:
        """Wait until ``n`` children in all have said ready; return ``{rank: pid}``."""
        while len(self._conns) < n:
            await anyio.wait_readable(self._listener)
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                continue
            try:
                conn.setblocking(False)
                line = b""
                while not line.endswith(b"\n"):
                    await anyio.wait_readable(conn)
                    chunk = conn.recv(64)
                    assert chunk, "a child hung up before it said ready"
                    line += chunk
            except BaseException:
                conn.close()
                raise
            rank, pid = map(int, line.split())
            self._conns[rank] = conn
            self.pids[rank] = pid
        return self.pids

    def ready_sync(self, n: int, timeout: float) -> dict[int, int]:
        """:meth:`ready` for sync tests."""
        self._listener.settimeout(timeout)
        while len(self._conns) < n:
            conn, _ = self._listener.accept()
            conn.settimeout(timeout)
            with conn.makefile("rb") as f:
                rank, pid = map(int, f.readline().split())
            self._conns[rank] = conn
            self.pids[rank] = pid
        return self.pids

    def release(self, *ranks: int) -> None:
        for rank in ranks or tuple(self._conns):
            self._conns[rank].send(b"x")

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._listener.close()
