"""The fixed cost of one numpy array message, in one process (issue 17, target 3b).

A loop of ``q.put_nowait(a)`` then ``q.get_nowait()`` on one unbounded ``aiomp.Queue``,
the consumer keeping the last :data:`RING` received arrays alive (as a consumer would),
so that no scheduling noise is in the figures: CPU time per message
(``time.process_time``), syscalls per message (``strace -c -f``, the difference between
a run of ``n`` and of ``2n`` messages, so start-up cancels out) and Python calls per
message (cProfile). Two kinds of item:

- ``numpy``: a plain array, copied into shared memory at ``put`` (below 64 KiB: inline);
- ``empty``: an ``aiomp.empty`` array allocated and filled (``np.copyto``) per message,
  as a producer building batches in shared memory does.

Baselines in the same run: one ``np.copyto`` of the same size into memory already
mapped, and the floor of a shared-memory message here: a bare ``SCM_RIGHTS``
``sendmsg``/``recvmsg`` of a memfd fd over a ``SOCK_SEQPACKET`` pair and ``close`` of
the received fd (what any message that hands memory over must cost: 3 syscalls), the
same with an ``mmap``/``munmap`` of the array's size (a receiver that maps each message
anew: 5), and a bare ``sendmsg``/``recvmsg`` of a 64 B datagram.

    python -m benchmarks.diagnostics.profile_arrays                 # CPU, syscalls, calls: all rows
    python -m benchmarks.diagnostics.profile_arrays --cpu-only      # CPU per message only
    python -m benchmarks.diagnostics.profile_arrays --sizes 102400  # one size
"""

from __future__ import annotations

import argparse
import array
import cProfile
import ctypes
import fcntl
import mmap
import os
import pstats
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

import aiomp

RING = 8
WARM = 2000  # messages before a two-process measurement starts (see _two_processes)
SIZES = (4 << 10, 100 << 10, 1 << 20)
KINDS = ("numpy", "empty")


