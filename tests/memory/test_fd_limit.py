"""Shared memory under a low fd limit (many arrays in flight, a clear error, spawn still
reachable), bounded fds for large arrays, names of unread messages, bad shapes, a Ctrl-C
in a finalizer under trio.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import aiomp
from aiomp._memory import allocator as _allocator
from aiomp._memory import janitor as _janitor
from aiomp._memory import registry as _registry
from tests._run import run_python
from tests.memory._shm import REPO, fd_count, shm_names

STRATEGIES = ["file_descriptor", "file_system"]


_FD_LIMIT = textwrap.dedent("""
    import gc, os, resource, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    strategy, keep_alive = sys.argv[1], sys.argv[2] == "keep"

    async def main():
        aiomp.set_sharing_strategy(strategy)
        q = aiomp.Queue()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        keep, sent, error = [], 0, None
        try:
            for i in range(1000):
                arr = np.full((2 << 20) if keep_alive else (1 << 20), i % 251, np.uint8)
                if keep_alive:  # arrays the producer keeps: their segments stay open
                    arr = aiomp.share_memory(arr)
                    keep.append(arr)
                q.put_nowait(arr)
                sent += 1
        except Exception as exc:
            error = exc
        del keep, arr
        gc.collect()
        fds = len(os.listdir("/proc/self/fd"))
        with anyio.fail_after(60):
            async with aiomp.spawn(_funcs_shm.drain, 1, args=(q, sent, strategy)) as ctx:
                pass
        assert ctx.results[0] == [i % 251 for i in range(sent)], "drained exactly once"
        assert q.qsize() == 0
        print(os.getpid(), sent, fds, type(error).__name__, error)

    anyio.run(main)
""")


def _fd_limit_run(strategy: str, keep: str) -> tuple[int, int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _FD_LIMIT, strategy, keep],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pid, sent, fds, kind, message = proc.stdout.strip().split(" ", 4)
    left = {n for n in os.listdir(_janitor.SHM_DIR) if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    assert not left, "the names the process made went with it"
    return int(sent), int(fds), kind, message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_many_arrays_in_flight_under_a_low_fd_limit(strategy: str) -> None:
    """Regression (issue 9 item 3, issue 18 item 4): with RLIMIT_NOFILE=256, puts of 1 MiB
    arrays with nobody consuming failed at put #969 with a raw EMFILE, and the process
    could not even spawn a consumer. Segments in flight now hold no fd of the sender's
    (past IDLE_SEGMENTS they are given away): all 1000 go, and a consumer drains them."""
    sent, fds, kind, _ = _fd_limit_run(strategy, "drop")
    assert (sent, kind) == (1000, "NoneType")
    assert fds < 64 + _allocator.IDLE_SEGMENTS


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_fd_limit_is_a_clear_error_and_the_queue_drains_after(strategy: str) -> None:
    """Regression (issue 9 item 3): at the fd limit a put raised a raw
    ``OSError: [Errno 24] Too many open files: '/proc/self/fd/254'``. Now: a TransportError
    saying how many fds are open, the limit and what to do; nothing half-sent, and a
    consumer started after the error (the arrays dropped) drains the queue exactly once."""
    sent, fds, kind, message = _fd_limit_run(strategy, "keep")
    assert fds < 64 + _allocator.IDLE_SEGMENTS, "the arrays dropped: their fds went too"
    assert kind == "TransportError", message
    assert 100 < sent < 256
    assert "file descriptors open" in message and "RLIMIT_NOFILE) is 256" in message
    assert "raise the limit" in message


_SPAWN_AT_THE_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    async def main():
        q = aiomp.Queue()
        q.put_nowait(np.full(1 << 20, 7, np.uint8))  # the tree's first segment
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        held = []
        try:
            while True:
                held.append(os.dup(0))
        except OSError:
            pass
        try:
            spawn = aiomp.spawn  # with every fd in use: nothing left to import it with
        finally:
            for fd in held:
                os.close(fd)
        with anyio.fail_after(60):
            async with spawn(_funcs_shm.drain, 1, args=(q, 1, "file_descriptor")) as ctx:
                pass
        print(ctx.results[0])

    anyio.run(main)
""")


