"""Porting to aiomp.Pool without traps (issue 31): a pool dropped unentered warns (item
1), forked workers draw their own random numbers (item 2), and a script without the
``__main__`` guard is told so by the BrokenPoolError itself (item 7). On asyncio,
uvloop and trio; every await on a worker bounded.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import porting
from tests.spawn.test_porting import assert_all_distinct, seeded_parent

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30
METHODS = ["spawn", "forkserver", "fork"]

pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


def test_a_pool_dropped_unentered_warns_like_a_coroutine() -> None:
    """Issue 31 item 1: a Pool made in sync code and never entered ran nothing, silently."""

    def main() -> None:
        aiomp.Pool(2)  # the sync port: `with` cannot work, `async with` was forgotten

    with pytest.warns(RuntimeWarning) as record:
        main()
        gc.collect()
    (w,) = record
    text = str(w.message)
    assert "aiomp.Pool(...) was never awaited or entered" in text
    assert "`async with aiomp.Pool(...) as pool:`" in text and "asyncio.run(main())" in text
    assert w.filename == __file__


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_forked_workers_draw_their_own_random_numbers(start_method: str, gate: Gate) -> None:
    """Issue 31 item 2: two fork workers' `np.random` and `torch.rand` draws repeated
    192-256 times in 512. Now every worker, and every replacement in the same slot, gets
    its own seeds."""
    seeded_parent()
    draws: list[porting.Draws] = []

    async def call(pool: aiomp.Pool, i: int) -> None:
        draws.append(await pool.apply(porting.draws_at_gate, (i, gate.address)))

    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(2, start_method=start_method, grace_period=1) as pool:
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(call, pool, i)
                await gate.ready(2)  # both workers hold a task: one draw each
                gate.release()
        async with aiomp.Pool(
            1, start_method=start_method, maxtasksperchild=1, grace_period=1
        ) as pool:
            for _ in range(2):  # one worker each: the second replaced the first in slot 0
                draws.append(await pool.apply(porting.draws))
    assert_all_distinct(draws, start_method == "fork")


_UNGUARDED = textwrap.dedent("""
    import asyncio

    import aiomp

    async def main():
        async with aiomp.Pool(2, grace_period=1) as pool:
            print(await pool.apply(abs, (-1,)))

    asyncio.run(main())  # no `if __name__ == "__main__":` guard
""")


def test_an_unguarded_pool_script_is_told_by_its_broken_pool_error(tmp_path: Path) -> None:
    """Issue 31 item 7: a Pool script without the `__main__` guard ended in `BrokenPoolError:
    ... died during start-up 3 times in a row`, the hint only on the workers' stderr. The
    error itself now names the missing guard."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's aiomp
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("aiomp.BrokenPoolError: "), out.stderr
    assert 'if __name__ == "__main__":' in last, last
