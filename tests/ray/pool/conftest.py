"""The one Ray instance of the ``aiomp.ray.Pool`` tests: started once for this package
(its modules run together, in one pytest-xdist group, see ``tests/conftest.py``) and shut
down when the package is done, before ``tests/ray/test_spawn.py`` starts its own cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="package")
def ray_head() -> Iterator[Any]:
    """One local Ray instance for the package: a Cluster head node with 4 logical CPUs."""
    from ray.cluster_utils import Cluster

    from tests.conftest import _PERSISTENT, child_pids
    from tests.ray.pool._ray import connect_driver, ray

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"aiomp_head": 1, "aiomp_w": 4},
            "object_store_memory": 200 * 2**20,
            "include_dashboard": False,
        },
    )
    try:
        connect_driver(cluster.address)
        _PERSISTENT.update(child_pids())  # Ray's own processes live as long as the package
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def ray_reconnect(ray_head: Any) -> Iterator[None]:
    """For a test that shuts this driver's Ray session down: connected again after it (and
    a Ray instance that something started meanwhile shut down: a failing test's)."""
    from tests.ray.pool._ray import connect_driver, ray

    yield
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == ray_head.address:
        return
    ray.shutdown()
    connect_driver(ray_head.address)