def _loop(kind: str, nbytes: int, n: int) -> None:
    """``n`` messages put and got, the last RING received arrays kept alive."""
    q = aiomp.Queue()
    src = np.arange(nbytes // 4, dtype=np.float32)
    ring: list[object] = [None] * RING
    put, get = q.put_nowait, q.get_nowait
    try:
        if kind == "numpy":
            for i in range(n):
                put(src)
                ring[i % RING] = get()
        else:
            for i in range(n):
                a = aiomp.empty(src.shape, np.float32)
                np.copyto(a, src)
                put(a)
                del a
                ring[i % RING] = get()
    finally:
        ring.clear()
        q.close()


def _two_processes(kind: str, nbytes: int, n: int) -> tuple[float, float]:
    """CPU per message of a producer (this process) and a forked consumer on one queue:
    what the one-process loop leaves out, a receiver that takes leases of its own. The
    consumer acknowledges every RING messages through a pipe, so the socket never fills
    (no overflow log) and the producer never waits in the kernel for long."""
    q = aiomp.Queue()
    src = np.arange(nbytes // 4, dtype=np.float32)
    acks_r, acks_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the consumer
        code = 1
        try:
            ring: list[object] = [None] * RING
            t = 0.0
            for i in range(n + WARM):
                if i == WARM:
                    t = time.process_time()
                ring[i % RING] = q.sync.get(timeout=60)
                if i % RING == RING - 1:
                    os.write(acks_w, b"x")
            os.write(out_w, repr((time.process_time() - t) / n).encode())
            ring.clear()
            code = 0
        finally:
            os._exit(code)
    try:
        t = 0.0
        for i in range(n + WARM):
            if i == WARM:
                t = time.process_time()
            if kind == "numpy":
                q.put_nowait(src)
            else:
                a = aiomp.empty(src.shape, np.float32)
                np.copyto(a, src)
                q.put_nowait(a)
                del a
            if i % RING == RING - 1 and i >= RING:
                os.read(acks_r, 1)  # at most 2 * RING messages ahead of the consumer
        producer = (time.process_time() - t) / n
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"the consumer failed (wait status {status})")
        return producer, float(os.read(out_r, 64))
    finally:
        for fd in (acks_r, acks_w, out_r, out_w):
            os.close(fd)
        q.close()


def _two_fresh(kind: str, nbytes: int, n: int) -> tuple[float, float]:
    """:func:`_two_processes` in a fresh interpreter: in this one, the heap the other rows
    left is copied on write after the fork, and the faults land in the measurement."""
    cmd = [sys.executable, os.path.abspath(__file__), "--inner-two", kind, str(nbytes), str(n)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _cpu_per_message(kind: str, nbytes: int, n: int) -> float:
    _loop(kind, nbytes, 2 * RING + 8)  # warm: pool segments made, receiver mappings kept
    t = time.process_time()
    _loop(kind, nbytes, n)
    return (time.process_time() - t) / n


def _memcpy(nbytes: int, n: int) -> float:
    src = np.arange(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.process_time()
    for _ in range(n):
        np.copyto(dst, src)
    return (time.process_time() - t) / n


def _floor_fd(nbytes: int, n: int, mapped: bool) -> float:
    """sendmsg + recvmsg of one memfd fd and ``close``; with ``mapped``, also an
    ``mmap`` + ``munmap`` of ``nbytes`` (libc's, as aiomp maps: no ``dup``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
    libc.mmap.argtypes += (ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("floor", os.MFD_CLOEXEC)
    size = max(nbytes, 1)
    os.ftruncate(fd, size)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    space = socket.CMSG_SPACE(4)
    body = [b"x" * 64]
    try:
        t = time.process_time()
        for _ in range(n):
            a.sendmsg(body, anc)
            _, ancdata, _, _ = b.recvmsg(128, space)
            got = int.from_bytes(ancdata[0][2][:4], sys.byteorder)
            if mapped:
                libc.munmap(libc.mmap(None, size, prot, flags, got, 0), size)
            os.close(got)
        return (time.process_time() - t) / n
    finally:
        os.close(fd)
        a.close()
        b.close()


def _floor_leased(n: int) -> float:
    """What aiomp's lease protocol adds to the fd floor, as bare syscalls (7, as in the
    one-process loop): the reuse test (``F_OFD_GETLK``), a fresh description for the
    message (``openat`` of ``/proc/self/fd/N``) and its lease (``F_OFD_SETLK``),
    ``sendmsg``, ``close`` of it, ``recvmsg``, ``close`` of the received fd."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    lock = struct.Struct("hhqqi4x")
    rdlock, wrlock = (
        lock.pack(fcntl.F_RDLCK, 0, 4096, 65536, 0),
        lock.pack(fcntl.F_WRLCK, 0, 0, 0, 0),
    )
    path = f"/proc/self/fd/{fd}"
    space = socket.CMSG_SPACE(4)
    body = [b"x" * 64]
    try:
        t = time.process_time()
        for _ in range(n):
            fcntl.fcntl(fd, 36, wrlock)  # F_OFD_GETLK
            d = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            fcntl.fcntl(d, 37, rdlock)  # F_OFD_SETLK
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [d]).tobytes())]
            a.sendmsg(body, anc)
            os.close(d)
            _, ancdata, _, _ = b.recvmsg(128, space)
            os.close(int.from_bytes(ancdata[0][2][:4], sys.byteorder))
        return (time.process_time() - t) / n
    finally:
        os.close(fd)
        a.close()
        b.close()


