"""Children's output forwarded to the parent, labelled by rank (issue 13, see
docs/decisions/0020-output-forwarding.md), on asyncio, uvloop and trio."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._sinks import Lines
from tests.children import output as funcs

TIMEOUT = 20
GRACE = 0.5
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_callable_gets_every_line_by_rank_and_stream(start_method: str) -> None:
    lines = Lines()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.write_lines,
            4,
            args=(50,),
            start_method=start_method,
            grace_period=GRACE,
            output=lines,
        ) as ctx:
            pass
    assert ctx.results == [0, 1, 2, 3]
    for rank in range(4):
        assert lines.of(rank, "stdout") == (
            [f"out {rank} {i}" for i in range(50)] + ["bad utf-8 \\xff", f"last {rank}"]
        )
        assert lines.of(rank, "stderr") == [f"err {rank} {i}" for i in range(50)]


@pytest.mark.anyio
async def test_prefix_goes_to_the_parents_streams(capsys: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.write_lines, 2, args=(3,), grace_period=GRACE):
            pass
    out, err = capsys.readouterr()
    for rank in range(2):
        assert f"[rank {rank}] out {rank} 2\n" in out
        assert f"[rank {rank}] last {rank}\n" in out
        assert f"[rank {rank}] err {rank} 1\n" in err
    assert all(line.startswith("[rank ") for line in out.splitlines())


@pytest.mark.anyio
@pytest.mark.parametrize(("how", "code"), [("segv", -11), ("exit", 3)])
async def test_nothing_written_before_a_crash_is_lost(how: str, code: int) -> None:
    lines = Lines()
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessExitedException) as info:
            async with aiomp.spawn(
                funcs.write_then_crash, 1, args=(how,), grace_period=GRACE, output=lines
            ):
                pass
    assert info.value.exit_code == code
    assert lines.of(0, "stdout") == ["before the crash 0", "partial, no newline"]


@pytest.mark.anyio
async def test_a_busy_parent_loses_nothing_of_a_loud_child() -> None:
    """A child writes 10 MiB while the parent's loop is blocked: it waits in write()
    (the socket buffer bounds what is held), then goes on; every line arrives."""
    count = 0

    def sink(rank: int, stream: str, line: str) -> None:
        nonlocal count
        count += 1

    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.write_a_lot, 1, args=(10,), grace_period=GRACE, output=sink
        ) as ctx:
            time.sleep(0.5)  # noqa: ASYNC251 - handshake-free: a busy parent blocks its loop
    assert ctx.results == [0]
    assert count == 10 * 1024


@pytest.mark.anyio
@pytest.mark.parametrize("output", ["prefixed", "", None, 3])
async def test_bad_output_is_refused_before_starting(output: object) -> None:
    with pytest.raises(ValueError, match="output"):
        await aiomp.spawn(funcs.write_lines, 1, args=(1,), output=output)  # type: ignore[arg-type]


_PARENT = textwrap.dedent("""
    import sys

    import anyio

    import aiomp
    from tests.children import output as _funcs_output

    async def main():
        async with aiomp.spawn(_funcs_output.write_lines, 2, args=(2,), output=sys.argv[1]):
            pass

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("output", ["prefix", "inherit"])
def test_in_a_parent_process(output: str) -> None:
    """What a user sees: prefixed lines on the parent's own stdout/stderr, or the raw
    ones with ``output="inherit"``."""
    out = subprocess.run(
        [sys.executable, "-c", _PARENT, output],
        cwd=REPO,
        text=True,
        errors="backslashreplace",
        capture_output=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    tag = "[rank 1] " if output == "prefix" else ""
    assert f"{tag}out 1 1\n" in out.stdout
    assert f"{tag}err 1 0\n" in out.stderr
    assert ("[rank" in out.stdout) == (output == "prefix")


@pytest.mark.anyio
async def test_logging_records_are_re_emitted_in_the_parent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A child's records go through the parent's logging, with ``rank`` and ``pid`` set;
    records below the parent's effective level stay in the child."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.log_records, 2, grace_period=GRACE) as ctx:
            pass
    mine = [r for r in caplog.records if r.name == "aiomp.test.child"]
    by_rank = {rank: [r for r in mine if r.rank == rank] for rank in range(2)}  # type: ignore[attr-defined]
    for rank, records in by_rank.items():
        assert [(r.levelname, r.getMessage()) for r in records] == [
            ("WARNING", f"careful {rank}"),
            ("ERROR", "it failed"),
        ]
        assert all(r.pid == ctx.results[rank] for r in records)  # type: ignore[attr-defined]
        assert "ZeroDivisionError: division by zero" in (records[1].exc_text or "")
    assert "below the parent's level" not in caplog.text


@pytest.mark.anyio
async def test_a_child_that_configures_logging_keeps_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = Lines()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.log_with_own_config, 1, grace_period=GRACE, output=lines):
            pass
    assert lines.of(0, "stdout") == ["own: configured here"]
    assert not [r for r in caplog.records if r.name == "aiomp.test.child"]
