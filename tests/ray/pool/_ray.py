"""What the ``aiomp.ray.Pool`` tests share: Ray (the tests skip without it), bounds, loop
parametrizations, a Pool with a short grace period.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import aiomp

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "aiomp[ray]")')

import aiomp.ray  # noqa: E402 - after the skip

TIMEOUT = 60  # an actor starts in about a second, far longer on two busy cores
GRACE = 0.3
REPO = Path(__file__).resolve().parents[3]

LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


def connect_driver(address: str) -> None:
    ray.init(
        address=address,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )


def pool(processes: int = 2, **kwargs: Any) -> aiomp.ray.Pool:
    kwargs.setdefault("grace_period", GRACE)
    return aiomp.ray.Pool(processes, **kwargs)
