"""What an async child's ``x = await q.get(); await q.put(x)`` costs it, per round trip.

Run as ``python -m benchmarks.profile_child [n] [--strace]``. The parent (asyncio, on
core 0) sends ``n`` 64 B items through an ``aiomp.Queue`` to one ``aiomp.spawn`` child
(core 1) that echoes them back through a second queue, per child variant:

- ``aiomp``: the echo as users write it (``await qin.get()``, ``await qout.put(x)``);
- ``lean``: the lean async echo floor (one reader registered for good, a non-blocking
  ``recv`` first, a future awaited only on an empty socket, a plain ``send``) on the
  *same* queues' sockets, in the same kind of child: only the queue's own work differs;

each on uvloop (what ``aiomp._child.new_runner`` gives an async child when uvloop is
installed) and on asyncio's own loop, and the aiomp echo on trio. Per variant the child
measures itself: CPU per round trip (``time.process_time``, every thread), and in a second
pass Python calls per round trip (``sys.setprofile``: Python functions by file and name,
C functions by qualified name). ``--strace`` also counts the child's syscalls per round
trip (``strace -c -f -p``, a third pass; traced, the child falls behind its parent and
rarely waits, so read it for the syscalls of a get and a put, not for the waits).
CPU is ``getrusage`` (user + system; the split between them is sampled by the kernel's
tick, so only their sum is reliable). Alternating batches; medians. Nothing is written
to RESULTS.md.
"""

from __future__ import annotations

import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _common as c
from benchmarks._targets import PAYLOAD

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _runner(loop: str) -> Any:
    import asyncio

    if loop == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner(loop_factory=asyncio.new_event_loop)


