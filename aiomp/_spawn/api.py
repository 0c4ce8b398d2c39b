"""aiomp.spawn (and its torch name, start_processes): start children, supervise them.

:func:`spawn` returns a :class:`SpawnHandle`: awaited, it starts the children and
returns their :class:`~aiomp._spawn.context.ProcessContext`; as ``async with``, it also
supervises them while the body runs. Owns the block's task group. Starting checks
everything first (nothing starts for a call that would fail), pickles the payload once,
and never blocks the event loop. On cancellation or failure while starting, the children
started so far are SIGKILLed and reaped, and their forwarders closed, before it goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from .. import _loop
from .._child import seeds as _seeds
from .._child.bootstrap import check_not_bootstrapping
from .._loop.fdset import FdSet
from .._loop.taskhost import exit_task_group
from .._output import forwarder as _output
from .._output.lines import Output, check_output
from .._process import placement as _placement
from .._process.checks import check_fork_safe, check_function, check_start_method, count
from .._process.launch import launch, prepare_forkserver
from .._process.terminate import terminate_all
from .._wire import byvalue
from .._wire import datagram as _transport
from . import child_main
from .context import ProcessContext
from .spawned import Spawned
from .unawaited import FIX, call_site, warn_never_used

#: A payload up to this size goes with the start (in the process's arguments): with
#: multiprocessing's own data it stays well below a pipe's 64 KiB, which a spawn start
#: writes whole before the child reads it.
INLINE_START = 16 << 10


async def start_children(
    fn: object,
    nprocs: int,
    args: tuple[object, ...],
    start_method: str,
    daemon: bool,
    grace_period: float,
    output: Output = "prefix",
    env: _placement.Env = None,
    rendezvous: bool = False,
) -> ProcessContext:
    check_not_bootstrapping()  # before any check: a refusal is what the parent must see
    check_output(output)
    if isinstance(nprocs, tuple):
        raise TypeError(
            "nprocs must be an int, not a tuple: aiomp.spawn and aiomp.start_processes take "
            "args= as a keyword (torch's start_processes takes args second)"
        )
    nprocs = count("nprocs", nprocs)
    envs = _rank_envs(env, rendezvous, nprocs)
    check_start_method(start_method)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, not {type(args).__name__}")
    is_async = check_function(fn, start_method)
    if start_method == "fork":
        check_fork_safe()
    # Pickle once, before any process starts: an unpicklable argument raises here. What a
    # child cannot import by name (a lambda, a notebook's function) travels by value.
    payload = byvalue.dumps((None if start_method == "fork" else fn, args, is_async))
    exits = FdSet()
    children: list[Spawned] = []
    try:
        datagram, fds = payload.datagram()
        # Without fds, and small, it rides in the start itself: no send here, no receive
        # there. A larger one is sent on the report socket, so that no start blocks the
        # loop on a full pipe.
        inline = None if fds or len(datagram) > INLINE_START else datagram
        if start_method == "forkserver":
            await prepare_forkserver()
        target_fn = fn if start_method == "fork" else None
        # A fork copies the parent's generators: each rank gets its own seeds.
        base = None if start_method == "spawn" else _seeds.base_seed()
        for rank in range(nprocs):
            who = (rank, nprocs, None if envs is None else envs[rank])
            seed = None if base is None else _seeds.child_seed(base, rank)
            c = _start_one(rank, start_method, daemon, target_fn, output, exits, inline, who, seed)
            children.append(c)
            if rank:
                payload.sent_again()  # one message, sent once more
            if inline is not None:
                continue
            # Sent at once, not after every start: a forked child boots in a millisecond
            # and would wait for the rest.
            assert c.sock is not None
            try:
                await _transport.send_async(c.sock, datagram, fds)
            except _transport.Closed:
                pass  # it died already; join reports how
    except BaseException:
        try:
            await terminate_all(children, 0)  # not started yet: nothing to wait for
        finally:
            await _output.close_all([c.output for c in children], 0)
        raise
    finally:
        payload.close()
    return ProcessContext(children, exits, grace_period)


def _rank_envs(env: _placement.Env, rendezvous: bool, n: int) -> list[dict[str, str]] | None:
    """Each rank's env: torchrun's variables (``rendezvous``), then ``env=`` over them."""
    envs = _placement.slot_envs(env, n)
    if not rendezvous:
        return envs
    ranks = _placement.rendezvous(n)
    return ranks if envs is None else [{**r, **e} for r, e in zip(ranks, envs, strict=True)]


def _start_one(
    rank: int,
    start_method: str,
    daemon: bool,
    fn: object,
    output: Output,
    exits: FdSet,
    payload: bytes | None,
    who: tuple[int, int, dict[str, str] | None],
    seed: int | None = None,
) -> Spawned:
    """Start child ``rank`` with a report socket (a datagram pair) and its forwarder;
    ``payload``, the datagram of ``(fn, args, is_async)``, goes with the start (None: the
    caller sends it on the report socket). ``who``: its rank, nprocs and env; ``seed``, the
    child's global generators' seed (None: a spawn child seeds itself)."""
    fw = None if output == "inherit" else _output.Forwarder(rank, output)
    # One datagram each way (the payload, the report), each at most a 64 KiB body (a
    # larger one rides in a memfd): the default buffers hold it, unlike a queue's.
    ours, theirs = _transport.socketpair(large=False)
    try:
        return launch(
            functools.partial(Spawned, report=ours, exits=exits),
            child_main.main,
            rank,
            start_method,
            daemon,
            theirs,
            extra=(fn, start_method == "spawn", payload),
            output=fw,
            who=who[:2],
            env=who[2],
            seed=seed,
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
        self, start: Callable[[], Awaitable[ProcessContext]], what: str = "aiomp.spawn(...)"
    ) -> None:
        #: :func:`start_children` with spawn's arguments (a partial: no frame of its own).
        self._start_children = start
        self._ctx: ProcessContext | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._task: object = None  # the asyncio task that entered the block
        self._what = what
        #: Where the call was made, until it is awaited or entered (see __del__).
        self._site: tuple[str, int, str] | None = call_site(2)

    def __repr__(self) -> str:
        # asyncio.run(aiomp.spawn(...)) says "a coroutine was expected, got <this>".
        return f"<{self._what}: await it, or enter it with `async with`, {FIX}>"

    def __del__(self) -> None:
        if self._site is not None:
            warn_never_used(
                self._what, "`await aiomp.spawn(...)` or `async with aiomp.spawn(...)`", self._site
            )

    def __await__(self) -> Generator[Any, None, ProcessContext]:
        self._site = None
        return self._start().__await__()

    async def _start(self) -> ProcessContext:
        # The same frame depth as __aenter__, so that a warning's stacklevel points at the
        # caller's line for `await spawn(...)` as it does for `async with spawn(...)`.
        return await self._start_children()

    async def __aenter__(self) -> ProcessContext:
        self._site = None
        ctx = self._ctx = await self._start_children()
        tg = self._tg = anyio.create_task_group()
        await tg.__aenter__()
        tg.start_soon(self._supervise, ctx, tg.cancel_scope)
        self._task = _entering_task()
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
        if self._task is not _entering_task():
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


def _entering_task() -> object:
    """The running asyncio task (uvloop's included), or None on another loop, where a
    task group cannot be left by another task than the one that entered it anyway."""
    loop = _loop.running_asyncio_loop()
    if loop is None:
        return None
    import asyncio

    return asyncio.current_task(loop)


def spawn(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    *,
    args: tuple[object, ...] = (),
    start_method: str = "spawn",
    daemon: bool = False,
    grace_period: float = 5.0,
    output: Output = "prefix",
    env: _placement.Env = None,
    rendezvous: bool = False,
) -> SpawnHandle:
    """Start ``nprocs`` processes running ``fn(i, *args)``; ``i`` is the rank.

    ``await aiomp.spawn(...)`` returns a started :class:`ProcessContext`;
    ``async with aiomp.spawn(...) as ctx:`` supervises them (see :class:`SpawnHandle`).
    A handle neither awaited nor entered starts nothing, and warns (``RuntimeWarning``)
    when collected, as an unawaited coroutine does. Children that a fork starts get
    fresh seeds for ``random``, numpy and torch (``aiomp._child.seeds``).
    ``fn`` may be an ``async def`` function: the child runs it on a fresh event loop
    (uvloop when installed). Numpy arrays in ``args`` travel through shared memory.

    Raises ``ValueError`` for an unknown ``start_method`` or ``nprocs < 1``, and
    ``TypeError`` / ``pickle.PicklingError`` for an ``fn`` or ``args`` that cannot be
    pickled even by value, before any process starts. A lambda, a closure or a function
    typed into a notebook travels by value (cloudpickle). Starting never blocks the event loop.

    ``output``: ``"prefix"`` (the default) forwards each line a child writes to its
    fd 1 or 2 to this process's ``sys.stdout`` / ``sys.stderr`` as ``[rank N] line``,
    read on the event loop (see ``aiomp._output.forwarder``); ``"inherit"`` leaves the children
    the raw fds; a callable ``(rank, stream, line)`` receives each line instead.

    ``env``: a dict of str to str merged over each child's environment, or a callable
    ``env(rank)`` giving one: in place before the child's interpreter starts (``spawn``)
    or before any code runs in it (``forkserver``, ``fork``). ``rendezvous=True`` sets
    what ``torchrun`` sets: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` (one per
    job), so ``torch.distributed.init_process_group("gloo")`` needs no other argument;
    ``env`` is applied over them. In each child ``aiomp.get_worker_info()`` gives its
    rank (``id``) and ``nprocs`` (``num_workers``). A key or value of ``env`` that is not
    a str: ``TypeError`` before anything starts.
    """
    return SpawnHandle(
        functools.partial(
            start_children,
            fn,
            nprocs,
            args,
            start_method,
            daemon,
            grace_period,
            output,
            env,
            rendezvous,
        ),
        f"aiomp.spawn({getattr(fn, '__qualname__', type(fn).__name__)}, {nprocs!r})",
    )


#: torch's other name for it; the signature is spawn's, not torch's
#: ``start_processes(fn, args, nprocs, join, daemon, start_method)``: ``args`` is a keyword
#: here (a tuple where ``nprocs`` goes is refused, naming this), and leaving ``async with``
#: (or ``await ctx.join()``) is the join.
start_processes = spawn


spawn.__module__ = "aiomp"  # printed and pickled under the public name