def _floor_plain(n: int) -> float:
    """sendmsg + recvmsg of a 64 B datagram, no fd."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    body = [b"x" * 64]
    try:
        t = time.process_time()
        for _ in range(n):
            a.sendmsg(body)
            b.recvmsg(128)
        return (time.process_time() - t) / n
    finally:
        a.close()
        b.close()


def _calls(kind: str, nbytes: int, n: int) -> int:
    prof = cProfile.Profile()
    prof.enable()
    _loop(kind, nbytes, n)
    prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def _calls_per_message(kind: str, nbytes: int, n: int) -> float:
    """Python calls per message: runs of ``n`` and ``2n``, so the set-up cancels out."""
    _loop(kind, nbytes, 2 * RING + 8)
    return (_calls(kind, nbytes, 2 * n) - _calls(kind, nbytes, n)) / n


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:(\d+)\s+)?(\w+)\s*$")


def _strace(kind: str, nbytes: int, n: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "strace")
        cmd = [sys.executable, os.path.abspath(__file__), "--inner", kind, str(nbytes)]
        subprocess.run(
            ["strace", "-c", "-f", "-o", out, *cmd, str(n)], check=True, stdout=subprocess.DEVNULL
        )
        counts: dict[str, int] = {}
        with open(out) as f:
            for line in f:
                m = _STRACE_ROW.match(line)
                if m and m.group(3) != "total":
                    counts[m.group(3)] = int(m.group(1))
        return counts


def _syscalls_per_message(kind: str, nbytes: int, n: int) -> dict[str, float]:
    one, two = _strace(kind, nbytes, n), _strace(kind, nbytes, 2 * n)
    per = {k: (two.get(k, 0) - one.get(k, 0)) / n for k in set(one) | set(two)}
    return {k: v for k, v in sorted(per.items()) if v >= 0.05}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    p.add_argument("--kinds", nargs="*", default=list(KINDS))
    p.add_argument("-n", type=int, default=2000, help="messages per CPU measurement")
    p.add_argument("--repeat", type=int, default=3, help="CPU measurements per row")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--two", action="store_true", help="also a forked consumer (CPU of both)")
    p.add_argument("--inner", nargs=3, metavar=("KIND", "NBYTES", "N"), help=argparse.SUPPRESS)
    p.add_argument("--inner-two", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner_two:
        kind, nbytes, n = args.inner_two[0], int(args.inner_two[1]), int(args.inner_two[2])
        print(*_two_processes(kind, nbytes, n))
        return
    if args.inner:
        kind, nbytes, n = args.inner[0], int(args.inner[1]), int(args.inner[2])
        _loop(kind, nbytes, 2 * RING + 8)
        _loop(kind, nbytes, n)
        return
    print(f"load {os.getloadavg()[0]:.2f}; aiomp from {os.path.dirname(aiomp.__file__)}")
    print(f"{'row':<22}{'µs/msg (min..max)':>22}{'x memcpy':>10}{'py calls':>10}  syscalls")
    for nbytes in args.sizes:
        label = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
        n = max(200, args.n * (100 << 10) // max(nbytes, 100 << 10))
        copy = min(_memcpy(nbytes, n * 4) for _ in range(args.repeat))
        print(f"{'memcpy ' + label:<22}{copy * 1e6:>14.2f}{'':>8}{1:>10.2f}")
        for mapped in (False, True):
            floor = [_floor_fd(nbytes, n, mapped) for _ in range(args.repeat)]
            lo, hi = min(floor) * 1e6, max(floor) * 1e6
            name = "floor fd+mmap " if mapped else "floor fd "
            row = f"{name + label:<22}{lo:>11.1f} ({lo:.1f}..{hi:.1f})"
            print(f"{row}{min(floor) / copy:>8.1f}{'':>10}  {5 if mapped else 3}")
        for kind in args.kinds:
            cpu = [_cpu_per_message(kind, nbytes, n) for _ in range(args.repeat)]
            lo, hi = min(cpu), max(cpu)
            row = f"{kind + ' ' + label:<22}{lo * 1e6:>11.1f} ({lo * 1e6:.1f}..{hi * 1e6:.1f})"
            row += f"{lo / copy:>8.1f}"
            if not args.cpu_only:
                calls = _calls_per_message(kind, nbytes, max(100, n // 10))
                sys_ = _syscalls_per_message(kind, nbytes, max(200, n // 4))
                total = sum(sys_.values())
                detail = " ".join(f"{k} {v:.2f}" for k, v in sys_.items())
                row += f"{calls:>10.0f}  {total:.1f}: {detail}"
            print(row, flush=True)
            if args.two:
                pairs = [_two_fresh(kind, nbytes, n) for _ in range(args.repeat)]
                sums = [p + c for p, c in pairs]
                best = pairs[sums.index(min(sums))]
                row = (
                    f"{'  2 procs (put+get)':<22}{min(sums) * 1e6:>11.1f} ({min(sums) * 1e6:.1f}.."
                )
                row += f"{max(sums) * 1e6:.1f}){min(sums) / copy:>8.1f}  producer "
                print(f"{row}{best[0] * 1e6:.1f} + consumer {best[1] * 1e6:.1f}", flush=True)
    plain = min(_floor_plain(args.n * 4) for _ in range(args.repeat))
    print(f"{'floor 64 B datagram':<22}{plain * 1e6:>11.1f}{'':>18}  2")
    leased = [_floor_leased(args.n * 2) for _ in range(args.repeat)]
    lo, hi = min(leased) * 1e6, max(leased) * 1e6
    print(f"{'floor fd + leases':<22}{lo:>11.1f} ({lo:.1f}..{hi:.1f}){'':>18}  7")


if __name__ == "__main__":
    main()
