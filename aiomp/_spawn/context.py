"""spawn / start_processes / ProcessContext: start children, read their reports, join.

The spawn API over the process toolkit in ``_process`` (which owns each child's pidfd,
its signals and its termination). Each child is a :class:`_Spawned`: a
:class:`aiomp._process.child.Child` plus the parent end of its report socket, on which the
child sends ``("ok", result)`` or ``("err", text, exc)`` before its interpreter shuts
down, so a failure reaches the parent within milliseconds. Every wait on a spawn's children
(the supervisor's, ``join``'s, termination's) goes through one :class:`_Join`, which
watches all their exit fds and report sockets at once on the event loop.

Termination (on a failure, an exception in the ``async with`` body or cancellation) is
:func:`aiomp._process.child.terminate_all`: SIGTERM, ``grace_period`` seconds, SIGKILL, reap;
once started nothing breaks it, and it is bounded.
"""

from __future__ import annotations

import functools
import multiprocessing
import select
import socket
import sys
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .. import _loop
from .._child import bootstrap as _child
from .._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    exit_description,
)
from .._loop.taskhost import exit_task_group
from .._output import forwarder as _output
from .._process import child as _process
from .._process.child import (
    check_fork_safe,
    check_function,
    check_not_bootstrapping,
    check_start_method,
    prepare_forkserver,
)
from .._wire import datagram as _transport
from .._wire import pickling as _reduction

if TYPE_CHECKING:
    import asyncio


#: A child's exit fd: readable once it has exited. Its report socket: hung up, once the
#: child has exited or has ended its side after reporting an error (see
#: docs/decisions/0018-one-waiter-per-spawn.md). One-shot: a fired fd needs no epoll_ctl to go.
_EXIT_EVENTS = select.EPOLLIN | select.EPOLLONESHOT
_REPORT_EVENTS = select.EPOLLRDHUP | select.EPOLLONESHOT
_EVENTS = (_REPORT_EVENTS, _EXIT_EVENTS)  # by is_exit


def _to_watch(c: _Spawned, is_exit: bool) -> bool:
    """Whether ``c``'s exit fd (``is_exit``) or report socket still has news to give."""
    return c.exitcode is None if is_exit else (c.sock is not None and c.outcome is None)


#: A payload up to this size goes with the start (in the process's arguments): with
#: multiprocessing's own data it stays well below a pipe's 64 KiB, which a spawn start
#: writes whole before the child reads it.
INLINE_START = 16 << 10


