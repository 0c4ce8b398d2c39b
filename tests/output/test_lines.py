"""What ``output="prefix"`` and a line callback make of a child's bytes: carriage returns
(progress bars) and lines with no end (see docs/decisions/0020-output-forwarding.md).
The pure part, ``aiomp._output.lines.Lines``, is tested on its own; the rest through
``spawn``."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator

import anyio
import pytest

import aiomp
from aiomp._output import lines as _output
from tests._sinks import Lines
from tests.children import output as funcs

TIMEOUT = 20
GRACE = 0.5


@pytest.fixture
def forwarder() -> Iterator[_output.ChildLines]:
    yield _output.ChildLines(3, "prefix")


def emitted(f: _output.ChildLines, *chunks: bytes, final: bool = True) -> str:
    """What ``prefix`` writes to stdout for ``chunks`` read one after another."""
    saved, sys.stdout = sys.stdout, io.StringIO()
    try:
        for chunk in chunks:
            f.emit(0, chunk)
        if final:
            f.emit(0, b"", final=True)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = saved


def test_newlines_make_lines_and_a_last_partial_line_ends_at_exit(
    forwarder: _output.ChildLines,
) -> None:
    assert emitted(forwarder, b"a\nb", b"c\n", b"d") == "[rank 3] a\n[rank 3] bc\n[rank 3] d\n"


def test_a_carriage_return_redraws_in_place(forwarder: _output.ChildLines) -> None:
    """A progress bar's redraws are forwarded as they come, each with its own label, and
    still redraw in place on a terminal; ``\\r\\n`` stays one line end, even split
    across two reads."""
    assert emitted(forwarder, b"\r 10%", b"\r 20%", final=False) == (
        "[rank 3] \r[rank 3]  10%\r[rank 3]  20%"  # the latest redraw shown, its line open
    )
    assert emitted(forwarder, b"\r 30%\n") == "\r[rank 3]  30%\n"
    assert emitted(forwarder, b"\r 40", final=False) == "[rank 3] \r[rank 3]  40"
    assert emitted(forwarder, b"%") == "%\n"  # an open line goes on, then ends at exit
    assert emitted(forwarder, b"dos\r", b"\nnext\n") == "[rank 3] dos\r\n[rank 3] next\n"
    assert emitted(forwarder, b"last\r") == "[rank 3] last\r\n"


def test_a_callback_gets_lines_split_on_newlines_only() -> None:
    lines = Lines()
    f = _output.ChildLines(1, lines)
    f.emit(0, b"a\rb\nc\r\n")
    f.emit(0, b"", final=True)
    assert lines.got == [(1, "stdout", "a\rb"), (1, "stdout", "c\r")]


def test_an_endless_line_is_forwarded_in_pieces_of_at_most_line_max() -> None:
    """A child's line with no end is not kept whole, nor copied whole at every read (a
    1 GiB dump would otherwise cost 4,000 copies of up to 1 GiB)."""
    lines = Lines()
    f = _output.ChildLines(0, lines)
    chunk = b"z" * (256 << 10)
    for _ in range(13):  # 3.25 MiB
        f.emit(0, chunk)
    assert [len(line) for _, _, line in lines.got] == [_output.LINE_MAX] * 3
    f.emit(0, b"", final=True)
    assert [len(line) for _, _, line in lines.got] == [_output.LINE_MAX] * 3 + [256 << 10]


@pytest.mark.anyio
async def test_a_childs_progress_bar_is_shown_while_it_runs() -> None:
    """The child waits, after its half-way redraw, until the parent has written it: with
    redraws held until the bar's newline, it would wait forever."""
    seen = aiomp.Event()
    shown: list[str] = []

    class Stderr(io.StringIO):
        def write(self, s: str) -> int:
            shown.append(s)
            if "[rank 0] bar 50%" in s:
                seen.set()  # an eventfd write: fine in a loop callback
            return len(s)

    saved, sys.stderr = sys.stderr, Stderr()
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.spawn(funcs.progress_bar, 1, args=(seen,), grace_period=GRACE) as ctx:
                pass
    finally:
        sys.stderr = saved
    assert ctx.results == [0]
    assert "".join(shown) == ("[rank 0] \r[rank 0] bar 0%\r[rank 0] bar 50%\r[rank 0] bar 100%\n")


@pytest.mark.anyio
async def test_an_endless_line_from_a_child_arrives_whole_in_pieces() -> None:
    lines = Lines()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.endless_line, 1, args=(3,), grace_period=GRACE, output=lines
        ) as ctx:
            pass
    assert ctx.results == [0]
    pieces = [line for _, stream, line in lines.got if stream == "stdout"]
    assert "".join(pieces) == "y" * (3 << 20)
    assert all(len(p) <= _output.LINE_MAX + (256 << 10) for p in pieces)
