"""aiomp.ray.Pool: a map of 10,000 trivial items, and the apply round trip, on one local Ray.

Run as ``python -m benchmarks.bench_ray`` (needs Ray: ``pip install "aiomp[ray]"``). One
local Ray instance (``ray.init(num_cpus=2)``) serves every variant, which alternate in
batches; every figure is a median.

- ``await pool.map(trivial, range(10_000))`` on two actors: >= 5x faster than
  ``ray.util.multiprocessing.Pool(2).map`` (its default chunksize), the synchronous pool
  Ray ships. The same map on a local ``aiomp.Pool(2)`` is reported for information: the
  price of the cluster.
- ``await pool.apply(trivial)`` on one actor: <= 1.3x a bare ``await
  actor.method.remote()`` on an async actor, the floor of any Ray call.

Not pinned: Ray starts the actors' processes (from its raylet), so the parent cannot
place them; the figures carry the machine's noise, which the alternation spreads evenly.
"""

from __future__ import annotations

import os

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import trivial

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

N_MAP = 10_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Floor:
    """The floor's actor: an async method that does nothing."""

    async def trivial(self, x: object = None) -> object:
        return x


class BareActor(h.Variant):
    name = "await actor.trivial.remote() (async actor)"

    async def start(self) -> None:
        import ray

        self.ray = ray
        self.actor = ray.remote(_Floor).options(max_concurrency=1).remote()

    async def once(self) -> None:
        await self.actor.trivial.remote()

    async def stop(self) -> None:
        self.ray.kill(self.actor)


class RayMpPoolMap(h.Variant):
    name = "ray.util.multiprocessing.Pool.map"
    is_async = False
    budget = None

    async def start(self) -> None:
        from ray.util.multiprocessing import Pool

        self.pool = Pool(2)  # returns once its actors are up

    def once_sync(self) -> None:
        out = self.pool.map(trivial, range(N_MAP))
        assert len(out) == N_MAP

    async def stop(self) -> None:
        self.pool.terminate()


def ray_pool(processes: int) -> Any:
    import aiomp.ray

    return aiomp.ray.Pool(processes, grace_period=1.0)


RAY_APPLY, RAY_MAP = "aiomp.ray.Pool.apply", "aiomp.ray.Pool.map"
LOCAL_MAP = "aiomp.Pool.map (local processes)"


MAP_WHAT = f"aiomp.ray.Pool(2).map(trivial, range({N_MAP:_}))"
APPLY_WHAT = "aiomp.ray.Pool.apply(trivial) round trip"


async def main() -> None:
    rows: list[dict[str, object]] = []
    if not c.have("ray"):
        note = 'Ray not installed (pip install "aiomp[ray]")'
        rows.append(c.row(MAP_WHAT, None, None, RayMpPoolMap.name, c.faster(5), note))
        rows.append(c.row(APPLY_WHAT, None, None, BareActor.name, c.at_most(1.3), note))
        c.emit("ray", rows, [note])
        return
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 * 2**20,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
    )
    try:
        # -- map --------------------------------------------------------------------------
        mb = c.reps(7, 2)
        maps = [
            h.PoolCalls(RAY_MAP, lambda: ray_pool(2), N_MAP, workers=2, budget=None),
            RayMpPoolMap(),
            h.PoolCalls(LOCAL_MAP, h.aiomp_pool(2), N_MAP, budget=None),
        ]
        s = await h.interleave(maps, mb, 1, warmup=1)
        med = {k: c.median(v) for k, v in s.items()}
        a, base = med[RAY_MAP], RayMpPoolMap.name + " (2 actors, default chunksize)"
        rows.append(c.row(MAP_WHAT, a, med[RayMpPoolMap.name], base, c.faster(5)))
        rows.append(c.row(MAP_WHAT, a, med[LOCAL_MAP], LOCAL_MAP))

        # -- apply round trip -------------------------------------------------------------
        batches, n = c.reps(20, 2), c.reps(100, 50)
        applies = [h.PoolCalls(RAY_APPLY, lambda: ray_pool(1)), BareActor()]
        s = await h.interleave(applies, batches, n)
        med = {k: c.median(v) for k, v in s.items()}
        bare = BareActor.name
        rows.append(c.row(APPLY_WHAT, med[RAY_APPLY], med[bare], bare, c.at_most(1.3)))
    finally:
        ray.shutdown()
    notes = [
        f"ray: one local instance (ray.init(num_cpus=2), Ray {ray.__version__}), unpinned; "
        f"loop {h.loop_name()}; map: median of {mb} maps per variant, alternating; apply: "
        f"median of {batches * n} round trips per variant in {batches} alternating batches.",
        "why one map chunk per actor (aiomp.ray.Pool._chunks_per_slot): with "
        "multiprocessing's four per worker the same map took 16-22 ms in this session "
        "(3x Ray's pool, not 5x): a Ray call costs about 1.3 ms here, the work of some "
        "5000 trivial items.",
    ]
    c.emit("ray", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