class _Join:
    """Every wait on one spawn's children, through one epoll set on the event loop.

    While a task waits, each live child's exit fd (its pidfd, or a forkserver child's
    sentinel) and its report socket are registered in an epoll instance of this join's
    own, and that one fd is what the loop watches: a reader callback on asyncio and
    uvloop, one system task on trio. When it is readable the callback takes every ready
    fd at once, reads the report (:meth:`_Spawned.poll_message`) or reaps the child
    (``poll_exit``), then wakes each waiting task whose condition now holds, and only
    those: a spawn-4 that ends cleanly wakes its waiter once. The report socket is
    watched for its hang-up, not for data: a child that reports an error ends its side
    at once, one that succeeded closes it when it exits, so a clean child costs one
    wake-up, not two. The last waiter to leave closes the epoll set; a child forgets its
    fds here before it closes them. Nothing reached from the callback touches anyio
    (see *Nothing anyio in loop callbacks* in docs/architecture.md and
    docs/decisions/0018-one-waiter-per-spawn.md).
    """

    __slots__ = (
        "_epoll",
        "_error",
        "_fds",
        "_loop",
        "_trio_scope",
        "_waits",
        "children",
        "wakeups",
    )

    def __init__(self) -> None:
        self.children: list[_Spawned] = []
        #: (condition, wake-up): an asyncio future, or a trio.Event, made by the waiter
        self._waits: list[tuple[Callable[[], bool], Any]] = []
        self._epoll: select.epoll | None = None  # while a task waits
        self._fds: dict[int, tuple[_Spawned, bool]] = {}  # in the epoll set: (child, is_exit)
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiters' loop; None: trio
        self._trio_scope: Any = None  # trio: the system task polling the set
        self._error: Exception | None = None  # a callback's unexpected error, for the waiters
        self.wakeups = 0  # waiting tasks woken by the watches (tests count them)

    async def wait(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds; it is checked after each event on the fds.

        Cancellation leaves the children as they were; the last waiter to leave closes
        the epoll set.
        """
        if self._error is None and done():
            return
        loop = _loop.running_asyncio_loop()
        if loop is not None:
            woken: Any = loop.create_future()
        else:
            import trio

            woken = trio.Event()
        entry = (done, woken)
        self._waits.append(entry)
        try:
            self._watch(loop)
            self.check()  # a child may have been reaped meanwhile by another path
            await (woken if loop is not None else woken.wait())
        finally:
            if entry in self._waits:
                self._waits.remove(entry)
            if not self._waits:
                self._unwatch()
        if self._error is not None:
            raise RuntimeError("aiomp: watching the children failed") from self._error

    def forget(self, fd: int) -> None:
        """Stop watching ``fd`` (its owner calls this before closing it)."""
        if self._fds.pop(fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(fd)

    def _watch(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if self._epoll is not None and loop is not self._loop:
            self._unwatch()  # left from a wait on another loop
        if self._epoll is None:
            self._epoll = select.epoll()
            self._loop = loop
            try:
                if loop is not None:
                    loop.add_reader(self._epoll.fileno(), self._poll)
                else:
                    import trio

                    self._trio_scope = trio.CancelScope()
                    trio.lowlevel.spawn_system_task(
                        self._trio_poll, self._epoll, self._trio_scope, name="aiomp spawn join"
                    )
            except BaseException:
                self._epoll.close()
                self._epoll = None
                raise
        for c in self.children:
            if _to_watch(c, True):
                self._add(c.exit_fd, c, True)
                if _to_watch(c, False):
                    self._add(c.sock.fileno(), c, False)  # type: ignore[union-attr]

    def _add(self, fd: int, c: _Spawned, is_exit: bool) -> None:
        if fd not in self._fds:
            assert self._epoll is not None
            self._epoll.register(fd, _EVENTS[is_exit])
            self._fds[fd] = (c, is_exit)

    def _unwatch(self) -> None:
        ep, self._epoll = self._epoll, None
        self._fds.clear()
        if ep is None:
            return
        if self._trio_scope is not None:
            self._trio_scope.cancel()  # trio delivers it at once: the fd leaves its epoll
            self._trio_scope = None
        elif self._loop is not None:
            try:
                self._loop.remove_reader(ep.fileno())
            except Exception:  # noqa: BLE001 - the loop is closed: nothing to remove
                pass
        ep.close()

    async def _trio_poll(self, ep: select.epoll, scope: Any) -> None:
        import trio

        with scope:
            while self._epoll is ep:  # not closed before this task first ran
                try:
                    await trio.lowlevel.wait_readable(ep.fileno())
                except Exception as exc:  # noqa: BLE001 - a system task must not raise
                    self._error = exc
                    self.check()
                    return
                self._poll()

    def _poll(self) -> None:
        """The epoll set is readable: handle every ready fd (a loop callback on asyncio)."""
        ep = self._epoll
        if ep is None:
            return
        try:
            ready = ep.poll(0)
        except OSError as exc:
            self._error = exc
            ready = []
        for fd, _ in ready:
            # One-shot: the fd is disarmed now, and leaves the dict (so forgetting it
            # costs no epoll_ctl). None: forgotten while handling an earlier one.
            what = self._fds.pop(fd, None)
            if what is None:
                continue
            c, is_exit = what
            self._ready(c, is_exit)
            if _to_watch(c, is_exit):
                try:  # still to watch (another path reaped it, a spurious wake-up)
                    ep.modify(fd, _EVENTS[is_exit])
                    self._fds[fd] = what
                except OSError as exc:
                    self._error = exc
        self.check()

    def _ready(self, c: _Spawned, is_exit: bool) -> None:
        """A watched fd of ``c`` is readable (a loop callback on asyncio: no anyio here)."""
        try:
            if is_exit:
                c.poll_exit(ready=True)  # reaps it; its fds are forgotten and closed
            else:
                c.poll_message()  # one report per child: once read, nothing more to watch
        except Exception as exc:  # noqa: BLE001 - handed to the waiters, never lost
            self._error = exc

    def check(self) -> None:
        """Wake each waiter whose condition holds now."""
        for entry in list(self._waits):
            done, woken = entry
            if self._error is not None or done():
                self._waits.remove(entry)
                self.wakeups += 1
                if self._loop is not None:
                    if not woken.done():
                        woken.set_result(None)
                else:
                    woken.set()


class _Spawned(_process.Child):
    """A child :func:`spawn` started, with the socket its one report arrives on.

    Every wait on it goes through its spawn's :class:`_Join`."""

    def __init__(
        self,
        rank: int,
        process: multiprocessing.process.BaseProcess,
        start_method: str,
        output: _output.Forwarder | None,
        report: socket.socket,
        join: _Join,
    ) -> None:
        self.sock: socket.socket | None = report
        self.outcome: tuple[str, object] | None = None  # ("ok", value) / ("err", exc)
        self._join = join
        super().__init__(rank, process, start_method, output)

    def finished(self) -> bool:
        return self.outcome is not None

    def _exited(self) -> None:
        self.poll_message()  # sent before the exit: read it before the socket closes

    def _release(self) -> None:
        self._join.forget(self.exit_fd)
        self._close_sock()
        super()._release()
        # Reaped, maybe by another path than the watches (terminate_all polls): the
        # waiters must hear of it all the same.
        self._join.check()

    def _close_sock(self) -> None:
        if self.sock is not None:
            self._join.forget(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def wait_exit(self) -> None:
        """Wait until the child has exited and been reaped. Cancellation leaves it as it
        was."""
        if not self.poll_exit():
            await self._join.wait(lambda: self.exitcode is not None)

    # -- messages -------------------------------------------------------------------
    def poll_message(self) -> None:
        """Read the child's report if it is there (never waits)."""
        if self.outcome is not None or self.sock is None:
            return
        try:
            got = _transport.try_recv(self.sock)
        except _transport.Closed as exc:
            # A child that exits with our message unread makes the kernel report
            # ECONNRESET once, ahead of what it sent: its report may still be queued.
            got = None
            if isinstance(exc.__cause__, ConnectionResetError):
                try:
                    got = _transport.try_recv(self.sock)
                except (_transport.Closed, OSError):
                    pass
            if got is None:
                self._close_sock()
                return
        except OSError as exc:
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) sent a report that could not be "
                    f"received: {exc}",
                    self.rank,
                    self.pid,
                ),
            )
            return
        if got is None:
            return
        try:
            _, body, fds = _transport.decode(*got)
            msg: Any = _reduction.loads(body, fds)
        except Exception as exc:  # noqa: BLE001 - reported as the child's failure
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) returned a value that could not be "
                    f"unpickled in the parent: {exc!r}",
                    self.rank,
                    self.pid,
                ),
            )
            return
        if msg[0] == "ok":
            self.outcome = ("ok", msg[1])
        else:
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) raised:\n\n{msg[1].rstrip()}",
                    self.rank,
                    self.pid,
                ),
            )

    def failure(self) -> ProcessException | None:
        """The failure this child stands for, if any, as soon as it is known."""
        if self.outcome is not None and self.outcome[0] == "err":
            return self.outcome[1]  # type: ignore[return-value]
        if self.exitcode is not None and self.exitcode != 0:
            what, name = exit_description(self.exitcode)
            return ProcessExitedException(
                f"process {self.rank} {what}", self.rank, self.pid, self.exitcode, name
            )
        return None


