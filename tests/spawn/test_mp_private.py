"""The private names of multiprocessing and atexit that aiomp uses, all read through
``aiomp._process.mp_private``, checked against the running Python: each test fails
loudly when Python moves one, where a caller would otherwise fall back in silence."""

from __future__ import annotations

import atexit
import inspect
import multiprocessing
import multiprocessing.spawn
import os
import textwrap
from multiprocessing import forkserver

from aiomp._process import mp_private
from tests._run import run_python


def test_a_spawn_child_marks_itself_inheriting_while_it_prepares() -> None:
    assert "_inheriting" in inspect.getsource(multiprocessing.spawn._main)
    assert mp_private.inheriting() is False  # the parent: never preparing


def test_a_process_keeps_its_status_in_its_popen() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=int)
    proc.start()
    try:
        proc.join(60)
        assert mp_private.popen_returncode(proc) == 0
        mp_private.set_popen_returncode(proc, 3)
        assert proc.exitcode == 3  # what Popen.poll finds
    finally:
        proc.kill()
        proc.join()
        proc.close()


def test_a_forgotten_child_is_reaped_with_its_peak_rss_by_its_owner_alone() -> None:
    """Issue 30: multiprocessing's next start does not reap a child taken off its list,
    so its owner gets its rusage (peak RSS) with its status."""
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=os._exit, args=(7,))
    proc.start()
    mp_private.forget_child(proc)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # it has exited
        other = ctx.Process(target=int)
        other.start()  # polls the list of children: not ours any more
        other.join(60)
        code, peak = mp_private.reap(proc)
        assert code == 7 and proc.exitcode == 7
        assert peak is not None and peak > 1 << 20
        assert mp_private.reap(proc) == (7, None)
    finally:
        proc.join(60)
        proc.close()


def test_a_child_reaped_by_someone_else_reads_as_exited_with_its_status_lost() -> None:
    """Issue 39 bug 2: a program that reaps one of our children itself (torch's tests
    kill a DataLoader worker and wait for it with psutil) leaves no status to read: the
    child reads as exited (LOST_STATUS), not as running forever."""
    proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(7,))
    proc.start()
    mp_private.forget_child(proc)
    try:
        os.waitpid(proc.pid, 0)  # the program reaps it
        assert mp_private.reap(proc) == (mp_private.LOST_STATUS, None)
        assert proc.exitcode == mp_private.LOST_STATUS
    finally:
        proc.close()


def test_a_reaped_process_closes_its_sentinel_and_keeps_its_status() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=int)
    proc.start()
    try:
        proc.join(60)
        sentinel = proc.sentinel
        mp_private.close_sentinel(proc)
        assert not os.path.exists(f"/proc/self/fd/{sentinel}")
        assert proc.exitcode == 0
    finally:
        proc.close()


def test_a_pool_retiring_workers_holds_no_fd_per_worker_until_collected() -> None:
    """A worker retired after each task: the parent's fds stay level with the collector
    off, so no fd waits for a reference cycle to be collected."""
    out = run_python("-c", _RETIRING, timeout=120)
    assert int(out.stdout.split("gained:")[1]) < 8, out.stdout


_RETIRING = textwrap.dedent("""
    import gc, os, anyio, aiomp

    async def main():
        async with aiomp.Pool(1, maxtasksperchild=1, start_method="fork") as pool:
            await pool.apply(os.getpid)
            gc.disable()
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(40):
                await pool.apply(os.getpid)
            print("gained:", len(os.listdir("/proc/self/fd")) - before)

    if __name__ == "__main__":
        anyio.run(main)
""")


def test_the_fork_server_keeps_its_pid_preloads_and_alive_fd() -> None:
    server = forkserver._forkserver  # type: ignore[attr-defined]
    assert hasattr(server, "_forkserver_pid")
    assert hasattr(server, "_forkserver_alive_fd")  # taken only in children
    assert isinstance(server._preload_modules, list)
    pid = mp_private.forkserver_pid()
    assert pid is None or isinstance(pid, int)
    assert mp_private.forkserver_preload() == server._preload_modules
    assert callable(forkserver.read_signed)  # type: ignore[attr-defined]


def test_atexit_can_run_its_functions_now() -> None:
    assert callable(atexit._run_exitfuncs)


_DEFERRED_TRACKER = textwrap.dedent(
    """
    import multiprocessing, os
    from multiprocessing import resource_tracker, shared_memory
    from aiomp._process import mp_private

    if __name__ == "__main__":
        tracker = resource_tracker._resource_tracker
        mp_private.defer_resource_tracker()
        assert tracker._fd is not None and tracker._pid is None
        name = f"aiomp-test-tracker-{os.getpid()}"
        # made and never unlinked: the tracker unlinks it when the parent ends
        new = dict(name=name, create=True, size=4096)
        child = multiprocessing.get_context("spawn").Process(
            target=shared_memory.SharedMemory, kwargs=new
        )
        child.start()  # given the deferred pipe as its tracker's fd
        child.join(60)
        assert child.exitcode == 0 and tracker._pid is None
        mp_private.start_deferred_tracker()
        assert tracker._pid is not None and os.path.exists(f"/proc/{tracker._pid}")
        mp_private.start_deferred_tracker()  # nothing deferred any more: nothing done
        print(name)
    """
)


def test_the_resource_tracker_can_start_after_the_first_spawn_child() -> None:
    """Issue 29, the first call (decision 0046): multiprocessing's tracker, deferred past
    the first child's start, still gets what that child registered, and cleans it up."""
    out = run_python("-c", _DEFERRED_TRACKER)
    name = out.stdout.split()[-1]
    assert "leaked shared_memory" in out.stderr, out.stderr
    assert not os.path.exists(f"/dev/shm/{name}")