class _Profile:
    """Counts Python and C calls while on (``sys.setprofile``, this thread)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
        elif event == "c_call":
            key = f"C:{getattr(arg, '__qualname__', arg)}"
        else:
            return
        self.seen[key] = self.seen.get(key, 0) + 1


def child_main(rank: int, qin: Any, qout: Any, variant: str, loop: str) -> None:
    """The child: echo on ``loop`` the way ``variant`` says; answer commands (tuples)."""
    c.pin_child()
    state: dict[str, Any] = {}

    def command(cmd: tuple[Any, ...]) -> Any:
        """Start or stop a measured phase: its result, or None."""
        if cmd[0] == "start":
            state["mode"] = cmd[1]
            state["n"] = cmd[2]
            if cmd[1] == "calls":
                state["prof"] = _Profile()
                sys.setprofile(state["prof"].hook)
            state["cpu"] = resource.getrusage(resource.RUSAGE_SELF)
            return None
        t0, t1 = state["cpu"], resource.getrusage(resource.RUSAGE_SELF)
        sys.setprofile(None)
        n = state["n"]
        if state["mode"] == "calls":
            return {"calls": {k: v / n for k, v in state["prof"].seen.items()}}
        user, system = t1.ru_utime - t0.ru_utime, t1.ru_stime - t0.ru_stime
        return {"cpu_us": (user + system) / n * 1e6, "user_us": user / n * 1e6}

    async def aiomp_echo() -> None:
        get, put = qin.get, qout.put
        while True:
            x = await get()
            if type(x) is bytes:
                await put(x)
                continue
            if x[0] == "exit":
                return
            got = command(x)
            if got is not None:
                await put(got)

    async def lean_echo() -> None:
        import asyncio
        import pickle

        loop_ = asyncio.get_running_loop()
        rsock, ssock = qin._recv, qout._send
        fd = rsock.fileno()
        size = 1 + len(pickle.dumps(PAYLOAD, 5))  # a payload's datagram
        waiter: Any = None

        def readable() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        watched = os.dup(fd)
        loop_.add_reader(watched, readable)
        try:
            while True:
                try:
                    data = rsock.recv(256, 64)  # MSG_DONTWAIT: the socket stays blocking
                except BlockingIOError:
                    waiter = loop_.create_future()
                    await waiter
                    continue
                if len(data) == size:
                    ssock.send(data, 64)
                    continue
                cmd = pickle.loads(data[1:])
                if cmd[0] == "exit":
                    return
                got = command(cmd)
                if got is not None:
                    await qout.put(got)
        finally:
            loop_.remove_reader(watched)
            os.close(watched)

    serve = lean_echo if variant == "lean" else aiomp_echo
    if loop == "trio":
        import trio

        trio.run(serve)
        return
    with _runner(loop) as runner:
        runner.run(serve())


VARIANTS = [
    ("aiomp", "uvloop"),
    ("lean", "uvloop"),
    ("aiomp", "asyncio"),
    ("lean", "asyncio"),
    ("aiomp", "trio"),
]


async def _phase(qin: Any, qout: Any, mode: str, n: int) -> Any:
    await qin.put(("start", mode, n))
    put, get = qin.put, qout.get
    for _ in range(n):
        await put(PAYLOAD)
        await get()
    await qin.put(("stop",))
    return await qout.get()


def _strace(pid: int, seconds_hint: float) -> tuple[subprocess.Popen[bytes], str]:
    out = tempfile.mktemp(prefix="aiomp-strace-")
    proc = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid), "-o", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(seconds_hint)  # strace attaches; a diagnostic, not a test
    return proc, out


def _syscalls(path: str, n: int) -> dict[str, float]:
    counts: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls = int(parts[3])
                counts[parts[-1]] = calls / n
    os.unlink(path)
    return counts


async def main(n: int, batches: int, strace: bool) -> None:
    import aiomp

    setups = []
    for variant, loop in VARIANTS:
        qin, qout = aiomp.Queue(), aiomp.Queue()
        ctx = await aiomp.spawn(child_main, 1, args=(qin, qout, variant, loop), grace_period=1)
        setups.append((variant, loop, qin, qout, ctx))
    cpu: dict[tuple[str, str], list[float]] = {}
    user: dict[tuple[str, str], list[float]] = {}
    wall: dict[tuple[str, str], list[float]] = {}
    try:
        for _, _, qin, qout, _ in setups:  # warm up
            await _phase(qin, qout, "cpu", 500)
        for _ in range(batches):
            for variant, loop, qin, qout, _ in setups:
                t0 = time.perf_counter()
                got = await _phase(qin, qout, "cpu", n)
                wall.setdefault((variant, loop), []).append((time.perf_counter() - t0) / n * 1e6)
                cpu.setdefault((variant, loop), []).append(got["cpu_us"])
                user.setdefault((variant, loop), []).append(got["user_us"])
        calls = {}
        for variant, loop, qin, qout, _ in setups:
            calls[(variant, loop)] = (await _phase(qin, qout, "calls", 1000))["calls"]
        sysc = {}
        if strace:
            for variant, loop, qin, qout, ctx in setups:
                proc, path = _strace(ctx.pids()[0], 1.0)
                await _phase(qin, qout, "cpu", 3000)
                proc.send_signal(signal.SIGINT)
                proc.wait()
                sysc[(variant, loop)] = _syscalls(path, 3000)
    finally:
        for _, _, qin, _, _ in setups:
            await qin.put(("exit",))
        for *_, ctx in setups:
            await ctx.join()
    print(f"{n} round trips x {batches} batches; load {os.getloadavg()[0]:.2f}")
    head = f"{'child':<18} {'child CPU/rt µs':>16} {'of it user':>11} {'wall/rt µs':>12}"
    print(f"{head} {'calls/rt':>9}")
    for variant, loop, *_ in setups:
        k = (variant, loop)
        ncalls = sum(calls[k].values())
        print(
            f"{variant + ' on ' + loop:<18} {statistics.median(cpu[k]):>16.1f} "
            f"{statistics.median(user[k]):>11.1f} "
            f"{statistics.median(wall[k]):>12.1f} {ncalls:>9.1f}"
        )
    for variant, loop, *_ in setups:
        k = (variant, loop)
        print(f"\n-- {variant} on {loop}: calls per round trip (>= 0.05)")
        for name, per in sorted(calls[k].items(), key=lambda kv: -kv[1]):
            if per >= 0.05:
                print(f"  {per:6.2f}  {name}")
        if k in sysc:
            print(
                "   syscalls per round trip: "
                + ", ".join(
                    f"{name} {per:.2f}"
                    for name, per in sorted(sysc[k].items(), key=lambda kv: -kv[1])
                    if per >= 0.05
                )
            )


if __name__ == "__main__":
    import anyio

    c.allow_bytecode()
    print(c.pin_parent())
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    anyio.run(
        main,
        int(args[0]) if args else 2000,
        int(args[1]) if len(args) > 1 else 5,
        "--strace" in sys.argv,
    )
