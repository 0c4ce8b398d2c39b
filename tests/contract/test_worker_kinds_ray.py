"""The worker-kind contract suite (``test_worker_kinds.py``) over Ray actors: one local
Ray instance for the module, started before the tests' leak checks begin."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.contract.test_worker_kinds import (  # noqa: F401 - the suite, run here again
    GRACE,
    test_a_cancelled_call_stops_its_task,
    test_a_timeout_stops_the_task_and_the_pool_serves_on,
    test_a_worker_that_dies_fails_its_task_and_is_replaced,
    test_an_error_comes_with_its_traceback,
    test_apply_and_map,
    test_leaving_waits_for_the_tasks_then_calls_are_refused,
)

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "aiomp[ray]")')

pytestmark = [pytest.mark.anyio, pytest.mark.ray_fds_ok]


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    from tests.conftest import _PERSISTENT, child_pids

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    _PERSISTENT.update(child_pids())  # Ray's own processes live as long as the module
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def make_pool(ray_local: None, anyio_backend: Any) -> Callable[[], Any]:
    if anyio_backend[0] != "asyncio":
        pytest.skip("aiomp.ray.Pool runs on asyncio and uvloop only")
    import aiomp.ray

    return lambda: aiomp.ray.Pool(2, grace_period=GRACE, num_cpus=0.5)
