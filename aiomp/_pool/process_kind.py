"""The process kind of worker: what :class:`aiomp.Pool` starts for each slot.

A :class:`ProcessKind` starts one worker process per call (``_process.launch`` with
:func:`aiomp._pool.worker_main.main`), with two stream socket pairs (tasks out, results
in) and, unless the output is inherited, a forwarder of its output; it hands each to a
:class:`~aiomp._pool.process_handle.ProcessHandle`. It turns calls into frames of the
process wire (:mod:`aiomp._pool.protocol`), checking in the caller that the workers can
import the function. Owns the pickled initializer (sent to every worker) and the
forwarders of workers that have not ended yet: a worker's own children may hold its
output after it exits.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio

from .._child import seeds as _seeds
from .._loop import running_asyncio_loop
from .._output import forwarder as _output
from .._process import checks as _checks
from .._process import launch as _launch
from .._process.child import KILL_TIMEOUT, Child
from .._wire import byvalue
from .._wire import pickling as _reduction
from .._wire import stream as _stream
from . import protocol as P
from . import worker_main
from .kinds import Call, Events, InitCall, Options, WorkerKind
from .process_handle import ProcessHandle

log = logging.getLogger("aiomp")

_BUILTIN_FUNCTIONS = frozenset((types.BuiltinFunctionType,))


class Launched(NamedTuple):
    """A worker process just launched, and the parent's ends of its three sockets."""

    child: Child
    sock: socket.socket  # tasks and control frames, to it
    results: socket.socket  # its results
    stacks: socket.socket  # the stack it prints as it is terminated

    def close(self) -> None:
        for s in (self.sock, self.results, self.stacks):
            s.close()


