"""The parent's side of one child's output: :class:`Forwarder`, and closing many at once.

One :class:`Forwarder` per child owns the read ends of the unix sockets that are the
child's fd 1 and fd 2, and of a third (datagrams) for its logging records, and reads them
on the parent's loop with no thread and no polling (an :class:`aiomp._loop.turns.ReadWatch`
per socket). What it reads becomes lines for the sink in ``aiomp._output.lines``; the
child's side is ``aiomp._child.output``.

Each turn of the loop reads at most :data:`_CHUNK` bytes of a stream and then yields, so a
child that writes faster than the parent forwards (or for ever) never holds the loop: it
waits in ``write()`` meanwhile, as it does when the loop is busy.

Nothing is lost, and a child's exit does not end its output: its own children (a
subprocess, ``os.fork``) hold copies of its stdout and stderr, so each stream is read
until end-of-file. :meth:`Forwarder.child_exited` notes what the child left queued
(:func:`forwarded` waits for that: what ``join`` returns after); the forwarder releases
its fds by itself once both streams have ended. When the spawn or pool closes,
:func:`close_all` forwards what the child left, waits up to :data:`LINGER` seconds more
for the streams' end, then :meth:`Forwarder.close` reads once more, flushes the last
partial lines, logs what it could not read, and detaches. The Pool uses one Forwarder
per worker, with ``label="worker"``, its :meth:`child_ends` passed to
``aiomp._process.launch.launch(..., output=...)``. Waits are cancellable and leave the
forwarder as it was; :func:`close_all` is shielded and bounded.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
from collections.abc import Callable, Iterable

import anyio

from .. import _loop
from .._loop.turns import END, IDLE, MORE, ReadWatch, Turns, read_watch
from .._loop.wakeup import Signal
from .._wire import datagram as _transport
from .lines import ChildLines
from .lines import Output as Output  # the Pool types its option with it
from .lines import check_output as check_output  # the Pool checks its option here

#: What one turn of the loop reads of a stream, at most, before it yields: a few ms of
#: work (64 KiB of 2-byte lines is the worst case), never a drain until EAGAIN, which a
#: child writing faster than the parent forwards would never let end.
_CHUNK = 64 * 1024
_RECORD_MAX = 4 << 20  # a logging record's datagram; bigger ones go to stderr as text
_RECORDS_PER_TURN = 16  # logging records one turn reads, at most
#: When a spawn or pool closes, how long its forwarders wait for streams that a process
#: the child started (a grandchild) still holds open to end, before they detach.
LINGER = 1.0
#: Once a child's output is readable, wait this long before reading it, so that a child
#: writing many small pieces (unbuffered, PYTHONUNBUFFERED=1) costs the parent one
#: wake-up per batch, not one per write. Only while output flows; the line is late by
#: at most this much.
COALESCE = 0.002
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
        self._lines = ChildLines(rank, output, label)
        self._name = f"{label} {rank}"
        self._parent: list[socket.socket | None] = [None, None, None]  # ours, per socket
        self._child: list[socket.socket] = []
        self._got = [0, 0]  # bytes read so far, per stream
        #: At the child's exit: the bytes read by then plus those queued, per stream.
        self._owed: list[int] | None = None
        self._unread = [0, 0, 0]  # bytes left in the sockets when closed before their end
        self.closed = False  # every fd released, the losses reported
        #: Tasks in :meth:`_until`: (their condition, their wake-up), checked after each
        #: read and each end.
        self._waiters: list[tuple[Callable[[], bool], Signal]] = []
        self._watches: list[ReadWatch | None] = [None, None, None]  # per socket, once started
        try:
            # stdout, stderr (byte streams), then logging records (one datagram each;
            # SOCK_DGRAM, not SEQPACKET: a child tells its control socket, the one
            # seqpacket socket it shares with its parent, by its type)
            for i, kind in enumerate((socket.SOCK_STREAM, socket.SOCK_STREAM, socket.SOCK_DGRAM)):
                ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
                self._parent[i] = ours
                self._child.append(theirs)
                # Two syscalls a pair, no more: the child's reads of fd 1 and 2 see EOF;
                # our end stays blocking, read with MSG_DONTWAIT.
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
        for i, ours in enumerate(self._parent):
            assert ours is not None
            turns = Turns(
                functools.partial(self._turn, i), functools.partial(self._at_eof, i), COALESCE
            )
            self._watches[i] = read_watch(ours, turns, f"aiomp output [{self._name}]")

    # -- the child's exit, and waiting for the streams ---------------------------------
    def child_exited(self) -> None:
        """The child has exited (from the loop's thread; maybe a loop callback): all it
        wrote is queued now, and is what :func:`forwarded` waits for. Never reads."""
        if self._owed is None:
            self._owed = [self._got[i] + self._queued(i) for i in (0, 1)]
        self._finish_or_wake()

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
        waiter = (done, Signal(_loop.running_asyncio_loop()))
        self._waiters.append(waiter)
        try:
            await waiter[1].wait()
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
            waiter[1].set()

    # -- reading: one bounded turn at a time ---------------------------------------------
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
        """Forward one bounded read of socket ``i``: ``MORE``, ``IDLE`` or ``END`` (it has
        ended, and is detached)."""
        s = self._parent[i]
        if s is None:
            return END
        if i == 2:
            return self._records_turn(s)
        try:
            data = s.recv(_CHUNK, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return IDLE
        except OSError:
            data = b""
        if not data:
            self._end(i)
            return END
        self._got[i] += len(data)
        self._lines.emit(i, data)
        if self._waiters:
            self._wake()
        # A unix stream socket's read stops short only when its queue is empty.
        return MORE if len(data) == _CHUNK else IDLE

    def _records_turn(self, s: socket.socket) -> int:
        for _ in range(_RECORDS_PER_TURN):
            try:
                data = s.recv(_RECORD_MAX, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return IDLE
            except OSError:
                return IDLE  # a datagram socket has no end: nothing else to say
            if data:  # (an empty datagram: nobody sends one)
                self._lines.emit_record(data)
        return MORE

    def _end(self, i: int) -> None:
        """Stream ``i`` has ended: its last partial line goes, its socket is released."""
        self._lines.emit(i, b"", final=True)
        self._detach(i)
        if self._owed is not None:
            self._finish_or_wake()
        else:
            self._wake()

    def _finish_or_wake(self) -> None:
        """Finish once both streams have given what the child owed; else wake the waiters."""
        if self._ended():
            self._finish()
        else:
            self._wake()

    def _detach(self, i: int) -> None:
        s = self._parent[i]
        if s is None:
            return
        self._parent[i] = None
        watch, self._watches[i] = self._watches[i], None
        if watch is not None:
            watch.stop()
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
            if self._parent[i] is not None and self._turn(i) != END:
                self._unread[i] = self._queued(i)
                self._lines.emit(i, b"", final=True)
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
            if self._records_turn(s) == MORE:
                self._unread[2] = self._queued(2)
            self._detach(2)
        self._lines.report_losses(self._unread)
        self._unread = [0, 0, 0]
        self._wake()


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
