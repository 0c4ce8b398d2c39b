"""Who am I and placement in the Pool (docs/design.md "Who am I", "Placement"; issue 28):
``aiomp.get_worker_info()`` in workers, ``env=`` per slot, given again to a replacement.

On asyncio, uvloop and trio; every await bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import serve as funcs

TIMEOUT = 30

pytestmark = pytest.mark.anyio

METHODS = ["spawn", "forkserver", "fork"]


async def each_worker(pool: aiomp.Pool, n: int) -> list[Any]:
    """``funcs.who_at_gate`` once in each of the ``n`` workers."""
    gate = Gate()
    results: list[Any] = []

    async def one() -> None:
        results.append(await pool.apply(funcs.who_at_gate, (gate.address,)))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
            await gate.ready(n)
            gate.release()
    finally:
        gate.close()
    return results


async def test_worker_info_is_slot_and_size(anyio_backend: object) -> None:
    """issue 28: each worker knows its slot; seed and dataset are None; pid is its own."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(2, start_method="forkserver") as pool:
            seen = {got[0]: got for got, _ in await each_worker(pool, 2)}
            assert sorted(seen) == [0, 1]
            assert {pid for *_, pid in seen.values()} == set(pool.pids())
            for _, num, seed, dataset, _ in seen.values():
                assert (num, seed, dataset) == (2, None, None)


async def test_worker_info_none_outside(anyio_backend: object) -> None:
    """issue 28: None in the parent, in a subprocess a worker starts, and in its fork."""
    assert aiomp.get_worker_info() is None
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method="forkserver") as pool:
            assert await pool.apply(funcs.who_in_subprocess) == "None"
            assert await pool.apply(funcs.who_in_fork) == "None"


async def test_replacement_keeps_slot_and_env(anyio_backend: object) -> None:
    """issue 28: a worker that dies is replaced with its slot and its slot's env."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(
            1,
            start_method="forkserver",
            env=lambda slot: {"AIOMP_TEST_SLOT": f"s{slot}"},
        ) as pool:
            before = await pool.apply(funcs.who)
            with pytest.raises(aiomp.BrokenWorkerError):
                await pool.apply(funcs.die)
            after = await pool.apply(funcs.who)
            assert before is not None and after is not None
            assert after[0] == before[0] == 0 and after[4] != before[4]
            assert (await pool.apply(funcs.environ))["AIOMP_TEST_SLOT"] == "s0"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_env_per_slot_before_start(anyio_backend: object, method: str) -> None:
    """issue 28: env(slot) is in place before the interpreter starts (spawn: it is in
    the process's own initial environment) or before any code (fork, forkserver); a dict
    is merged over the inherited environment; the parent's is untouched."""
    os.environ["AIOMP_TEST_FIXED"] = "parent"
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(
                2, start_method=method, env=lambda i: {"AIOMP_TEST_SLOT": str(i)}
            ) as pool:
                rows = await pool.map(funcs.environ, range(8), chunksize=1)
                # (A forkserver worker inherits the fork server's environment, which
                # started before this test set AIOMP_TEST_FIXED.)
                inherited = None if method == "forkserver" else "parent"
                pairs = {(r["AIOMP_TEST_SLOT"], r["AIOMP_TEST_FIXED"]) for r in rows}
                assert pairs <= {("0", inherited), ("1", inherited)}
                seen = sorted((who[0], env) for who, env in await each_worker(pool, 2))
                assert seen == [(0, "0"), (1, "1")]
                if method == "spawn":
                    assert await pool.apply(funcs.seen_at_import) in ("0", "1")
            async with aiomp.Pool(1, start_method=method, env={"AIOMP_TEST_FIXED": "x"}) as pool:
                assert (await pool.apply(funcs.environ))["AIOMP_TEST_FIXED"] == "x"
        assert os.environ["AIOMP_TEST_FIXED"] == "parent"
        assert "AIOMP_TEST_SLOT" not in os.environ
    finally:
        del os.environ["AIOMP_TEST_FIXED"]


@pytest.mark.parametrize(
    "env",
    [{1: "a"}, {"A": 1}, lambda i: {"A": i}],
    ids=["key", "value", "callable"],
)
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_env_not_str_is_type_error(anyio_backend: object, env: object) -> None:
    """issue 28: a non-str key or value is a TypeError at the call, before any start."""
    with anyio.fail_after(TIMEOUT), pytest.raises(TypeError, match=r"env.*str"):
        async with aiomp.Pool(1, start_method="forkserver", env=env) as pool:  # type: ignore[arg-type]
            await pool.apply(funcs.environ)


_BIG = "x" * (128 * 1024)


@pytest.mark.parametrize(
    ("env", "error", "match"),
    [
        ({"BIG": _BIG}, ValueError, r"env\['BIG'\] is 131077 bytes .*E2BIG"),
        (lambda i: {"BIG": _BIG} if i else {}, ValueError, r"env\(1\)\['BIG'\].*E2BIG"),
        ({"A=B": "x"}, ValueError, r"'A=B' cannot name an environment variable"),
        ({"": "x"}, ValueError, r"'' cannot name"),
        ({"A": "x\0y"}, ValueError, r"env\['A'\] holds a NUL"),
        ({"A": None}, TypeError, r"env\['A'\] is a NoneType, not a str"),
        ({1: "x"}, TypeError, r"the key 1 is a int, not a str"),
    ],
    ids=["e2big", "e2big-callable", "equals", "empty", "nul", "value-type", "key-type"],
)
def test_env_exec_cannot_take_is_refused_at_the_call(
    env: object, error: type[Exception], match: str
) -> None:
    """Regression (issue 38, item 8): an env value over exec's 128 KiB string limit gave
    ``BrokenPoolError ... exit code 255`` after three anonymous start-up deaths. Every
    variable exec cannot take is refused at the call, before any start, naming it (and
    E2BIG); a non-str key or value names the key and its type plainly (issue 40, item 7:
    the message read "'A': None is str: NoneType")."""
    with pytest.raises(error, match=match):
        aiomp.Pool(2, env=env)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        asyncio.run(_spawn_with(env))


async def _spawn_with(env: object) -> None:
    await aiomp.spawn(funcs.environ, 2, env=env)  # type: ignore[arg-type]
