"""aiomp.DataLoader's start method (issue 39, "Speed from the first batch"; bugs 3 and 11).

With no start method given, a loader forks its workers where that is safe (no other
thread running, no CUDA initialised), as torch's default on Linux does, and starts them
from the fork server otherwise; a fork never warns of the sync loader's own waiting
thread. Each case runs as a user's program does, in a fresh interpreter (a test process
may have threads of its own: pytest-xdist's), and a worker tells whether it was forked
(:data:`tests.children.data_start.MARK`). Every warning fails the script.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._run import REPO, run_python

PROLOGUE = """
import threading, warnings
warnings.simplefilter("error")
# (Python >= 3.12 on any fork beside a second thread: the sync caller, waiting; decision 0080)
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
import aiomp
from tests.children import data_start
data_start.MARK = 1
def forked(loader):
    return {int(x) for batch in loader for x in batch} == {1}
"""


def run(body: str) -> str:
    return run_python("-c", PROLOGUE + body, timeout=120).stdout


def test_a_sync_loader_forks_by_default_and_warns_nothing() -> None:
    """Issue 39 bug 11: with fork, the sync form warned at every start that "MainThread"
    (the caller's thread, waiting for the start) was another running thread."""
    out = run(
        "with aiomp.DataLoader(data_start.Marked(8), 2) as loader:\n"
        "    print(forked(loader), forked(loader))\n"
        "print(forked(aiomp.DataLoader(data_start.Marked(4), 2, start_method='fork')))\n"
    )
    assert out.split() == ["True", "True", "True"]


def test_an_async_loader_forks_by_default() -> None:
    out = run(
        "import asyncio\n"
        "async def main():\n"
        "    async with aiomp.DataLoader(data_start.Marked(8), 2) as loader:\n"
        "        print({int(x) async for b in loader for x in b} == {1})\n"
        "asyncio.run(main())\n"
    )
    assert out.split() == ["True"]


def test_with_another_thread_running_the_default_does_not_fork() -> None:
    """A thread of the user's runs: the default starts the workers from the fork server
    (nothing to warn of); an explicit fork still warns, naming the thread (R14)."""
    out = run(
        "stop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait, name='Sleeper')\n"
        "t.start()\n"
        "with aiomp.DataLoader(data_start.Marked(8), 2) as loader:\n"
        "    print(forked(loader))\n"
        "warnings.simplefilter('default')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    with aiomp.DataLoader(data_start.Marked(4), 2, start_method='fork') as loader:\n"
        "        print(forked(loader))\n"
        "print(any('Sleeper' in str(w.message) for w in seen))\n"
        "stop.set()\n"
        "t.join()\n"
    )
    assert out.split() == ["False", "True", "True"]


def test_cuda_initialised_the_default_does_not_fork() -> None:
    pytest.importorskip("torch")
    out = run(
        "import torch\n"
        "torch.cuda.is_initialized = lambda: True  # as after any CUDA call\n"
        "with aiomp.DataLoader(data_start.Marked(8), 2) as loader:\n"
        "    print(forked(loader))\n"
    )
    assert out.split() == ["False"]


def test_a_convolution_after_fork() -> None:
    """Issue 39 bug 3: ``start_method="fork"`` hung when the parent had run a torch
    convolution and the dataset runs one (torch's TestConvAfterFork): the forked worker
    inherits the parent's OpenMP thread pool state. Workers run torch with one thread,
    as torch's do."""
    pytest.importorskip("torch")
    out = run(
        "import torch\n"
        "dataset = data_start.Conv(4)\n"
        "dataset[0]  # the parent runs a convolution first\n"
        "for method in ('fork', None):\n"
        "    with aiomp.DataLoader(dataset, 2, start_method=method, timeout=60) as loader:\n"
        "        print([tuple(b.shape) for b in loader])\n"
        "        print(loader.pool is not None)\n"
    )
    assert out.split("\n")[:4] == ["[(2, 1, 1, 23999, 1), (2, 1, 1, 23999, 1)]", "True"] * 2


def test_an_unguarded_script_with_a_thread_gets_the_guard_error(tmp_path: Path) -> None:
    """The default's fallback is the fork server; a script without the ``__main__``
    guard that runs a thread (torch scripts often have no guard: fork is torch's
    default) must get aiomp's guard error, as under spawn. Before the start checks ran
    ahead of the server's start, a process re-running the script (a worker, or the
    server preloading it) tried to start a server of its own: the workers died with
    multiprocessing's bootstrapping error, not a word of the guard (once, it hung)."""
    script = tmp_path / "train.py"
    body = (
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait, name='Sleeper').start()\n"
        "try:\n"
        "    print(forked(aiomp.DataLoader(data_start.Marked(4), 2)))\n"
        "except Exception as exc:\n"
        "    if __name__ != '__main__':\n"
        "        raise  # as a script that does not catch it\n"
        "    print(type(exc).__name__, exc)\n"
        "finally:\n"
        "    if __name__ == '__main__':\n"
        "        stop.set()\n"
    )
    script.write_text(PROLOGUE + body)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_python(str(script), timeout=120, env=env)
    assert "protect the entry point" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
