"""A fork of a process that holds aiomp's workers owns none of them (issue 38, item 6).

Regression: after ``os.fork()`` in a process holding a Pool or the default pool, the
fork's normal exit ran aiomp's exit hooks with the parent's registry and inherited
pidfds: it SIGKILLed the parent's workers and printed ``AssertionError: can only join a
child process``. Each case runs in a fresh interpreter: its exit hooks are what is tested.
"""

from __future__ import annotations

import textwrap

import pytest

from tests._run import run_python

_FORK = """
    def fork_and_exit():
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a normal exit: the fork's exit hooks run
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
"""

# The default pool of a loop driven by hand (a notebook's kernel, a loop kept between
# calls): its workers outlive each run_until_complete.
DEFAULT_POOL = """
    import asyncio, os, sys

    import aiomp
    {fork}
    if __name__ == "__main__":
        loop = asyncio.new_event_loop()
        before = loop.run_until_complete(aiomp.run_sync(os.getpid))
        fork_and_exit()
        after = loop.run_until_complete(aiomp.run_sync(os.getpid))
        assert before == after, "the fork's exit killed the parent's worker"
        loop.close()
        print("ok")
"""

# A Pool held by a service's event loop in a thread of its own; the main thread forks.
POOL_IN_THREAD = """
    import os, sys, threading

    import anyio
    import aiomp
    {fork}

    async def serve(forked, results):
        async with aiomp.Pool(1) as pool:
            results.append(await pool.apply(os.getpid))
            await anyio.to_thread.run_sync(forked.wait)
            results.append(await pool.apply(os.getpid))

    if __name__ == "__main__":
        forked, results = threading.Event(), []
        thread = threading.Thread(target=anyio.run, args=(serve, forked, results), kwargs={kw})
        thread.start()
        while not results:  # the handshake: the pool is open and has run a task
            thread.join(0.01)
            assert thread.is_alive()
        fork_and_exit()
        forked.set()
        thread.join(60)
        assert len(results) == 2 and results[0] == results[1], results
        print("ok")
"""

BACKENDS = {
    "asyncio": "{'backend': 'asyncio'}",
    "uvloop": "{'backend': 'asyncio', 'backend_options': {'use_uvloop': True}}",
    "trio": "{'backend': 'trio'}",
}


def _check(script: str) -> None:
    proc = run_python("-c", textwrap.dedent(script), timeout=90)
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr


@pytest.mark.leaks_ok
def test_fork_exit_keeps_default_pool_workers() -> None:
    """The default pool's worker survives a fork's exit, and the fork prints nothing."""
    _check(DEFAULT_POOL.format(fork=_FORK))


@pytest.mark.leaks_ok
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fork_exit_keeps_pool_workers(backend: str) -> None:
    """A Pool's worker (its loop in another thread) survives a fork's exit, quietly."""
    _check(POOL_IN_THREAD.format(fork=_FORK, kw=BACKENDS[backend]))
