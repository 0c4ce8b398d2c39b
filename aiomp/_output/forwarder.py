"""Children's output, forwarded to the parent line by line with a label: ``[rank N] line``.

One :class:`Forwarder` per child holds the read ends of the unix sockets that are the
child's fd 1 and fd 2, and of a third (datagrams) for its logging records, and reads them
on the parent's loop with no thread and no polling (see docs/decisions/0020-output-forwarding.md and
*Nothing anyio in loop callbacks* in docs/architecture.md).

Each complete line goes to the sink: ``"prefix"`` writes ``[rank N] line`` to the
parent's ``sys.stdout`` / ``sys.stderr`` (looked up at each write, so redirections and
pytest's capture see it); a callable receives ``(rank, stream, line)``. Bytes that are
not UTF-8 come through with ``errors="backslashreplace"``; lines are never truncated (one
of 1 MiB with no end yet goes as it stands, the rest follows), and with ``"prefix"`` a
carriage return also ends a line, so progress bars show as they redraw. A
logging record is re-emitted with ``logging.getLogger(record.name).handle(record)``, with
``record.rank`` (``record.worker`` in a Pool) and ``record.pid`` set; the child's side is
:func:`aiomp._child.bootstrap.forward_logging`.

Each turn of the loop reads at most :data:`_CHUNK` bytes of a stream and then yields, so a
child that writes faster than the parent forwards (or for ever) never holds the loop: it
waits in ``write()`` meanwhile, as it does when the loop is busy (issue 25 item 1).

Nothing is lost, and a child's exit does not end its output: its own children (a
subprocess, ``os.fork``) hold copies of its stdout and stderr, so each stream is read
until end-of-file. :meth:`Forwarder.child_exited` notes what the child left queued
(:func:`forwarded` waits for that: what ``join`` returns after); the forwarder releases
its fds by itself once both streams have ended. When the spawn or pool closes,
:func:`close_all` forwards what the child left, waits up to :data:`LINGER` seconds more
for the streams' end, then :meth:`Forwarder.close` reads once more, flushes the last
partial lines, logs what it could not read, and detaches (see
docs/decisions/0020-output-forwarding.md). The Pool uses one Forwarder per worker, with
``label="worker"``, its :meth:`child_ends` passed to ``_process.launch(..., output=...)``.
"""

from __future__ import annotations

import functools
import logging
import pickle
import re
import socket
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio

from .. import _loop
from .._wire import datagram as _transport

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("aiomp")

#: ``(rank, stream, line)``: ``stream`` is ``"stdout"`` or ``"stderr"``, ``line`` has no
#: newline.
LineCallback = Callable[[int, str, str], object]
Output = str | LineCallback

STREAMS = ("stdout", "stderr")
#: The parent's streams found to be a closed pipe (``prog | head``): writing to them again
#: would fail again, so their lines are only counted.
_closed_sinks: weakref.WeakSet[object] = weakref.WeakSet()
#: What one turn of the loop reads of a stream, at most, before it yields: a few ms of
#: work (64 KiB of 2-byte lines is the worst case), never a drain until EAGAIN, which a
#: child writing faster than the parent forwards would never let end (issue 25 item 1).
_CHUNK = 64 * 1024
_RECORD_MAX = 4 << 20  # a logging record's datagram; bigger ones go to stderr as text
_RECORDS_PER_TURN = 16  # logging records one turn reads, at most
#: When a spawn or pool closes, how long its forwarders wait for streams that a process
#: the child started (a grandchild) still holds open to end, before they detach.
LINGER = 1.0
#: What a turn of reading left: more may be there now, nothing is there now, the end.
_MORE, _IDLE, _END = 0, 1, 2
#: Once a child's output is readable, wait this long before reading it, so that a child
#: writing many small pieces (unbuffered, PYTHONUNBUFFERED=1) costs the parent one
#: wake-up per batch, not one per write. Only while output flows; the line is late by
#: at most this much.
COALESCE = 0.002
#: A line this long with no end yet is forwarded as it is, the rest as further lines: the
#: parent does not hold a child's endless line (a binary dump, a bar never ended) whole.
LINE_MAX = 1 << 20
#: Where ``"prefix"`` ends a line: a newline, or a carriage return (a progress bar's
#: redraw, forwarded as it comes rather than as one line when the bar ends).
_LINE_END = re.compile(rb"(\r\n|\n|\r)")


def check_output(output: object) -> None:
    if not (output in ("prefix", "inherit") or callable(output)):
        raise ValueError(
            f"output must be 'prefix', 'inherit' or a callable (rank, stream, line), not {output!r}"
        )


