"""Shared memory names of a SIGKILLed process tree, swept by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from aiomp import _lifecycle
from aiomp._memory import janitor as _janitor
from tests._run import run_python
from tests.memory._shm import REPO, TIMEOUT, shm_names

_TREE = textwrap.dedent("""
    import os, sys
    import anyio, numpy as np
    import aiomp
    from tests.children import memory as _funcs_shm

    async def main():
        aiomp.set_sharing_strategy("file_system")
        q, ready = aiomp.Queue(), aiomp.Queue()
        await aiomp.spawn(_funcs_shm.put_unread_and_wait, 1, args=(q, ready, "file_system"))
        child = await ready.get()
        await q.put(np.full(200_000, 9.0))  # the parent's own, never read either
        print(os.getpid(), child, flush=True)
        await anyio.Event().wait()  # until SIGKILLed

    anyio.run(main)
""")


def _wait_gone(pid: int, timeout: float = TIMEOUT) -> None:
    """Wait for a process that is not our child to vanish (polling the kernel's view)."""
    deadline = time.monotonic() + timeout
    while _lifecycle.pid_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived its parent"
        time.sleep(0.01)  # handshake-free: polling the kernel's view of a non-child


def _killed_tree() -> set[str]:
    """Start ``_TREE``, SIGKILL its parent, and return the names it made that are still
    there once its child has died too."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE], cwd=REPO, text=True, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        parent, child = map(int, proc.stdout.readline().split())
        names = {
            n
            for n in shm_names()
            if n.startswith((f"{_janitor.PREFIX}{parent}-", f"{_janitor.PREFIX}{child}-"))
        }
        assert {n.split("-")[1] for n in names} == {str(parent), str(child)}
        os.kill(parent, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        _wait_gone(child)  # its parent-death signal
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return names & shm_names()


#: The next program's first start, of each kind.
_NEXT_START = {
    "segment": "aiomp.set_sharing_strategy('file_system'); aiomp.zeros(1)",
    "queue": "aiomp.Queue()",
    "spawn": "async with aiomp.spawn(funcs.return_none, 1):\n        pass",
    "pool": "async with aiomp.Pool(1) as pool:\n        await pool.apply(os.getpid)",
}
_NEXT_ASYNC = textwrap.dedent("""
    import os
    import anyio
    import aiomp
    from tests.children import common as funcs

    async def main():
        {}

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("start", list(_NEXT_START))
def test_a_sigkilled_tree_is_swept_by_the_next_start(start: str) -> None:
    """Regression (issue 9 item 1c): after a parent was SIGKILLed, the next aiomp start
    cleaned 0 names, and so did janitor(): names named by unread messages were kept for
    60 s. Nothing is in flight once no live process can hold the queue: the tree is gone.

    Regression (issue 38, item 9): only the next tree's first shared segment swept; a
    program that only spawns, pools or makes a queue never removed them. Any aiomp start
    sweeps now.

    Any aiomp process's first start sweeps dead trees, a concurrent test's child
    included: a tree swept before this test's own next start is made again (three tries).
    """
    for _ in range(3):
        names = _killed_tree()
        if names:
            break
    assert names, "the dead tree's names were swept by others three times in a row"
    code = _NEXT_START[start]
    script = _NEXT_ASYNC.format(code) if "async" in code else "import aiomp\n" + code
    assert run_python("-c", script).stderr == ""
    left = names & shm_names()
    _janitor.janitor()
    assert not left, f"the next program's first {start} swept the dead tree's names"


_TREE_OF_A_CHILD = textwrap.dedent("""
    import os, signal
    import anyio
    import aiomp
    from tests.children import memory as _funcs_shm

    async def main():
        aiomp.set_sharing_strategy("file_system")
        ready = aiomp.Queue()  # no array made here: this process makes no segment itself
        with anyio.fail_after(20):
            ctx = await aiomp.spawn(_funcs_shm.shm_hold_named_then_block, 1, args=(ready, 1000))
            names = await ready.get()
            from aiomp._memory.segment import H_TREE
            for name in names:
                with open(f"/dev/shm/{name}", "rb") as f:
                    f.seek(H_TREE)
                    print(os.getpid(), int.from_bytes(f.read(4), "little"), flush=True)
            os.kill(ctx.pids()[0], signal.SIGKILL)
            try:
                await ctx.join()
            except aiomp.ProcessExitedException:
                pass
        print("left", *[n for n in names if os.path.exists(f"/dev/shm/{n}")], flush=True)

    anyio.run(main)
""")


def test_a_parent_that_makes_no_segment_names_the_tree_and_sweeps() -> None:
    """A process launched with the ``AIOMP_TREE`` of another live tree in its
    environment (this one's) starts a child before it makes any array. The names the child
    makes record the child's own tree, rooted at that process (a stale tree would keep
    them from being swept once their tree is gone: SIGKILL or Ctrl-C to its root).
    And once the child is SIGKILLed, reaping it sweeps its names (R5), though the parent
    never made a segment itself."""
    env = dict(os.environ, AIOMP_TREE=f"{os.getpid()}:{_lifecycle.start_time(os.getpid())}")
    *lines, left = run_python("-c", _TREE_OF_A_CHILD, env=env).stdout.splitlines()
    assert left == "left", "reaping the SIGKILLed child swept its names"
    assert lines  # per name: the parent's pid, then the tree root its header records
    for line in lines:
        parent, root = line.split()
        assert root == parent, "the child's name records the parent as its tree's root"
