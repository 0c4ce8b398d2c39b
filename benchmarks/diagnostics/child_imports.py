"""What does a spawned child import? aiomp's children against multiprocessing's.

    python -m benchmarks.diagnostics.child_imports [--async]

Starts one child each way (after a warm-up start, so the resource tracker and the page
cache are warm) with ``PYTHONPROFILEIMPORTTIME=1`` set for the child only, and prints the
modules aiomp's child imports that a plain ``multiprocessing`` spawn child does not, with
their own import times (``-X importtime`` "self" column, microseconds). ``--async`` runs
an ``async def`` target in the aiomp child (which then loads asyncio).
"""

from __future__ import annotations

import os
import sys

from benchmarks._targets import noop


async def noop_async(rank: int) -> None:
    pass


def _parse(text: str) -> dict[str, int]:
    import re

    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| +(\S+)", line)
        if m:
            out[m.group(3)] = int(m.group(1))
    return out


def _child_imports(start: object) -> dict[str, int]:
    """Run ``start()`` with the child's stderr captured; the child's import times."""
    import tempfile

    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        os.environ["PYTHONPROFILEIMPORTTIME"] = "1"
        try:
            start()  # type: ignore[operator]
        finally:
            del os.environ["PYTHONPROFILEIMPORTTIME"]
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return _parse(err.read().decode(errors="replace"))


def main() -> None:
    import multiprocessing

    import anyio

    import aiomp

    use_async = "--async" in sys.argv
    fn = noop_async if use_async else noop

    def mp_start() -> None:
        p = multiprocessing.get_context("spawn").Process(target=noop, args=(0,))
        p.start()
        p.join()

    def aiomp_start() -> None:
        async def go() -> None:
            async with aiomp.spawn(fn, 1):
                pass

        anyio.run(go)

    mp_start()
    aiomp_start()
    base = _child_imports(mp_start)
    ours = _child_imports(aiomp_start)
    extra = {k: v for k, v in ours.items() if k not in base}
    print(
        f"multiprocessing child: {len(base)} modules, {sum(base.values()) / 1e3:.1f} ms "
        "of import (self times summed)"
    )
    print(
        f"aiomp child ({'async' if use_async else 'sync'} fn): {len(ours)} modules, "
        f"{sum(ours.values()) / 1e3:.1f} ms"
    )
    print(
        f"imported by aiomp's child only: {len(extra)} modules, {sum(extra.values()) / 1e3:.1f} ms"
    )
    for name, us in sorted(extra.items(), key=lambda kv: -kv[1]):
        print(f"  {us / 1e3:7.2f} ms  {name}")


if __name__ == "__main__":
    from benchmarks._common import allow_bytecode

    allow_bytecode()
    main()
