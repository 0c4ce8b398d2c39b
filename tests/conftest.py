"""Shared fixtures: every async test runs on asyncio, uvloop and trio; every test is
checked for leaked children, file descriptors and ``/dev/shm`` names.

The checks are per process (this pid's children and fds, the shm names of this pid's
tree), so they hold under pytest-xdist, whose workers are separate processes.

Async tests run the way users run their programs, not under anyio's test runner:
``asyncio`` is a plain ``asyncio.run`` loop (what uvicorn and FastAPI run), ``uvloop``
is the same runner with uvloop's loop, ``trio`` is ``trio.run``. anyio's runner marks
its loop for anyio in a way a plain loop does not, so code that wrongly reaches anyio
from a loop callback passes under it and fails for users.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests._gate import Gate

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def run_plain(backend: object, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """Run ``fn(**kwargs)`` on a fresh loop of ``backend``, as a user's program would."""
    name, options = backend if isinstance(backend, tuple) else (backend, {})
    if name == "trio":
        import trio

        return trio.run(functools.partial(fn, **kwargs))
    factory = None
    if options.get("use_uvloop"):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(fn(**kwargs))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Async tests run on a plain loop (see the module docstring), not anyio's runner."""
    backend = pyfuncitem.funcargs.get("anyio_backend")
    if backend is None or not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    # The test's own arguments: funcargs also holds the fixtures it only uses indirectly.
    names = inspect.signature(pyfuncitem.obj).parameters
    args = pyfuncitem.funcargs
    run_plain(backend, pyfuncitem.obj, **{n: args[n] for n in names if n in args})
    return True


#: Tests that must share one pytest-xdist worker (``-n 2 --dist loadgroup``): the Ray tests
#: share one local Ray cluster (the contract suite over Ray actors, before them, its own
#: local Ray instance: one ``ray.init`` in all, not one per worker); mypy and ruff share
#: their caches.
_XDIST_GROUPS = {
    "tests/contract/test_worker_kinds_ray.py": "ray",
    "tests/ray/": "ray",
    "tests/meta/test_lint.py": "tools",
    "tests/meta/test_typing.py": "tools",
}


def pytest_configure(config: pytest.Config) -> None:
    # The chaos suite's random seed is part of its test ids: chosen once, here, so that
    # every pytest-xdist worker (started after this, with this environment) collects the
    # same ids.
    os.environ.setdefault("AIOMP_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 32)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.nodeid.split("::")[0]
        for prefix, group in _XDIST_GROUPS.items():
            if path.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
                _group_id(config, item, group)


def _group_id(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """The ``@group`` suffix of the test id in a loadgroup worker, which the scheduler groups
    by: pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9 no longer reads (the id
    is ``item._id``), so the groups' tests were spread over the workers and each worker
    started its own Ray instances."""
    if not config.getoption("loadgroup", False) or "@" in item.nodeid or not hasattr(item, "_id"):
        return
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    """This process's sharing strategy for one test (each of them); the default after."""
    import aiomp

    before = aiomp.get_sharing_strategy()
    aiomp.set_sharing_strategy(request.param)
    try:
        yield request.param
    finally:
        aiomp.set_sharing_strategy(before)


@pytest.fixture
def file_system() -> Iterator[None]:
    """The ``file_system`` sharing strategy in this process, for one test."""
    import aiomp

    before = aiomp.get_sharing_strategy()
    aiomp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        aiomp.set_sharing_strategy(before)


@pytest.fixture
def gate() -> Iterator[Gate]:
    """A :class:`~tests._gate.Gate` for children to report to and wait on."""
    g = Gate()
    yield g
    g.close()


def child_pids() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


def open_fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _tree_root(name: str) -> int:
    """The pid of the process tree that made ``/dev/shm/<name>`` (0: unknown), from the
    header page aiomp writes (``segment.H_CREATOR``: creator pid and start, then the tree's)."""
    try:
        with open(f"/dev/shm/{name}", "rb") as f:
            header = f.read(64)
    except OSError:
        return 0
    return int.from_bytes(header[24:28], "little") if len(header) >= 28 else 0


def shm_names() -> set[str]:
    """aiomp names made by this test process's tree: by it, or by processes that are gone
    (its children) and named this process as their tree's root. Names of other process
    trees (a concurrent test run on the same machine) are not ours to judge."""
    names = set()
    me = os.getpid()
    for n in os.listdir("/dev/shm"):
        if not n.startswith("aiomp"):
            continue
        try:
            pid = int(n.split("-")[1])
        except (IndexError, ValueError):
            names.add(n)
            continue
        if pid == me or (not os.path.exists(f"/proc/{pid}") and _tree_root(n) in (me, 0)):
            names.add(n)
    return names


# Helpers that outlive tests by design (multiprocessing's resource tracker, the fork
# server) are started once, before any test, so they are not counted as leaks.
_PERSISTENT: set[int] = set()


@pytest.fixture(scope="session", autouse=True)
def _warm_up() -> None:
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    forkserver.ensure_running()
    # aiomp._memory.fdlimit keeps one fd in reserve for its fd-limit error path, for the process's
    # life: opened here, before any test counts fds.
    import aiomp._memory.blocks  # noqa: F401

    # aiomp's keeper (one per process, started with its first child) holds a socket of
    # this process for the process's life.
    from aiomp._process import groups as _groups

    _groups.start_keeper()
    _PERSISTENT.update(child_pids())
    # The first uvloop loop of a process opens a pipe that lives as long as the process.
    import anyio

    async def _noop() -> None:
        pass

    anyio.run(_noop, backend_options={"use_uvloop": True})
    # What collection imported (torch, Ray, every test module) lives for the session: out
    # of the collector's reach, each test's gc.collect() scans only what tests made since
    # (a full collection of that heap took 0.1-0.3 s, twice per test).
    gc.collect()
    gc.freeze()


def _settle() -> None:
    multiprocessing.active_children()  # reaps finished multiprocessing children
    gc.collect()
    shm = sys.modules.get("aiomp._memory.blocks")
    if shm is not None:
        shm.purge_pool()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> object:
    _settle()
    fds_before = open_fds()
    shm_before = shm_names()
    yield
    if request.node.get_closest_marker("leaks_ok"):
        return
    deadline = time.monotonic() + 5
    while True:
        _settle()
        children = child_pids() - _PERSISTENT
        new_fds = {fd: t for fd, t in open_fds().items() if fds_before.get(fd) != t}
        if request.node.get_closest_marker("ray_fds_ok"):
            # Ray's driver opens (and keeps) gRPC sockets to each actor's worker, and its
            # event fds, as it goes, and a log file each time it connects (a test that
            # shuts the driver down connects it again): not ours. Other files, pipes and
            # memfds are still checked.
            new_fds = {
                fd: t
                for fd, t in new_fds.items()
                if not t.startswith(("socket:", "anon_inode:")) and "/python-core-driver-" not in t
            }
        new_shm = shm_names() - shm_before
        if not (children or new_fds or new_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # handshake-free: polling the kernel's view of our resources
    assert not children, f"test left live child processes: {sorted(children)}"
    assert not new_fds, f"test leaked file descriptors: {new_fds}"
    assert not new_shm, f"test left shared-memory names: {sorted(new_shm)}"