def test_the_spawn_api_is_reachable_with_every_fd_in_use() -> None:
    """The root of a tree imports the spawn API at its first shared segment: once
    messages in flight may take every fd, starting a consumer to drain them must not
    need one for an import."""
    proc = subprocess.run(
        [sys.executable, "-c", _SPAWN_AT_THE_LIMIT],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "[7]"


def test_large_arrays_hold_bounded_fds(strategy: str) -> None:
    """Regression (issue 18 item 4): each array over 1 MiB had a segment of its own at two
    fds (the memfd and the mmap's dup), and idle segments were trimmed only past 1 GiB:
    200 x 2 MiB zeros held 400 fds after all of them were dropped. Now a mapping holds no
    fd, and at most IDLE_SEGMENTS segments with no array in them are kept."""
    n = (2 << 20) // 8
    before = fd_count()
    arrays = [aiomp.zeros(n) for _ in range(200)]
    assert fd_count() - before <= 200 + 2, "one fd per segment: the mapping holds none"
    del arrays
    gc.collect()
    assert fd_count() - before <= _allocator.IDLE_SEGMENTS + 2
    q = aiomp.Queue()
    for i in range(1000):  # 1000 sent and dropped, up to 100 in flight at a time
        q.put_nowait(aiomp.zeros(n))
        if i >= 100:
            q.get_nowait()
    while not q.empty():
        q.get_nowait()
    del q
    gc.collect()
    # (arrays that came back after their segment was given away were received as
    # another process's: a few such segments stay mapped a while, see Registry.recent)
    assert fd_count() - before <= _allocator.IDLE_SEGMENTS + _registry.RECENT_SEGMENTS + 2


def test_names_of_unread_messages_go_with_the_root() -> None:
    """Regression (issue 9 item 3): under file_system, the segments named by messages that
    nobody read (about 1 GiB of /dev/shm there) stayed after the process had exited. When
    the root of a tree exits with no child left, nothing can read them any more."""
    script = textwrap.dedent("""
        import os
        import numpy as np
        import aiomp
        aiomp.set_sharing_strategy("file_system")
        q = aiomp.Queue()
        for i in range(40):
            q.put_nowait(np.full((1 << 20) + i, i, np.uint8))
        print(os.getpid(), len([n for n in os.listdir("/dev/shm")
                                if n.startswith(f"aiomp-{os.getpid()}-")]))
    """)
    proc = run_python("-c", script)
    pid, made = map(int, proc.stdout.split())
    assert made >= 6, "the unread messages held names while the process ran"
    left = {n for n in shm_names() if n.startswith(f"{_janitor.PREFIX}{pid}-")}
    for name in left:
        _janitor.unlink(name)  # (the leak check must see a clean /dev/shm either way)
    assert not left


@pytest.mark.parametrize("shape", [-1, (4, -1), (-1, -1), (2.5,)])
def test_empty_and_zeros_refuse_bad_shapes(shape: Any) -> None:
    """``aiomp.empty(-1)`` returned 8192 elements (numpy inferred the -1 from the buffer),
    and ``(-1, -1)`` multiplied to a positive size: they raise as numpy's own do."""
    for make in (aiomp.empty, aiomp.zeros):
        with pytest.raises((ValueError, TypeError)) as numpy_err:
            np.empty(shape)
        with pytest.raises(numpy_err.type):
            make(shape)


def test_a_ctrl_c_is_not_lost_in_a_finalizer_under_trio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: chaos's ``test_sigint_to_the_parent[trio]`` timed out once. trio raised
    the KeyboardInterrupt inside ``Registry.drop_block``, a weak reference's callback, where
    Python reports it ("Exception ignored in") and drops it: the parent never saw its
    Ctrl-C. Finalizers are now protected (see docs/decisions/0022-finalizers-and-ctrl-c.md): trio
    delivers the
    interrupt at its next checkpoint instead."""
    import trio

    protected: list[bool] = []
    retire = _registry.REGISTRY.pool.retire

    def spy(*args: Any) -> None:
        protected.append(trio.lowlevel.currently_ki_protected())
        retire(*args)

    monkeypatch.setattr(_registry.REGISTRY.pool, "retire", spy)

    async def main() -> None:
        a = aiomp.empty(1 << 20, np.uint8)
        assert not trio.lowlevel.currently_ki_protected()  # the user's code is not
        del a
        gc.collect()

    trio.run(main)
    assert protected == [True]
    assert (
        _registry.Registry.drop_block.__qualname__ == "Registry.drop_block"
    )  # tracebacks still name it
