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
:func:`aiomp._child.forward_logging`.

Nothing is lost: :meth:`Forwarder.close`, once the child has exited, reads what is left
(what it wrote just before a SIGSEGV or SIGKILL included) and flushes a last partial
line. The Pool uses one Forwarder per worker, with ``label="worker"``, its
:meth:`child_ends` passed to ``_process.launch(..., output=...)``.
"""

from __future__ import annotations

import logging
import pickle
import re
import socket
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _transport

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
_CHUNK = 256 * 1024
_RECORD_MAX = 4 << 20  # a logging record's datagram; bigger ones go to stderr as text
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
    :meth:`close` once it has exited. ``close`` never waits and is safe to repeat.
    """

    def __init__(self, rank: int, output: Output, label: str = "rank") -> None:
        self.rank = rank
        self._label = label
        self._prefix = f"[{label} {rank}] "
        self._output = output
        self._parent: list[socket.socket | None] = []
        self._child: list[socket.socket] = []
        self._partial = [bytearray(), bytearray()]  # a line's start, per stream
        self._open = [False, False]  # "prefix": a redraw was written, its line not ended
        self._lost = [0, 0]  # lines the sink did not take, per stream
        self._reported = False  # the first failure of the sink was logged
        self._loop: asyncio.AbstractEventLoop | None = None  # None: trio
        #: asyncio: pending coalescing reads
        self._timers: list[asyncio.TimerHandle | None] = [None, None, None]
        self._trio_scopes: list[Any] = []  # trio.CancelScope (trio is optional)
        try:
            # stdout, stderr (byte streams), then logging records (one datagram each;
            # SOCK_DGRAM, not SEQPACKET: a child tells its control socket, the one
            # seqpacket socket it shares with its parent, by its type)
            for kind in (socket.SOCK_STREAM, socket.SOCK_STREAM, socket.SOCK_DGRAM):
                ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
                self._parent.append(ours)
                self._child.append(theirs)
                # Two syscalls a pair, no more (see
                # docs/decisions/0020-output-forwarding.md): the child's reads of fd 1 and 2 see
                # EOF; our
                # end stays blocking, read with MSG_DONTWAIT.
                theirs.shutdown(socket.SHUT_RD)
                # Room for a few thousand small writes (each costs ~1 KiB of kernel
                # accounting) while the parent is busy or coalescing: the send buffer
                # bounds a unix socket's data in flight (its receive buffer is unused).
                _transport.grow_buffers(theirs, receive=False)
        except BaseException:
            self.close()
            raise

    def child_ends(self) -> tuple[socket.socket, socket.socket, bool, socket.socket, int]:
        """What the child passes to :func:`aiomp._child.redirect_output`: the stdout and
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
        asyncio = sys.modules.get("asyncio")
        try:
            self._loop = asyncio.get_running_loop() if asyncio is not None else None
        except RuntimeError:
            self._loop = None
        for i, ours in enumerate(self._parent):
            assert ours is not None
            if self._loop is not None:
                self._loop.add_reader(ours.fileno(), self._on_readable, i)
            else:
                import trio

                trio.lowlevel.spawn_system_task(
                    self._trio_reader, i, name=f"aiomp output {self._prefix}"
                )

    async def _trio_reader(self, i: int) -> None:
        import trio

        with trio.CancelScope() as scope:
            self._trio_scopes.append(scope)
            while self._read(i, drain=True):
                s = self._parent[i]
                if s is None:
                    return
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
            self._timers[i] = loop.call_later(COALESCE, self._read_batch, i)

    def _at_eof(self, i: int) -> bool:
        """If stream ``i`` (readable now) is at its end, with nothing left unread, flush
        its partial line, stop reading it and return True: nothing is worth coalescing
        for, and a child's exit costs no timer (a logging socket has no end)."""
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
        self._emit(i, b"", final=True)
        self._detach(i)
        return True

    def _read_batch(self, i: int) -> None:
        self._timers[i] = None
        s, loop = self._parent[i], self._loop
        if s is None:
            return
        assert loop is not None  # timers exist on asyncio only
        if self._read(i, drain=True):
            loop.add_reader(s.fileno(), self._on_readable, i)
        else:
            self._detach(i)

    def _read(self, i: int, drain: bool = False) -> bool:
        """Forward what can be read now (one chunk, or all with ``drain``); False at EOF."""
        s = self._parent[i]
        while s is not None:
            try:
                data = s.recv(_CHUNK if i < 2 else _RECORD_MAX, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                data = b""
            if not data:
                if i < 2:
                    self._emit(i, b"", final=True)
                return False
            if i < 2:
                self._emit(i, data)
            else:
                self._emit_record(data)
            if not drain:
                return True
        return False

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
        """Forward what is left (the child has exited), flush partial lines, release fds."""
        for end in self._child:
            end.close()
        self._child = []
        for i in range(len(self._parent)):
            if self._parent[i] is not None:
                self._read(i, drain=True)
                if i < 2:
                    self._emit(i, b"", final=True)
                self._detach(i)
        for i, lost in enumerate(self._lost):
            if lost:
                self._lost[i] = 0
                log.warning(
                    "aiomp: %d line%s of %s's %s %s not forwarded",
                    lost,
                    "" if lost == 1 else "s",
                    self._prefix.strip(),
                    STREAMS[i],
                    "was" if lost == 1 else "were",
                )
        for scope in self._trio_scopes:
            try:
                scope.cancel()
            except RuntimeError:  # trio.run has ended
                pass
        self._trio_scopes = []
