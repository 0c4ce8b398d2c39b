"""A queue's overflow: a log in shared memory that belongs to the queue, not to a producer.

When a :class:`~aiomp.Queue`'s socket buffer is full (and for every item of a bounded
queue), ``put`` appends the item here and returns: nothing waits, nothing is buffered in
the producer. The *log* is an anonymous memfd every holder maps: a header page, then
records ``[length, nfds, nonce, pickle bytes]`` from ``head`` to ``tail``, grown with
``posix_fallocate``. An item's fds are parked in the *vault*, the reverse direction of the
queue's own socket pair. Every access holds a process-shared robust mutex in the header
page, and every operation commits with one one-byte store.

The mutex is only ever *tried* by an operation: found held (by another thread, or by a
process stopped with SIGSTOP or in a debugger while it holds it), the operation raises
:class:`Busy` having done nothing, and its caller waits its own way (issue 25 item 2): an
async call on its event loop, a blocking call in :meth:`Overflow.wait_unlocked`. So no
event loop's thread ever blocks on the mutex.

Why no item is lost or duplicated when any process dies at any instruction, how each
producer's order is kept (*Order*) and how bounded queues count (*Bounded queues*): the
section "Queue overflow: no loss or duplication at any instruction" in
docs/reliability.md.

A *child* module (see *Light children* in docs/architecture.md): standard library only,
ctypes for the mutex on first use.
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import select
import socket
import struct

from .._errors import QueueClosedError, TransportError
from .._wire import datagram as _transport
from .mutex import Mutex, check

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    #: What a pop returns: ``(pickle, fds, from_socket)``.
    Popped = tuple[bytes | memoryview, list[int], bool]

PAGE = mmap.PAGESIZE
HINT = 8  # 1 while the log may hold an item; never 0 while it does
_CLOSED = 9  # 1 once the queue is closed (written under the lock)
_DRAINED = 10  # 1: the socket was found empty, and no producer has used it since (see *Order*)
_SELECT = 16  # which state copy is committed: storing this byte is the commit
_SIZE = 24  # bytes of data area allocated; never more than the file has (see _mapped)
_COPIES = (64, 96)
# bytes 128-175: the mutex (aiomp._queue.mutex)
_STATE = struct.Struct("<QQQ")  # head, tail, count; offsets into the data area
_RECORD = struct.Struct("<QI4x8s")  # pickle length, number of fds, nonce
_RECORD_SIZE = _RECORD.size
_NO_NONCE = bytes(8)
#: The data area grows by at least this much, and is compacted past it.
GROW = 1 << 20
#: The data area a bounded queue keeps allocated once its log is empty (bytes).
KEEP = 64 << 10

_PEEK_FLAGS = int(socket.MSG_PEEK | socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
_ANC = socket.CMSG_SPACE(_transport.MAX_FDS * array.array("i").itemsize)
_TRUNCATED = int(socket.MSG_CTRUNC | socket.MSG_TRUNC)
U64 = struct.Struct("<Q")
#: Per-process counts of the items sent and received on the socket (see
#: docs/decisions/0007-queue-counts.md): slots of ``[pid, sent, received]`` to the header's end.
_SLOTS = 256
_SLOT = struct.Struct("<QQQ")
_NSLOTS = (PAGE - _SLOTS) // _SLOT.size
_TABLE = struct.Struct(f"<{3 * _NSLOTS}Q")
SENT, RECEIVED = 8, 16  # a count's offset in its slot

#: Test hook: called with the name of each step of an overflow operation, to kill the
#: process there (tests/children/queue.py). None in normal use.
fault: Callable[[str], None] | None = None


def take_token(fd: int) -> bool:
    """Take one from eventfd ``fd``: False if it was 0 (non-blocking)."""
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        return False
    return True


def create() -> int:
    """A fresh, empty log: its fd (this process's own description)."""
    fd = os.memfd_create("aiomp-queue", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE)
        with mmap.mmap(fd, PAGE) as header:
            mutex = Mutex(header)
            mutex.init()
            mutex.detach()
    except BaseException:
        os.close(fd)
        raise
    return fd


class Overflow:
    """This process's handle on a queue's log and vault.

    Owns ``fd`` and its mappings; :meth:`close` releases them. ``vault_in`` /
    ``vault_out`` are the queue's sockets, owned by the queue.
    """

    __slots__ = ("_data", "_fd", "_header", "_mutex", "_poll", "_vault_in", "_vault_out", "look")

    def __init__(self, fd: int, vault_in: socket.socket, vault_out: socket.socket) -> None:
        self._fd = fd
        self._header = mmap.mmap(fd, PAGE)
        self._data: mmap.mmap | None = None
        self._mutex: Mutex | None = None  # made on first use
        self._vault_in = vault_in  # parked fds are sent on this end...
        self._vault_out = vault_out  # ...and received on this one
        self._poll = select.poll()  # is the socket empty? (no exception, unlike recvmsg)
        self._poll.register(vault_in, select.POLLIN)
        #: ``look(0)``: the socket's poll events, empty while it holds nothing (and is not
        #: at EOF): :meth:`socket_empty` without its frame, for a queue's hot path. It
        #: raises RuntimeError while another thread of this process is inside it: the
        #: caller then asks :meth:`socket_empty` (issue 25 item 8).
        self.look = self._poll.poll

    @property
    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._mutex is not None:
            self._mutex.detach()
            self._mutex = None
        self._header.close()
        os.close(self._fd)

    @property
    def header(self) -> mmap.mmap:
        """The log's header page, for the queue's hot path: byte :data:`HINT` is 0 only
        while the log is empty; the slots of socket counts start at offset 256."""
        return self._header

    def drained(self) -> bool:
        """Whether the socket was found empty and no producer has used it since."""
        return self._header[_DRAINED] != 0

    def count(self) -> int:
        """Items in the log (committed state; no lock)."""
        return self._state()[2]

    # -- the mutex and the committed state --------------------------------------------
    def _lock(self) -> Mutex:
        mutex = self._mutex or self._make_mutex()
        mutex.acquire()
        return mutex

    def wait_unlocked(self, deadline: float | None = None) -> bool:
        """After :class:`Busy`: block this thread until the mutex is free, or until
        ``deadline`` (a ``time.monotonic()``) passes: False then. For blocking callers
        only (never an event loop's thread); Ctrl-C interrupts it, leaving it unheld."""
        return (self._mutex or self._make_mutex()).wait(deadline)

    def _make_mutex(self) -> Mutex:
        mutex = self._mutex = Mutex(self._header)
        return mutex

    def _state(self) -> tuple[int, int, int]:
        head, tail, count = _STATE.unpack_from(self._header, _COPIES[self._header[_SELECT]])
        return head, tail, count

    def _commit(self, head: int, tail: int, count: int) -> None:
        other = 1 - self._header[_SELECT]
        _STATE.pack_into(self._header, _COPIES[other], head, tail, count)
        self._header[_SELECT] = other  # the commit: one byte

    def _step(self, name: str) -> None:
        if fault is not None:
            fault(name)

    # -- the data area ----------------------------------------------------------------
    def _mapped(self, end: int, grow: bool) -> mmap.mmap:
        """The data mapping, covering ``[0, end)``; with ``grow``, the file is grown first.

        The header's size is written after the file grows and before it shrinks, so it
        never exceeds the file: nothing below it can SIGBUS.
        """
        size: int = U64.unpack_from(self._header, _SIZE)[0]
        if grow and end > size:
            new = max(end, 2 * size, KEEP if size < KEEP else GROW)
            new = -(-new // PAGE) * PAGE
            try:
                os.posix_fallocate(self._fd, PAGE + size, new - size)
            except OSError as exc:
                raise TransportError(
                    exc.errno, f"no memory for the queue's overflow ({new} bytes): {exc}"
                ) from exc
            U64.pack_into(self._header, _SIZE, new)
            size = new
        data = self._data
        if data is None or len(data) < end:
            self._data = mmap.mmap(self._fd, size, offset=PAGE)
            if data is not None:
                data.close()
            data = self._data
        return data

    def _shrink(self, live_end: int, keep_empty: int = 0) -> None:
        """Give memory back: the file is cut to what the live records need, or to
        ``keep_empty`` bytes once empty."""
        keep = keep_empty if live_end == 0 else -(-max(2 * live_end, GROW) // PAGE) * PAGE
        if U64.unpack_from(self._header, _SIZE)[0] > keep:
            U64.pack_into(self._header, _SIZE, keep)
            os.ftruncate(self._fd, PAGE + keep)
            if self._data is not None and len(self._data) > keep:
                self._data.close()
                self._data = None

    # -- counting the socket's items -----------------------------------------------------
    def claim_slot(self) -> tuple[int, int, int]:
        """This process's slot of socket counts: ``(offset, sent, received)``.

        Claimed once per process (and again after a fork) under a POSIX record lock on the
        log (a lock of this process, unlike the fds' shared open file description); a
        slot found with this pid is taken over, counts included (a dead process's pid
        reused: the sums stay right). With every slot taken, the last one is shared.
        """
        pid = os.getpid()
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        try:
            table = _TABLE.unpack_from(self._header, _SLOTS)
            owners = table[0::3]
            if pid in owners:
                i = owners.index(pid)
            elif 0 in owners:
                i = owners.index(0)
                U64.pack_into(self._header, _SLOTS + i * _SLOT.size, pid)
            else:
                i = _NSLOTS - 1
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)
        sent: int = table[3 * i + 1]
        received: int = table[3 * i + 2]
        return _SLOTS + i * _SLOT.size, sent, received

    def socket_count(self) -> int:
        """Items sent on the socket and not yet received, by every process's counts."""
        table: tuple[int, ...] = _TABLE.unpack_from(self._header, _SLOTS)
        return max(0, sum(table[1::3]) - sum(table[2::3]))

    def socket_empty(self) -> bool:
        """Whether the queue's socket holds no datagram (and is not at EOF)."""
        try:
            return not self._poll.poll(0)
        except RuntimeError:
            # Another thread (another event loop) polls the shared object right now
            # ("concurrent poll() invocation"): look with a poll object of this call's own.
            look = select.poll()
            look.register(self._vault_in, select.POLLIN)
            return not look.poll(0)

    # -- the vault --------------------------------------------------------------------
    def _peek_vault(self) -> tuple[bytes, list[int]] | None:
        try:
            data, anc, flags, _ = self._vault_out.recvmsg(16, _ANC, _PEEK_FLAGS)
        except BlockingIOError:
            return None
        fds = _transport.fds_in(anc)
        if flags & _TRUNCATED:
            _transport.close_fds(fds)
            raise _transport.fds_dropped("The item stays in the queue's overflow.")
        return data, fds

    def _drop_vault_head(self) -> None:
        got = _transport.try_recv(self._vault_out)
        if got is not None:
            _transport.close_fds(got[1])

    def _purge_vault(self) -> None:
        """With the log empty, every parked datagram is an orphan or stale: drop them."""
        while (got := _transport.try_recv(self._vault_out)) is not None:
            _transport.close_fds(got[1])

    def _claim_fds(self, nonce: bytes, nfds: int) -> list[int]:
        """Duplicates of the fds parked for the record ``nonce``; the datagram stays."""
        while True:
            got = self._peek_vault()
            if got is None:  # cannot happen: see docs/reliability.md
                raise TransportError(
                    0,
                    "the file descriptors of an item in the queue's "
                    "overflow are missing; the item is lost",
                )
            data, fds = got
            if data == nonce and len(fds) == nfds:
                return fds
            _transport.close_fds(fds)
            self._drop_vault_head()

    # -- operations -------------------------------------------------------------------
    def append(
        self,
        body: bytes | memoryview,
        fds: list[int],
        try_socket: Callable[[], bool] | None,
        used_socket: bool = True,
        limit: int = 0,
        token_fd: int = -1,
    ) -> bool:
        """Append an item (its pickle and fds), or send it on the socket if the log is empty.

        ``try_socket()`` sends the item on the socket: True if sent. ``used_socket``: this
        producer has sent on the socket since its last append (see *Order*). A bounded
        queue passes ``try_socket=None``, its ``limit`` and its ``token_fd`` (*Bounded queues*):
        False then also means that the log holds ``limit`` items. Returns False if the
        item's fds cannot be parked now (the vault's buffer is full: about 10,900 items
        carrying fds): nothing was put. Raises QueueClosedError once the queue is closed,
        TransportError (no memory, or fd limits), or :class:`Busy` (the mutex is held
        elsewhere): nothing was put.
        """
        mutex = self._mutex or self._make_mutex()  # hot path: tests/budgets
        if rc := mutex.trylock(mutex.addr):
            mutex.recover(rc)  # Busy: nothing was done
        try:
            header = self._header
            if used_socket:  # first: whatever happens next, the flag has been passed on
                header[_DRAINED] = 0
            if header[_CLOSED]:
                raise QueueClosedError("put on a closed aiomp.Queue")
            selected = header[_SELECT]
            head, tail, count = _STATE.unpack_from(header, _COPIES[selected])
            if limit and count >= limit:
                return False
            if count == 0 and try_socket is not None and try_socket():
                return True  # the log was empty: order allows the socket again
            length = len(body)
            end = tail + ((_RECORD_SIZE + length + 7) & ~7)
            data = self._data
            if data is None or len(data) < end or end > U64.unpack_from(header, _SIZE)[0]:
                data = self._mapped(end, grow=True)
            nonce = _NO_NONCE
            if fds:
                nonce = os.urandom(8)
                if not _transport.try_send(self._vault_in, nonce, fds):
                    return False
                self._step("producer: fds parked")
            _RECORD.pack_into(data, tail, length, len(fds), nonce)
            start = tail + _RECORD_SIZE
            data[start : start + length] = body
            if fault is not None:
                fault("producer: record written")
            header[HINT] = 1
            if token_fd >= 0:
                os.eventfd_write(token_fd, 1)  # before the commit: never fewer than items
            _STATE.pack_into(header, _COPIES[1 - selected], head, end, count + 1)
            header[_SELECT] = 1 - selected  # the commit (as in _commit)
            if fault is not None:
                fault("producer: committed")
            return True
        finally:
            if rc := mutex.unlock(mutex.addr):
                check(rc)

    def pop(
        self, try_socket: Callable[[], Popped | None] | None, token_fd: int = -1, room_fd: int = -1
    ) -> Popped | None:
        """The oldest item: ``try_socket()``'s result if not None, else the log's head
        record as ``(pickle, fds, False)``, else None when the log is empty.

        A bounded queue passes ``try_socket=None``, its token and room eventfds (see
        Bounded). The caller owns the fds returned. Raises TransportError if the item's fds cannot
        be received here (this process is at its fd limit): the item stays in the log; or
        :class:`Busy` (the mutex is held elsewhere): nothing was taken.
        """
        mutex = self._mutex or self._make_mutex()  # hot path: tests/budgets
        if rc := mutex.trylock(mutex.addr):
            mutex.recover(rc)
        try:
            header = self._header
            if try_socket is not None and not header[_DRAINED]:
                got = try_socket()
                if got is not None:
                    return got
                header[_DRAINED] = 1
            head, tail, count = _STATE.unpack_from(header, _COPIES[header[_SELECT]])
            if count == 0:
                if token_fd >= 0 and not header[_CLOSED]:
                    while take_token(token_fd):  # every token left is a spurious wake-up
                        pass
                self._emptied(token_fd >= 0)
                return None
            data = self._data
            if data is None or len(data) < tail:
                data = self._mapped(tail, grow=False)
            length, nfds, nonce = _RECORD.unpack_from(data, head)
            start = head + _RECORD_SIZE
            body = data[start : start + length]
            fds = self._claim_fds(nonce, nfds) if nfds else []
            if fault is not None:
                fault("consumer: record read")
            if room_fd >= 0:
                os.eventfd_write(room_fd, 1)  # before the commit: no wake-up is lost
            other = 1 - header[_SELECT]  # the commit, as in _commit
            if count == 1:
                _STATE.pack_into(header, _COPIES[other], 0, 0, 0)
            else:
                next_head = head + ((_RECORD_SIZE + length + 7) & ~7)
                _STATE.pack_into(header, _COPIES[other], next_head, tail, count - 1)
            header[_SELECT] = other
            if fault is not None:
                fault("consumer: committed")
            if nfds:
                self._drop_vault_head()
            if token_fd >= 0:
                take_token(token_fd)  # after the commit: never fewer tokens than items
            if count == 1:
                self._emptied(token_fd >= 0)
            elif head >= GROW:
                self._compact()
            return body, fds, False
        finally:
            if rc := mutex.unlock(mutex.addr):
                check(rc)

    def _emptied(self, bounded: bool) -> None:
        """The log is empty (under the lock): clear the hint, free memory and the vault.

        An unbounded queue's log is used in bursts and goes back to nothing; a bounded
        queue's is used by every item and keeps KEEP bytes, not to reallocate each time
        it runs empty."""
        self._header[HINT] = 0
        self._header[_DRAINED] = 0
        self._purge_vault()
        self._shrink(0, KEEP if bounded else 0)

    def _compact(self) -> None:
        """Once at least as much has been consumed as is left (and past GROW), move the
        live records to the start: the copy overwrites nothing live, and the move is
        committed in one step, so a death part way leaves the old records in place."""
        head, tail, count = self._state()
        live = tail - head
        if head < GROW or live > head:
            return
        assert self._data is not None
        self._data.move(0, head, live)
        self._commit(0, live, count)
        self._shrink(live)

    def closed(self) -> bool:
        return self._header[_CLOSED] != 0

    def close_log(self) -> None:
        """Mark the queue closed, under the lock: an append that has checked it finishes
        first, so a consumer that finds the log empty after this finds it for good. Blocks
        (interruptibly) while the mutex is held elsewhere."""
        mutex = self._lock()
        try:
            self._header[_CLOSED] = 1
        finally:
            mutex.release()
