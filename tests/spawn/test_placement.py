"""Who am I and placement in spawn (docs/design.md "Who am I", "Placement"; issue 28):
``get_worker_info()`` in children, ``env=`` per rank, and torchrun's ``rendezvous=True``.

On asyncio, uvloop and trio; every await bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import os

import anyio
import pytest

import aiomp
from tests.children import serve as funcs

TIMEOUT = 60

pytestmark = pytest.mark.anyio

asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


async def test_worker_info_is_rank(anyio_backend: object) -> None:
    """issue 28: a spawned child's info is its rank and nprocs."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.who_rank, 3, start_method="forkserver")
        assert await ctx.join()
    for rank, got in ctx.results:  # type: ignore[misc]
        assert got is not None
        assert got[:4] == (rank, 3, None, None)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@asyncio_only
async def test_env_per_rank(anyio_backend: object, method: str) -> None:
    """issue 28: env(rank) in each child (spawn: in its initial environment)."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.environ_rank,
            2,
            start_method=method,
            env=lambda r: {"AIOMP_TEST_SLOT": str(r)},
        )
        assert await ctx.join()
        assert [r["AIOMP_TEST_SLOT"] for r in ctx.results] == ["0", "1"]  # type: ignore[index]
        if method == "spawn":
            ctx = await aiomp.spawn(funcs.seen_at_import_rank, 2, env={"AIOMP_TEST_SLOT": "d"})
            assert await ctx.join()
            assert ctx.results == ["d", "d"]
    assert "AIOMP_TEST_SLOT" not in os.environ


@asyncio_only
async def test_env_not_str_is_type_error(anyio_backend: object) -> None:
    """issue 28: TypeError at the call, nothing started."""
    with pytest.raises(TypeError, match=r"env.*str"):
        await aiomp.spawn(funcs.environ_rank, 1, env={"A": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"env.*str"):
        await aiomp.spawn(funcs.environ_rank, 1, env=lambda r: {r: "x"})  # type: ignore[arg-type,return-value]


async def test_rendezvous_sets_torchrun_variables(anyio_backend: object) -> None:
    """issue 28: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, a free
    MASTER_PORT; env= applied after them may override; two jobs never share a port."""
    with anyio.fail_after(TIMEOUT):
        async with (
            aiomp.spawn(funcs.environ_rank, 2, start_method="forkserver", rendezvous=True) as a,
            aiomp.spawn(
                funcs.environ_rank,
                2,
                start_method="forkserver",
                rendezvous=True,
                env=lambda r: {"LOCAL_RANK": f"L{r}"},
            ) as b,
        ):
            pass
    ra, rb = a.results, b.results
    for rank, row in enumerate(ra):
        assert isinstance(row, dict)
        assert row["RANK"] == row["LOCAL_RANK"] == str(rank)
        assert row["WORLD_SIZE"] == row["LOCAL_WORLD_SIZE"] == "2"
        assert row["MASTER_ADDR"] == "127.0.0.1"
    assert [r["LOCAL_RANK"] for r in rb] == ["L0", "L1"]  # type: ignore[index]
    ports = {r["MASTER_PORT"] for r in ra} | {r["MASTER_PORT"] for r in rb}  # type: ignore[index]
    assert len(ports) == 2
    assert all(p is not None and 1024 <= int(p) < 65536 for p in ports)


@asyncio_only
async def test_rendezvous_gloo_all_reduce(anyio_backend: object) -> None:
    """issue 28: a two-rank torch.distributed gloo all-reduce with no other setup."""
    pytest.importorskip("torch.distributed")
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.all_reduce, 2, rendezvous=True)
        assert await ctx.join()
    assert ctx.results == [[3.0, 30.0], [3.0, 30.0]]
