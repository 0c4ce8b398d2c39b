"""aiomp.ray.spawn: job start and failure propagation on a two-node local Ray cluster,
against torch's own multi-node launcher (``torchrun``), one launcher a node.

Run as ``python -m benchmarks.bench_ray_spawn`` (needs Ray and torch). A
``ray.cluster_utils.Cluster`` of two nodes (one logical CPU each) on this machine holds the
aiomp jobs; ``torchrun --nnodes 2 --node_rank K --nproc_per_node 1`` twice (a static
rendezvous on 127.0.0.1) is the baseline, on the same machine. The job is
``benchmarks._targets_dist.job``: ``init_process_group("gloo")`` and one all-reduce.

- Job start: launch to every rank done (the all-reduce returned, the group destroyed),
  ``async with aiomp.ray.spawn(job, 2, rendezvous=True)`` (its actors killed and its
  placement group removed included) vs both ``torchrun`` processes exited 0. Each
  starts fresh processes that import torch: Ray's actors, torchrun's agents and workers.
- Failure propagation: rank 1 raises once the group is up while rank 0 waits in a
  barrier; from the raise (``time.time()``, written by the rank) to the launcher done:
  aiomp's ``ProcessRaisedException`` raised (rank 0 stopped, its actor killed after the
  grace period, 0.5 s here, and the group removed) vs both ``torchrun`` processes exited
  (rank 0's barrier fails when gloo sees its peer gone).

No target: Ray's and torchrun's start-up costs differ in kind (a placement group and actor
processes from a raylet; two agents that each start a worker), so both rows are reported
for information. Variants alternate; every figure is a median. Unpinned.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from subprocess import DEVNULL

from benchmarks import _common as c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 0.5


async def aiomp_job(fail_path: str | None) -> float:
    """One job on the cluster: its time (start) or the raise-to-done time (fail)."""
    import aiomp
    import aiomp.ray
    from benchmarks._targets_dist import job

    t0 = time.time()
    try:
        async with aiomp.ray.spawn(job, 2, (fail_path,), rendezvous=True, grace_period=GRACE):
            pass
    except aiomp.ProcessRaisedException:
        assert fail_path is not None
        return time.time() - _raised_at(fail_path)
    assert fail_path is None
    return time.time() - t0


async def torchrun_job(fail_path: str | None) -> float:
    """The same job under two ``torchrun`` processes, one per "node"."""
    import anyio

    from aiomp._process.placement import free_port

    port = free_port()
    extra = [] if fail_path is None else [fail_path]
    t0 = time.time()
    procs = []
    for node in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
        argv += [f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1"]
        argv += [f"--master_port={port}", "--max_restarts=0", "-m", "benchmarks._targets_dist"]
        procs.append(
            await anyio.open_process(argv + extra, cwd=ROOT, stdout=DEVNULL, stderr=DEVNULL)
        )
    codes = [await p.wait() for p in procs]
    if fail_path is None:
        assert codes == [0, 0], codes
        return time.time() - t0
    assert all(codes), codes
    return time.time() - _raised_at(fail_path)


def _raised_at(path: str) -> float:
    with open(path) as f:
        return float(f.read())


async def main() -> None:
    rows: list[dict[str, object]] = []
    start_what = "job start: 2 ranks, init_process_group('gloo') + all_reduce, to all done"
    fail_what = "failure propagation: rank 1 raises, rank 0 in a barrier; raise to launcher done"
    if not (c.have("ray") and c.have("torch")):
        note = "needs Ray and torch"
        for what in (start_what, fail_what):
            rows.append(c.row(what, None, None, "torchrun, 2 nodes", None, note))
        c.emit("ray_spawn", rows, [note])
        return
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    samples: dict[str, list[float]] = {k: [] for k in ("a_start", "t_start", "a_fail", "t_fail")}
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        env = {"env_vars": {"PYTHONPATH": ROOT}}
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
        n = c.reps(4, 2)
        with tempfile.TemporaryDirectory(prefix="aiomp-bench-ray-spawn-") as tmp:
            await aiomp_job(None)  # warm-up: Ray's worker pool, the actor class
            for i in range(n):
                fail = os.path.join(tmp, f"raised-{i}")
                samples["a_start"].append(await aiomp_job(None))
                samples["t_start"].append(await torchrun_job(None))
                samples["a_fail"].append(await aiomp_job(fail + "-a"))
                samples["t_fail"].append(await torchrun_job(fail + "-t"))
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = {k: c.median(v) for k, v in samples.items()}
    base = "torchrun, 2 nodes (2 processes, --nnodes 2)"
    rows.append(c.row(start_what, med["a_start"], med["t_start"], base))
    rows.append(c.row(fail_what, med["a_fail"], med["t_fail"], base))
    notes = [
        f"ray_spawn: a ray.cluster_utils.Cluster of 2 nodes (1 logical CPU each, Ray "
        f"{ray.__version__}) on this machine; torchrun's static rendezvous on 127.0.0.1; "
        f"median of {n} jobs per variant, alternating; aiomp's grace_period {GRACE} s "
        "(rank 0, in a sync barrier, is killed after it).",
        "all samples (s): "
        + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v) for k, v in samples.items()),
        "Ray Train's TorchTrainer, the other baseline the issue names, is not installed "
        'here: ray.train needs pandas, pyarrow and fsspec (pip install "ray[train]"), '
        "which aiomp does not depend on.",
    ]
    c.emit("ray_spawn", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