_DONTWAIT = int(socket.MSG_DONTWAIT)  # plain ints: IntFlag arithmetic is slow
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)


class Forwarder:
    """The parent's side of one child's stdout and stderr.

    Create it before the child starts, pass :meth:`child_ends` to the child, call
    :meth:`start` once the child has started (on the loop's thread, in a task), and
    :meth:`child_exited` once it has exited. It then forwards until both streams end
    (the child's own children may hold them) and releases its fds by itself; when its
    spawn or pool closes, :func:`close_all` (or :meth:`close`, now) ends it. Neither
    waits in a loop callback, and both are safe to repeat.
    """

    def __init__(self, rank: int, output: Output, label: str = "rank") -> None:
        self.rank = rank
        self._label = label
        self._prefix = f"[{label} {rank}] "
        self._output = output
        self._parent: list[socket.socket | None] = [None, None, None]  # ours, per socket
        self._child: list[socket.socket] = []
        self._partial = [bytearray(), bytearray()]  # a line's start, per stream
        self._open = [False, False]  # "prefix": a redraw was written, its line not ended
        self._lost = [0, 0]  # lines the sink did not take, per stream
        self._reported = False  # the first failure of the sink was logged
        self._got = [0, 0]  # bytes read so far, per stream
        #: At the child's exit: the bytes read by then plus those queued, per stream.
        self._owed: list[int] | None = None
        self._unread = [0, 0, 0]  # bytes left in the sockets when closed before their end
        self.closed = False  # every fd released, the losses reported
        #: Tasks in :meth:`_until`: (their condition, their wake-up), checked after each
        #: read and each end.
        self._waiters: list[tuple[Callable[[], bool], Callable[[], object]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # None: trio
        #: asyncio: per socket, the pending coalescing read or next turn
        self._timers: list[asyncio.Handle | None] = [None, None, None]
        self._trio_scopes: list[Any] = []  # trio.CancelScope (trio is optional)
        try:
            # stdout, stderr (byte streams), then logging records (one datagram each;
            # SOCK_DGRAM, not SEQPACKET: a child tells its control socket, the one
            # seqpacket socket it shares with its parent, by its type)
            for i, kind in enumerate((socket.SOCK_STREAM, socket.SOCK_STREAM, socket.SOCK_DGRAM)):
                ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
                self._parent[i] = ours
                self._child.append(theirs)
                # Two syscalls a pair, no more (see docs/decisions/0020-output-forwarding.md):
                # the child's reads of fd 1 and 2 see EOF; our end stays blocking, read with
                # MSG_DONTWAIT.
                theirs.shutdown(socket.SHUT_RD)
                # Room for a few thousand small writes (each costs ~1 KiB of kernel
                # accounting) while the parent is busy or coalescing: the send buffer
                # bounds a unix socket's data in flight (its receive buffer is unused).
                _transport.grow_buffers(theirs, receive=False)
        except BaseException:
            self.close()
            raise

    def child_ends(self) -> tuple[socket.socket, socket.socket, bool, socket.socket, int]:
        """What the child passes to :func:`aiomp._child.bootstrap.redirect_output`: the stdout and
        stderr write ends; whether to line-buffer its ``sys.stdout`` (as it would be on
        the fd it would otherwise inherit: a terminal yes, a pipe or file no, the fast
        way, flushed at exit); the logging records' end; and the parent's effective
        root logging level, the least a record needs to be sent."""
        try:
            tty = sys.stdout.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        level = logging.getLogger().getEffectiveLevel()
        return self._child[0], self._child[1], tty, self._child[2], level

    def start(self) -> None:
        """Close our copies of the child's ends and start reading on the running loop."""
        for end in self._child:
            end.close()
        self._child = []
        self._loop = _loop.running_asyncio_loop()
        for i, ours in enumerate(self._parent):
            assert ours is not None
            if self._loop is not None:
                self._loop.add_reader(ours.fileno(), self._on_readable, i)
            else:
                import trio

                trio.lowlevel.spawn_system_task(
                    self._trio_reader, i, name=f"aiomp output {self._prefix}"
                )

    # -- the child's exit, and waiting for the streams ---------------------------------
    def child_exited(self) -> None:
        """The child has exited (from the loop's thread; maybe a loop callback): all it
        wrote is queued now, and is what :func:`forwarded` waits for. Never reads."""
        if self._owed is None:
            self._owed = [self._got[i] + self._queued(i) for i in (0, 1)]
        if self._ended():
            self._finish()
        else:
            self._wake()

    def _queued(self, i: int) -> int:
        """Bytes waiting in socket ``i`` (of a datagram socket: the next datagram's)."""
        s = self._parent[i]
        if s is None:
            return 0
        import fcntl
        import termios

        try:
            return int.from_bytes(
                fcntl.ioctl(s.fileno(), termios.FIONREAD, bytes(4)), sys.byteorder
            )
        except OSError:
            return 0

    def _ended(self) -> bool:
        """Both streams have reached their end (or been closed)."""
        return self._parent[0] is None and self._parent[1] is None

    def _forwarded(self) -> bool:
        """All the child wrote before it exited has been read (and given to the sink,
        but for a last line with no end yet, kept until its stream ends)."""
        owed = self._owed
        if owed is None or self.closed:
            return True  # not exited (as far as we know): nothing to wait for
        return all(self._parent[i] is None or self._got[i] >= owed[i] for i in (0, 1))

    async def _until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds; it is checked after each read and each end.
        Cancellation leaves the forwarder as it was."""
        if done():
            return
        waiter: tuple[Callable[[], bool], Callable[[], object]]
        loop = _loop.running_asyncio_loop()
        if loop is not None:
            woken = loop.create_future()
            waiter = (done, functools.partial(_resolve, woken))
            wait: Any = woken
        else:
            import trio

            event = trio.Event()
            waiter, wait = (done, event.set), event.wait()
        self._waiters.append(waiter)
        try:
            await wait
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        """Wake the waiters whose condition holds now, and only those: one woken on
        every read would be ready at every turn of a flood, and anyio delivers a
        cancellation (a timeout) to no task whose wake-up is due (it would never fire)."""
        woken = [w for w in self._waiters if w[0]()]
        for waiter in woken:
            self._waiters.remove(waiter)
            waiter[1]()

    # -- reading: one bounded turn at a time ---------------------------------------------
    async def _trio_reader(self, i: int) -> None:
        import trio

        with trio.CancelScope() as scope:
            self._trio_scopes.append(scope)
            while True:
                state = self._turn(i)
                s = self._parent[i]
                if state == _END or s is None:
                    return
                if state == _MORE:  # let every other task run, then read on
                    await trio.lowlevel.checkpoint()
                    continue
                try:
                    await trio.lowlevel.wait_readable(s)
                except (trio.ClosedResourceError, OSError):
                    return
                if self._at_eof(i):
                    return
                await trio.sleep(COALESCE)

    def _on_readable(self, i: int) -> None:
        s, loop = self._parent[i], self._loop
        assert loop is not None  # reader callbacks exist on asyncio only
        if s is not None and self._timers[i] is None and not self._at_eof(i):
            loop.remove_reader(s.fileno())
            self._timers[i] = loop.call_later(COALESCE, self._asyncio_turn, i)

    def _asyncio_turn(self, i: int) -> None:
        self._timers[i] = None
        loop = self._loop
        assert loop is not None  # timers exist on asyncio only
        state = self._turn(i)
        s = self._parent[i]
        if state == _END or s is None:
            return
        if state == _MORE:  # the next turn after what else is ready (I/O polled between)
            self._timers[i] = loop.call_soon(self._asyncio_turn, i)
        else:
            loop.add_reader(s.fileno(), self._on_readable, i)

    def _at_eof(self, i: int) -> bool:
        """If stream ``i`` (readable now) is at its end, with nothing left unread, end it
        and return True: nothing is worth coalescing for, and a child's exit costs no
        timer (a logging socket has no end)."""
        s = self._parent[i]
        if s is None:
            return True
        if i == 2:
            return False
        try:
            if s.recv(1, _PEEK):
                return False
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            pass
        self._end(i)
        return True

    def _turn(self, i: int) -> int:
        """Forward one bounded read of socket ``i``: :data:`_MORE`, :data:`_IDLE` or
        :data:`_END` (it has ended, and is detached)."""
        s = self._parent[i]
        if s is None:
            return _END
        if i == 2:
            return self._records_turn(s)
        try:
            data = s.recv(_CHUNK, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return _IDLE
        except OSError:
            data = b""
        if not data:
            self._end(i)
            return _END
        self._got[i] += len(data)
        self._emit(i, data)
        if self._waiters:
            self._wake()
        # A unix stream socket's read stops short only when its queue is empty.
        return _MORE if len(data) == _CHUNK else _IDLE

    def _records_turn(self, s: socket.socket) -> int:
        for _ in range(_RECORDS_PER_TURN):
            try:
                data = s.recv(_RECORD_MAX, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return _IDLE
            except OSError:
                return _IDLE  # a datagram socket has no end: nothing else to say
            if data:  # (an empty datagram: nobody sends one)
                self._emit_record(data)
        return _MORE

    def _end(self, i: int) -> None:
        """Stream ``i`` has ended: its last partial line goes, its socket is released."""
        self._emit(i, b"", final=True)
        self._detach(i)
        if self._owed is not None and self._ended():
            self._finish()
        else:
            self._wake()

    def _emit_record(self, data: bytes) -> None:
        """Re-emit a child's logging record through this process's logger of its name."""
        try:
            record = logging.makeLogRecord(pickle.loads(data))
            setattr(record, self._label, self.rank)
            record.pid = record.process
            logging.getLogger(record.name).handle(record)
        except Exception:  # a loop callback must not raise: log it, keep forwarding
            log.exception("aiomp: a logging record from %s was lost", self._prefix.strip())

    def _emit(self, i: int, data: bytes, final: bool = False) -> None:
        """Forward what ``data`` completes of stream ``i`` (everything with ``final``)
        and keep the rest. See docs/decisions/0020-output-forwarding.md for carriage
        returns (progress bars) and overlong lines."""
        buf = self._partial[i]
        prefix = self._output == "prefix"
        start = len(buf)
        whole: bytes | bytearray = data
        if start:
            buf += data  # a bytearray: appending is amortised, never a copy of all so far
            whole = buf
        cut = whole.rfind(b"\n", start)
        if prefix:  # a carriage return last may be a "\r\n" cut in two: not yet an end
            cut = max(cut, whole.rfind(b"\r", max(start - 1, 0), len(whole) - 1))
        head = bytes(whole[: cut + 1])
        if start:
            del buf[: cut + 1]
        else:
            buf += data[cut + 1 :]
        if buf and (final or len(buf) >= LINE_MAX):  # the rest goes too, as a line
            head += bytes(buf) + b"\n"
            buf.clear()
        if not prefix:
            if head:
                self._to_callback(i, head.split(b"\n")[:-1])
            return
        label = self._prefix
        if b"\r" not in head and not self._open[i]:  # plain lines: the common case
            lines = head.split(b"\n")[:-1]
            if lines:
                text = "".join(
                    f"{label}{line.decode('utf-8', 'backslashreplace')}\n" for line in lines
                )
                self._to_stream(i, text, len(lines))
            return
        split = _LINE_END.split(head)  # [line, end, line, end, ..., b""]
        ends = [
            (split[k].decode("utf-8", "backslashreplace"), split[k + 1].decode())
            for k in range(0, len(split) - 1, 2)
        ]
        if final and self._open[i] and not ends:  # a redraw left open ends with the child
            ends.append(("", "\n"))
        if buf and not final and (head.endswith(b"\r") or (not head and self._open[i])):
            # A progress bar's latest redraw, not ended yet: shown now, its line left open.
            try:
                ends.append((buf.decode(), ""))
            except UnicodeDecodeError:  # a character cut in two: wait for its end
                pass
            else:
                buf.clear()
        parts = []
        open_ = self._open[i]
        for line, end in ends:  # what continues an open line gets no second label
            parts.append(line + end if open_ else label + line + end)
            open_ = not end
        self._open[i] = open_
        if parts:
            self._to_stream(i, "".join(parts), len(parts))

    def _to_callback(self, i: int, lines: list[bytes]) -> None:
        output = self._output
        assert callable(output)
        for line in lines:
            try:
                output(self.rank, STREAMS[i], line.decode("utf-8", "backslashreplace"))
            except Exception as exc:  # noqa: BLE001 - a loop callback must not raise: counted
                self._lose(i, 1, exc)

    def _to_stream(self, i: int, text: str, lines: int) -> None:
        """Write ``text`` (``lines`` labelled lines) to the parent's stream ``i``."""
        out = sys.stdout if i == 0 else sys.stderr
        if out in _closed_sinks:
            self._lose(i, lines)
            return
        try:
            out.write(text)
            out.flush()
        except Exception as exc:  # noqa: BLE001 - a loop callback must not raise: counted
            why = ""
            if isinstance(exc, BrokenPipeError):
                why = f": the parent's {STREAMS[i]} is a closed pipe"
                try:
                    _closed_sinks.add(out)
                except TypeError:  # no weak references to it: try again next time
                    pass
            self._lose(i, lines, exc, why)

    def _lose(self, i: int, lines: int, exc: Exception | None = None, why: str = "") -> None:
        """Count ``lines`` of stream ``i`` the sink did not take; log the first failure with
        its traceback (see docs/decisions/0020-output-forwarding.md)."""
        if exc is not None and not self._reported:
            self._reported = True
            log.error(
                "aiomp: forwarding the output of %s failed%s; the lines it loses are "
                "counted and reported when it exits",
                self._prefix.strip(),
                why,
                exc_info=exc,
            )
        self._lost[i] += lines

    def _detach(self, i: int) -> None:
        s = self._parent[i]
        if s is None:
            return
        self._parent[i] = None
        if self._loop is not None:
            timer, self._timers[i] = self._timers[i], None
            if timer is not None:
                timer.cancel()
            try:
                self._loop.remove_reader(s.fileno())
            except Exception:  # noqa: BLE001 - the loop is closed: nothing to remove
                pass
        else:
            trio = sys.modules.get("trio")
            if trio is not None:
                try:
                    trio.lowlevel.notify_closing(s)
                except RuntimeError:
                    pass  # outside trio.run: nobody waits on it
        s.close()

    def close(self) -> None:
        """Stop forwarding now: one bounded read of each stream not ended yet, its last
        partial line flushed, what is left in it counted and logged; release every fd.

        A process that still holds a stream (the child's own child) gets EPIPE when it
        writes next. Never waits; safe to repeat.
        """
        for end in self._child:
            end.close()
        self._child = []
        for i in (0, 1):
            if self._parent[i] is not None and self._turn(i) != _END:
                self._unread[i] = self._queued(i)
                self._emit(i, b"", final=True)
                self._detach(i)
        self._finish()

    def _finish(self) -> None:
        """Both streams are done with: read the last logging records (bounded), release
        the records socket, and report what was lost."""
        if self.closed:
            return
        self.closed = True
        s = self._parent[2]
        if s is not None:
            if self._records_turn(s) == _MORE:
                self._unread[2] = self._queued(2)
            self._detach(2)
        self._report_losses()
        for scope in self._trio_scopes:
            try:
                scope.cancel()
            except RuntimeError:  # trio.run has ended
                pass
        self._trio_scopes = []
        self._wake()

    def _report_losses(self) -> None:
        name = self._prefix.strip()
        for i, lost in enumerate(self._lost):
            if lost:
                self._lost[i] = 0
                log.warning(
                    "aiomp: %d line%s of %s's %s %s not forwarded",
                    lost,
                    "" if lost == 1 else "s",
                    name,
                    STREAMS[i],
                    "was" if lost == 1 else "were",
                )
        for i, unread in enumerate(self._unread[:2]):
            if unread:
                log.warning(
                    "aiomp: %d bytes of %s's %s were not forwarded: a process it started "
                    "still held the stream open when its spawn or pool closed (what that "
                    "process writes to it now fails with EPIPE)",
                    unread,
                    name,
                    STREAMS[i],
                )
        if self._unread[2]:
            log.warning(
                "aiomp: logging records of %s were not forwarded: more were queued than "
                "its spawn or pool read when it closed",
                name,
            )
        self._unread = [0, 0, 0]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def forwarded(forwarders: Iterable[Forwarder | None]) -> None:
    """Wait until each forwarder has forwarded what its child, which has exited, wrote.

    Bounded by what the child left in the socket buffers (4 MiB a stream at most), not
    by what its own children write on. Cancellation leaves the forwarders as they were.
    """
    for f in forwarders:
        if f is not None:
            await f._until(f._forwarded)
            # A stream at its end now ends here: without waiting for a reader's turn
            # (it may never come if the loop ends next), its fds are released.
            for i in (0, 1):
                f._at_eof(i)


async def close_all(forwarders: Iterable[Forwarder | None], linger: float = LINGER) -> None:
    """Close ``forwarders``, whose children have exited: forward all the children wrote
    (:func:`forwarded`), wait up to ``linger`` seconds more (for them all) for streams
    that the children's own children still hold to end, then :meth:`Forwarder.close`
    each (one more bounded read; what is left is logged). ``linger <= 0``: close now.

    Shielded: a cancellation does not cut it short (it is bounded, by what the socket
    buffers held and ``linger``). An interruption that passes the shield (a native
    asyncio cancellation, KeyboardInterrupt) closes them at once and goes on.
    """
    live = [f for f in forwarders if f is not None and not f.closed]
    try:
        if live and linger > 0:
            with anyio.CancelScope(shield=True):
                await forwarded(live)
                with anyio.move_on_after(linger):
                    for f in live:
                        await f._until(f._ended)
    finally:
        for f in live:
            f.close()
