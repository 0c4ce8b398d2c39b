"""Children's output when the parent's sink fails: a closed stdout pipe (``prog | head``)
and a line callback that raises. Each failure is reported once, with its traceback, and
the lines lost are counted when the child exits; the children never block, and the
other stream keeps flowing (see docs/decisions/0020-output-forwarding.md)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator

import anyio
import pytest

import aiomp
from tests.children import output as funcs

TIMEOUT = 20
GRACE = 0.5
N = 2000  # lines per stream and child: several chunks, so several failed writes


@contextlib.contextmanager
def closed_stdout() -> Iterator[None]:
    """``sys.stdout`` is a pipe whose reader has gone, as under ``python prog.py | head``.
    Set in the test's body: pytest's capture sets ``sys.stdout`` again when the test's
    call starts, after the fixtures."""
    r, w = os.pipe()
    os.close(r)
    out = io.TextIOWrapper(io.FileIO(w, "w"), encoding="utf-8")
    saved, sys.stdout = sys.stdout, out
    try:
        yield
    finally:
        sys.stdout = saved
        try:
            out.close()
        except BrokenPipeError:  # its last flush fails the same way
            pass


def aiomp_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiomp"]


@pytest.mark.anyio
async def test_a_closed_stdout_pipe_is_reported_once_and_the_lines_counted(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: with the parent's stdout a closed pipe, the forwarder logged a full
    BrokenPipeError traceback for every chunk it read (58 for two children printing
    20,000 lines each), for as long as the children wrote."""
    caplog.set_level(logging.WARNING, logger="aiomp")
    with closed_stdout(), anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.write_lines, 2, args=(N,), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [0, 1]  # the children never blocked on their stdout
    records = aiomp_records(caplog)
    failures = [r for r in records if r.levelno == logging.ERROR]
    assert len(failures) == 1, [r.getMessage() for r in records]
    assert "the parent's stdout is a closed pipe" in failures[0].getMessage()
    assert isinstance(failures[0].exc_info[1], BrokenPipeError)  # type: ignore[index]
    counts = sorted(r.getMessage() for r in records if r.levelno == logging.WARNING)
    # every stdout line of each child: N numbered, the undecodable one, the last one
    assert counts == [
        f"aiomp: {N + 2} lines of [rank {rank}]'s stdout were not forwarded" for rank in range(2)
    ]
    err = capsys.readouterr().err  # stderr, a working sink, lost nothing
    for rank in range(2):
        assert err.count(f"[rank {rank}] err {rank} ") == N


class Flaky:
    """A line callback that raises on every third line it is given."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str]] = []
        self.refused: list[str] = []  # the stream of each line it raised on

    def __call__(self, rank: int, stream: str, line: str) -> None:
        if (len(self.got) + len(self.refused) + 1) % 3 == 0:
            self.refused.append(stream)
            raise ValueError(f"sink refused {line!r}")
        self.got.append((stream, line))


@pytest.mark.anyio
async def test_a_raising_callback_loses_only_its_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a callback that raised on one line lost the rest of the chunk read
    with it, and each failure logged a traceback. Now it loses that line alone; the first
    failure is logged with its traceback, the rest are counted when the child exits."""
    caplog.set_level(logging.WARNING, logger="aiomp")
    sink = Flaky()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.write_lines, 1, args=(N,), grace_period=GRACE, output=sink
        ) as ctx:
            pass
    assert ctx.results == [0]
    total = 2 * N + 2  # N out, N err, the undecodable line, the last one
    assert len(sink.got) + len(sink.refused) == total
    assert len(sink.refused) == total // 3
    records = aiomp_records(caplog)
    failures = [r for r in records if r.levelno == logging.ERROR]
    assert len(failures) == 1, [r.getMessage() for r in records]
    assert isinstance(failures[0].exc_info[1], ValueError)  # type: ignore[index]
    counts = sorted(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert counts == sorted(
        f"aiomp: {sink.refused.count(stream)} lines of [rank 0]'s {stream} were not forwarded"
        for stream in ("stdout", "stderr")
        if stream in sink.refused
    )