class ProcessKind(WorkerKind):
    """See the module docstring."""

    chunks_per_slot = 4
    process_wire = True
    start_method: str

    def __init__(
        self,
        start_method: str,
        init: InitCall,
        output: _output.Output,
        *,
        envs: list[dict[str, str]] | None = None,
        max_memory: int | None = None,
        defer_helpers: bool = False,
    ) -> None:
        #: Start aiomp's keeper and multiprocessing's resource tracker once the first
        #: worker is ready, not beside it (``_process.launch.launch``'s
        #: ``defer_helpers``; ``run_sync``'s default pool).
        self.defer_helpers = defer_helpers
        self.start_method = start_method
        self._init_call = init
        self._output = output
        #: Each slot's env (``_process.placement.slot_envs``), given again to a replacement.
        self.envs = envs
        #: Retire a worker whose private memory grows past this (see ``_pool.health``).
        self.max_memory = max_memory
        self._init: _reduction.Message | None = None
        self._init_sends = 0
        #: A fork copies the parent's generators: each worker gets its own seeds.
        self._seed_base = None if start_method == "spawn" else _seeds.base_seed()
        self._forwarders: list[_output.Forwarder] = []
        #: Workers launched ahead of the engine (:meth:`launch_ahead`), by slot.
        self._ahead: dict[int, Launched] = {}
        self._launches = 0  # worker processes launched so far

    def describe(self) -> str:
        memory = "" if self.max_memory is None else f" max_memory={self.max_memory}"
        return f"start_method={self.start_method!r}{memory}"

    async def prepare(self, processes: int) -> int:
        self._init = byvalue.dumps(self._init_call, P.header(P.OP_INIT, 0, 0))
        if self.start_method == "fork":
            _checks.check_fork_safe()
        elif self.start_method == "forkserver":
            await _launch.prepare_forkserver()
        return processes

    def launch_ahead(self, slot: int, processes: int) -> None:
        """Launch ``slot``'s worker now, before the engine exists: its interpreter boots
        while the caller imports and builds the rest of the pool, and :meth:`start` for
        ``slot`` takes it (``run_sync``'s first call; decision 0048). Until then this
        kind owns it: :meth:`close` (or :meth:`discard_ahead`) kills and reaps it. A
        launch that fails (EAGAIN, EMFILE) is left to :meth:`start`, which the engine
        tries again."""
        try:
            self._ahead[slot] = self._launch(slot, processes)
        except OSError as exc:
            log.debug("aiomp: could not launch worker %d ahead: %s", slot, exc)

    def unadopted(self) -> list[Child]:
        """The workers launched ahead that no :meth:`start` has taken yet."""
        return [launched.child for launched in self._ahead.values()]

    async def discard_ahead(self) -> None:
        """SIGKILL and reap the workers launched ahead that no :meth:`start` took (the
        pool failed to open, or never did). Shielded; bounded by the kill."""
        ahead, self._ahead = self._ahead, {}
        with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT):
            for launched in ahead.values():
                launched.close()
                launched.child.kill(quiet=True)
            for launched in ahead.values():
                await launched.child.wait_exit()

    def start(self, slot: int, events: Events, options: Options) -> ProcessHandle:
        """Launch a worker for ``slot``, or take the one launched ahead for it; a start
        that fails (EMFILE here, EAGAIN in launch) closes whatever it made, and the
        engine tries again."""
        assert self._init is not None
        launched = self._ahead.pop(slot, None) or self._launch(slot, options.processes)
        child, sock, results, stacks = launched
        h = ProcessHandle(
            slot, child, sock, results, running_asyncio_loop(), options.grace, events, stacks
        )
        if self._init_sends:
            self._init.sent_again()
        self._init_sends += 1
        h.send_control(*self._init.framed())
        return h

    def _launch(self, slot: int, processes: int) -> Launched:
        """Start ``slot``'s worker process with its sockets and output forwarder."""
        with contextlib.ExitStack() as made:  # closed (each safe to repeat) if it fails
            fw = None
            if self._output != "inherit":
                fw = _output.Forwarder(slot, self._output, label="worker")
                made.callback(fw.close)
                self._forwarders = [f for f in self._forwarders if not f.closed]
                self._forwarders.append(fw)
            sock, theirs = map(made.enter_context, _stream.stream_socketpair())
            results, their_results = map(made.enter_context, _stream.stream_socketpair())
            # Where the worker prints its stack as it is terminated (``_pool.health``).
            stacks, their_stacks = map(made.enter_context, socket.socketpair())
            with their_results, their_stacks:  # the worker's ends: its copies suffice
                child = _launch.launch(
                    Child,
                    worker_main.main,
                    slot,
                    self.start_method,
                    True,
                    theirs,
                    extra=(their_results, their_stacks, self.max_memory),
                    name=f"aiomp-pool-{slot}",
                    output=fw,
                    who=(slot, processes),
                    env=None if self.envs is None else self.envs[slot],
                    seed=self._seed(slot),
                    defer_helpers=self.defer_helpers and not self._launches,
                )
            made.pop_all()
        self._launches += 1
        return Launched(child, sock, results, stacks)

    def _seed(self, slot: int) -> int | None:
        """The seed of the worker starting now in ``slot`` (None under spawn: fresh)."""
        base = self._seed_base
        return None if base is None else _seeds.child_seed(base, slot, self._launches)

    def encode(self, call: Call) -> Any:
        """Task ``tid``'s frame or :class:`~aiomp._pool.protocol.TaskMessage`; raises
        here, in the caller, if it cannot be pickled or if the workers could not import
        ``fn`` even by value (it holds a lock): the same check as ``spawn``'s, once per
        function and start method. What a worker cannot import by name (a lambda, a
        function of a notebook) travels by value."""
        tid, fn, info, flags, items, kwds, _ = call
        method = self.start_method
        if method not in info.checked:
            _checks.check_function(fn, method)
            info.checked.add(method)
        try:
            return task_message(tid, fn, info.fid, flags, items, kwds)
        except Exception as exc:
            _checks.check_picklable(fn)  # a clearer error when fn is the problem
            exc.add_note(f"(while pickling a task of {info.name} for a pool worker)")
            raise

    async def close(self, linger: bool) -> None:
        await self.discard_ahead()
        _launch.start_deferred_helpers()
        init, self._init = self._init, None
        if init is not None:
            init.close()
        forwarders, self._forwarders = self._forwarders, []
        await _output.close_all(forwarders, _output.LINGER if linger else 0)


def task_message(
    tid: int,
    fn: Callable[..., object],
    fid: int,
    flags: int,
    items: Any,
    kwds: dict[str, object] | None,
) -> Any:
    """A task's message: a small frame (bytes), or a :class:`P.TaskMessage`."""
    if flags & P.F_APPLY and not kwds:
        # apply(f, (1, "a")): nothing in it can carry an fd or an array. (Not for a map's
        # chunk: looking at each of thousands of items costs more than the pickler does.)
        if fid and not items:
            return P.noargs_task(tid, flags | P.F_NOARGS, fid)
        if (fid or type(fn) in _BUILTIN_FUNCTIONS) and all(type(x) in P.PLAIN for x in items):
            body = pickle.dumps((items, None) if fid else (fn, items, None), protocol=5)
            if P.fits_inline(body):
                return P.task_frame(tid, flags, fid, body)
    elif fid and type(items) is range and not kwds:
        # A chunk of map(f, range(n)): a few bytes, and no fd or array can be in it.
        return P.task_frame(tid, flags, fid, pickle.dumps((items, None), protocol=5))
    return P.TaskMessage(
        P.OP_TASK,
        tid,
        flags,
        P.task_body(fid, b""),
        (items, kwds) if fid else (fn, items, kwds),
        by_value=True,
    )