class ProcessContext:
    """The processes started by :func:`spawn`: join them, read results, terminate them."""

    def __init__(self, join: _Join, grace_period: float) -> None:
        self._join = join
        self._children = join.children
        self.grace_period = grace_period
        self._failure: ProcessException | None = None
        self._results: list[object] | None = None
        self._lock = anyio.Lock()

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The ``multiprocessing`` process objects, by rank; ``exitcode`` stays readable."""
        return [c.process for c in self._children]

    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def results(self) -> list[object]:
        """Each rank's return value, once every process has exited successfully."""
        if self._results is None:
            raise RuntimeError("results are available once join() has returned True")
        return self._results

    def _first_failure(self) -> ProcessException | None:
        if self._failure is None:
            for c in self._children:
                exc = c.failure()
                if exc is not None:
                    self._failure = exc
                    break
        return self._failure

    def _finish(self) -> bool:
        if (
            self._results is None
            and all(c.exited for c in self._children)
            and self._first_failure() is None
        ):
            self._results = [c.outcome[1] if c.outcome else None for c in self._children]
        return self._results is not None

    def _settled(self) -> bool:
        return self._first_failure() is not None or all(c.exited for c in self._children)

    async def _watch_all(self) -> None:
        """Return once every child has exited, or as soon as one has failed."""
        await self._join.wait(self._settled)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for every process to exit successfully: True, or False if ``timeout`` passes.

        It returns once what they wrote before they exited has been forwarded.

        On the first failure the others are terminated (SIGTERM, the grace period, SIGKILL)
        and the failure is raised: a :class:`ProcessRaisedException` or a
        :class:`ProcessExitedException`. Calling it again raises the same failure.

        On cancellation every process is terminated and reaped before the cancellation
        goes on.
        """
        # The lock's acquire is a checkpoint too: a join cancelled there (or in an
        # already-cancelled scope) must terminate the children like one cancelled mid-wait.
        try:
            async with self._lock:
                if self._finish():
                    return True
                if self._first_failure() is None:
                    with anyio.move_on_after(timeout):
                        await self._watch_all()
                        if self._first_failure() is None:
                            # what they wrote before they exited (their own children
                            # may write on: that is forwarded until the context closes)
                            await _output.forwarded(c.output for c in self._children)
        except BaseException:
            await self.terminate()
            raise
        if self._first_failure() is not None:
            await self.terminate()
            assert self._failure is not None
            raise self._failure
        return self._finish()

    async def terminate(self, grace_period: float | None = None) -> None:
        """SIGTERM every live process, wait ``grace_period`` seconds, SIGKILL survivors, reap.

        ``grace_period=0`` SIGKILLs at once. Once started it cannot be broken (see
        :func:`terminate_all`): a cancellation or KeyboardInterrupt that arrives meanwhile
        cuts the grace period short (SIGKILL now), and is re-raised once every process has
        been reaped. Then what they wrote is forwarded, streams that their own children
        still hold get ``_output.LINGER`` seconds more to end, and the forwarders are
        closed. Bounded: about ``grace_period + KILL_TIMEOUT + LINGER`` seconds, plus the
        time to forward what they left in their socket buffers.
        """
        grace = self.grace_period if grace_period is None else grace_period
        try:
            await _process.terminate_all(self._children, grace)
        except BaseException:
            await self._close_output(now=True)
            raise
        await self._close_output()

    async def _close_output(self, now: bool = False) -> None:
        """Close the children's forwarders (see :func:`_output.close_all`): at once with
        ``now``."""
        forwarders = [c.output for c in self._children]
        await _output.close_all(forwarders, 0 if now else _output.LINGER)


# -- starting ----------------------------------------------------------------------


async def start_children(
    fn: object,
    nprocs: int,
    args: tuple[object, ...],
    start_method: str,
    daemon: bool,
    grace_period: float,
    output: _output.Output = "prefix",
) -> ProcessContext:
    check_not_bootstrapping()
    _output.check_output(output)
    nprocs = _process.count("nprocs", nprocs)
    check_start_method(start_method)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, not {type(args).__name__}")
    is_async = check_function(fn, start_method)
    if start_method == "fork":
        check_fork_safe()
    # Pickle once, before any process starts: an unpicklable argument raises here.
    payload = _reduction.dumps((None if start_method == "fork" else fn, args, is_async))
    join = _Join()
    children = join.children
    try:
        datagram, fds = payload.datagram()
        # Without fds, and small, it rides in the start itself: no send here, no receive
        # there (see docs/decisions/0017-spawn-start-up.md). A larger one is sent
        # on the report socket, so that no start blocks the loop on a full pipe.
        inline = None if fds or len(datagram) > INLINE_START else datagram
        if start_method == "forkserver":
            await prepare_forkserver()
        target_fn = fn if start_method == "fork" else None
        for rank in range(nprocs):
            c = _start_one(rank, start_method, daemon, target_fn, output, join, inline)
            children.append(c)
            if rank:
                payload.sent_again()  # one message, sent once more
            if inline is not None:
                continue
            # Sent at once, not after every start: a forked child boots in a millisecond
            # and would wait for the rest (see docs/decisions/0017-spawn-start-up.md).
            assert c.sock is not None
            try:
                await _transport.send_async(c.sock, datagram, fds)
            except _transport.Closed:
                pass  # it died already; join reports how
    except BaseException:
        try:
            await _process.terminate_all(children, 0)  # not started yet: nothing to wait for
        finally:
            await _output.close_all([c.output for c in children], 0)
        raise
    finally:
        payload.close()
    return ProcessContext(join, grace_period)


def _start_one(
    rank: int,
    start_method: str,
    daemon: bool,
    fn: object,
    output: _output.Output,
    join: _Join,
    payload: bytes | None,
) -> _Spawned:
    """Start child ``rank`` with a report socket (a datagram pair) and its forwarder;
    ``payload``, the datagram of ``(fn, args, is_async)``, goes with the start (None: the
    caller sends it on the report socket)."""
    fw = None if output == "inherit" else _output.Forwarder(rank, output)
    # One datagram each way (the payload, the report), each at most a 64 KiB body (a
    # larger one rides in a memfd): the default buffers hold it, unlike a queue's.
    ours, theirs = _transport.socketpair(large=False)
    try:
        return _process.launch(
            functools.partial(_Spawned, report=ours, join=join),
            _child.main,
            rank,
            start_method,
            daemon,
            theirs,
            extra=(fn, start_method == "spawn", payload),
            output=fw,
        )
    except BaseException:
        ours.close()
        raise


class SpawnHandle:
    """What :func:`spawn` returns: await it for a ProcessContext, or use ``async with``.

    ``async with`` supervises the children while the body runs: the first failure
    terminates the others and cancels the body, and leaving the block raises that failure.
    Leaving normally joins every process. Leaving by an exception or a cancellation
    terminates them (SIGTERM, the grace period, SIGKILL), reaps them and re-raises.
    Either way their output is then forwarded to its end, waiting at most
    ``_output.LINGER`` seconds for streams their own children still hold.
    """

    def __init__(
        self,
        fn: object,
        nprocs: int,
        args: tuple[object, ...],
        start_method: str,
        daemon: bool,
        grace_period: float,
        output: _output.Output,
    ) -> None:
        self._params = (fn, nprocs, args, start_method, daemon, grace_period, output)
        self._ctx: ProcessContext | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._task: object = None  # the asyncio task that entered the block

    def __await__(self) -> Generator[Any, None, ProcessContext]:
        return self._start().__await__()

    async def _start(self) -> ProcessContext:
        # The same frame depth as __aenter__, so that a warning's stacklevel points at the
        # caller's line for `await spawn(...)` as it does for `async with spawn(...)`.
        return await start_children(*self._params)

    async def __aenter__(self) -> ProcessContext:
        ctx = self._ctx = await start_children(*self._params)
        tg = self._tg = anyio.create_task_group()
        await tg.__aenter__()
        tg.start_soon(self._supervise, ctx, tg.cancel_scope)
        self._task = _asyncio_task()
        return ctx

    @staticmethod
    async def _supervise(ctx: ProcessContext, body: anyio.CancelScope) -> None:
        await ctx._watch_all()
        if ctx._first_failure() is not None:
            await ctx.terminate()
            body.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        ctx, tg = self._ctx, self._tg
        assert ctx is not None and tg is not None
        if self._task is not _asyncio_task():
            # Its task group cannot be left here: stop everything it runs, and say why.
            tg.cancel_scope.cancel()
            await ctx.terminate()
            raise RuntimeError(
                "the `async with aiomp.spawn(...)` block was left by another task than the "
                "one that entered it (a pytest-asyncio yield fixture does this); its "
                "children were terminated. spawn's block must be left where it was entered, "
                "since a child's failure cancels it: spawn inside the test itself, or use "
                "anyio's pytest plugin (an aiomp.Pool may be held by such a fixture)"
            ) from exc
        swallowed = clean = False
        try:
            swallowed = await exit_task_group(tg, exc)
            if exc is None and not ctx._finish():  # (all done: no join, lock, or scope)
                await ctx.join()
            clean = exc is None
        finally:
            # Any way out but a clean join (the body raised, a child failed, or we were
            # cancelled while waiting for the children) terminates and reaps them.
            try:
                if not clean or ctx._failure is not None:
                    await ctx.terminate()
            finally:
                # Their output to its end: bounded, even if their children hold it.
                await ctx._close_output()
        if ctx._failure is not None and (exc is None or swallowed):
            raise ctx._failure
        return False


def _asyncio_task() -> object:
    """The running asyncio task (uvloop's included), or None on trio."""
    loop = _loop.running_asyncio_loop()
    return None if loop is None else sys.modules["asyncio"].current_task(loop)


def spawn(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    *,
    args: tuple[object, ...] = (),
    start_method: str = "spawn",
    daemon: bool = False,
    grace_period: float = 5.0,
    output: _output.Output = "prefix",
) -> SpawnHandle:
    """Start ``nprocs`` processes running ``fn(i, *args)``; ``i`` is the rank.

    ``await aiomp.spawn(...)`` returns a started :class:`ProcessContext`;
    ``async with aiomp.spawn(...) as ctx:`` supervises them (see :class:`SpawnHandle`).
    ``fn`` may be an ``async def`` function: the child runs it on a fresh event loop
    (uvloop when installed). Numpy arrays in ``args`` travel through shared memory.

    Raises ``ValueError`` for an unknown ``start_method`` or ``nprocs < 1``, and
    ``TypeError`` / ``pickle.PicklingError`` for an ``fn`` children could not run, before
    any process starts. Starting never blocks the event loop.

    ``output``: ``"prefix"`` (the default) forwards each line a child writes to its
    fd 1 or 2 to this process's ``sys.stdout`` / ``sys.stderr`` as ``[rank N] line``,
    read on the event loop (see ``aiomp._output.forwarder``); ``"inherit"`` leaves the children
    the raw fds; a callable ``(rank, stream, line)`` receives each line instead.
    """
    return SpawnHandle(fn, nprocs, args, start_method, daemon, grace_period, output)


def start_processes(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    *,
    args: tuple[object, ...] = (),
    start_method: str = "spawn",
    daemon: bool = False,
    grace_period: float = 5.0,
    output: _output.Output = "prefix",
) -> SpawnHandle:
    """The torch-compatible name of :func:`spawn`."""
    return SpawnHandle(fn, nprocs, args, start_method, daemon, grace_period, output)


for _obj in (ProcessContext, spawn, start_processes):
    _obj.__module__ = "aiomp"  # printed and pickled under the public name
