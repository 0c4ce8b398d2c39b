"""What a child's output becomes: labelled lines to the parent's streams, or a callback's.

One :class:`ChildLines` per child turns the bytes read of its stdout and stderr into
lines for the sink: ``"prefix"`` writes ``[rank N] line`` to the parent's ``sys.stdout`` /
``sys.stderr`` (looked up at each write, so redirections and pytest's capture see it); a
callable receives ``(rank, stream, line)``. Bytes that are not UTF-8 come through with
``errors="backslashreplace"``. Lines are never truncated: one of :data:`LINE_MAX` with no
end yet goes as it stands, the rest follows as further lines, so the parent never holds
a child's endless line whole. With ``"prefix"`` a carriage return also ends a line, so a
progress bar shows as it redraws: each redraw is written with its label and no newline,
and the line is left open until a newline or the stream's end. A logging record is
re-emitted with ``logging.getLogger(record.name).handle(record)``, with ``record.rank``
(``record.worker`` in a Pool) and ``record.pid`` set. What the sink does not take is
counted, and logged once. Owns no fd; pure but for the sink. Runs in loop callbacks:
nothing here may raise.
"""

from __future__ import annotations

import logging
import pickle
import re
import sys
import weakref
from collections.abc import Callable

log = logging.getLogger("aiomp")

#: ``(rank, stream, line)``: ``stream`` is ``"stdout"`` or ``"stderr"``, ``line`` has no
#: newline.
LineCallback = Callable[[int, str, str], object]
Output = str | LineCallback

STREAMS = ("stdout", "stderr")
#: The parent's streams found to be a closed pipe (``prog | head``): writing to them again
#: would fail again, so their lines are only counted.
_closed_sinks: weakref.WeakSet[object] = weakref.WeakSet()
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


class ChildLines:
    """One child's lines on their way to the sink (see the module docstring)."""

    def __init__(self, rank: int, output: Output, label: str = "rank") -> None:
        self.rank = rank
        self._label = label
        self._prefix = f"[{label} {rank}] "
        self._output = output
        self._partial = [bytearray(), bytearray()]  # a line's start, per stream
        self._open = [False, False]  # "prefix": a redraw was written, its line not ended
        self._lost = [0, 0]  # lines the sink did not take, per stream
        self._reported = False  # the first failure of the sink was logged

    def emit_record(self, data: bytes) -> None:
        """Re-emit a child's logging record through this process's logger of its name."""
        try:
            record = logging.makeLogRecord(pickle.loads(data))
            setattr(record, self._label, self.rank)
            record.pid = record.process
            logging.getLogger(record.name).handle(record)
        except Exception:  # a loop callback must not raise: log it, keep forwarding
            log.exception("aiomp: a logging record from %s was lost", self._prefix.strip())

    def emit(self, i: int, data: bytes, final: bool = False) -> None:
        """Forward what ``data`` completes of stream ``i`` (everything with ``final``)
        and keep the rest (see the module docstring for carriage returns and overlong
        lines)."""
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
        its traceback; the rest are counted, and reported when the child's output ends
        (a sink that fails once, a closed pipe, usually fails for every line)."""
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

    def report_losses(self, unread: list[int]) -> None:
        """Log the lines the sink did not take (counted anew from here), and ``unread``:
        the bytes left unread in stdout and stderr, and whether logging records were."""
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
        for i, left in enumerate(unread[:2]):
            if left:
                log.warning(
                    "aiomp: %d bytes of %s's %s were not forwarded: a process it started "
                    "still held the stream open when its spawn or pool closed (what that "
                    "process writes to it now fails with EPIPE)",
                    left,
                    name,
                    STREAMS[i],
                )
        if unread[2]:
            log.warning(
                "aiomp: logging records of %s were not forwarded: more were queued than "
                "its spawn or pool read when it closed",
                name,
            )
