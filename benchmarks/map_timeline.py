"""Where a one-worker ``Pool.map(trivial, range(10_000))`` spends its time, chunk by chunk.

A diagnostic, not a comparison: ``python -m benchmarks.map_timeline [maps]`` prints, for
each map, the events of the parent and of the worker on one clock (``time.monotonic_ns``,
shared by both processes), in microseconds from the call:

- ``send N``: the parent hands chunk ``N`` (its task id) to the worker's socket;
- ``recv N`` / ``done N`` / ``sent N`` (worker): chunk ``N`` received, computed, its
  results pickled and sent;
- ``back N`` / ``placed N`` (parent): the results received, unpickled and copied into
  the result list.

The work between a worker's ``sent`` and its next ``recv`` is its wait for work; the gap
from the last ``sent`` to the end of the map is the tail the parent adds. The parent and
the worker are pinned to different cores as in ``bench_pool``. The hooks wrap private
methods, so each event costs about a microsecond more than the run without them. See
*Map critical path* in docs/architecture.md and the Findings in RESULTS.md.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from benchmarks import _common as c
from benchmarks._targets import trivial

N_MAP = 10_000
_events: list[tuple[str, int, int]] = []


def _note(what: str, tid: int) -> None:
    _events.append((what, tid, time.monotonic_ns()))


def worker_hooks() -> None:
    """Pool initializer: pin the worker and record its events."""
    c.pin_child()
    from aiomp import _worker

    run_sync, reply = _worker.Worker.run_sync, _worker.Worker.reply

    def timed_run_sync(self: Any, tid: int, *rest: Any) -> None:
        _note("recv", tid)
        run_sync(self, tid, *rest)

    def timed_reply(self: Any, tid: int, *rest: Any, **kw: Any) -> None:
        _note("done", tid)
        reply(self, tid, *rest, **kw)
        _note("sent", tid)

    _worker.Worker.run_sync = timed_run_sync  # type: ignore[method-assign]
    _worker.Worker.reply = timed_reply  # type: ignore[method-assign]


def worker_events() -> list[tuple[str, int, int]]:
    out = list(_events)
    _events.clear()
    return out


def _parent_hooks() -> None:
    from aiomp import _handle, _pool
    from aiomp import _protocol as P

    send, on_message = _handle.WorkerHandle.send, _pool.Pool._on_message

    def timed_send(self: Any, task: Any) -> bool:
        _note("send", task.tid)
        return send(self, task)

    def timed_on_message(self: Any, h: Any, got: Any) -> None:
        tid = P.unpack(*got)[1]
        _note("back", tid)
        on_message(self, h, got)
        _note("placed", tid)

    _handle.WorkerHandle.send = timed_send  # type: ignore[method-assign]
    _pool.Pool._on_message = timed_on_message  # type: ignore[method-assign]


async def main(maps: int) -> None:
    import aiomp

    print(c.pin_parent())
    c.allow_bytecode()
    _parent_hooks()
    async with aiomp.Pool(1, initializer=worker_hooks) as pool:
        await pool.map(trivial, range(N_MAP))  # warm up
        for _ in range(maps):
            await pool.apply(worker_events)
            _events.clear()
            t0 = time.monotonic_ns()
            await pool.map(trivial, range(N_MAP))
            t1 = time.monotonic_ns()
            mine = list(_events)
            _events.clear()
            theirs = await pool.apply(worker_events)
            events = sorted((e for e in mine + theirs if t0 <= e[2] <= t1), key=lambda e: e[2])
            first = min(tid for _, tid, _ in events)
            line = " ".join(f"{what} {tid - first}@{(t - t0) / 1e3:.0f}" for what, tid, t in events)
            print(f"{(t1 - t0) / 1e3:.0f} us: {line}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
