"""Fixtures shared by the CUDA IPC tests."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from aiomp._cuda import driver as _driver
from aiomp._cuda import ipc as _cuda
from aiomp._cuda.slots import DEFAULT_IPC_LIMIT
from aiomp._cuda.state import state as _state
from aiomp._wire import pickling as _reduction
from tests.children.cuda_backend import FakeBackend
from tests.children.cuda_device import FakeArray
from tests.cuda._cuda import _gpu_skip_reason


@pytest.fixture
def anyio_backend() -> object:
    # This module tests the CUDA transport, not aiomp's async APIs: one backend is enough.
    return ("asyncio", {})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route aiomp._cuda.ipc's CUDA calls to a fake backend; FakeArray reduces like cupy.ndarray."""
    backend = FakeBackend()
    _state.reset()
    monkeypatch.setattr(_driver, "backend", backend)
    _reduction.register(FakeArray, _cuda.reduce_array)
    yield backend
    gc.collect()
    _state.reset()
    _cuda.set_ipc_limit(DEFAULT_IPC_LIMIT)


@pytest.fixture(scope="session")
def _gpu_reason() -> str | None:
    return _gpu_skip_reason()


@pytest.fixture
def gpu(_gpu_reason: str | None) -> None:
    if _gpu_reason is not None:
        pytest.skip(_gpu_reason)
