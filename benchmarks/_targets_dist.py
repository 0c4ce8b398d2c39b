"""The job of ``bench_ray_spawn``: one gloo all-reduce over the job's ranks (torchrun's
variables), or, with ``fail``, rank 1 raising once the group is up while rank 0 waits in a
barrier (a rank blocked in a collective, as in training). Importable by Ray's workers and
run by ``torchrun -m benchmarks._targets_dist [FAIL_PATH]``; the standard library at the top.
"""

from __future__ import annotations

import os
import sys
import time


def job(rank: int, fail_path: str | None = None) -> float:
    """The all-reduce's result; with ``fail_path``, rank 1 writes ``time.time()`` there and
    raises."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if fail_path is not None:
            if rank == 1:
                with open(fail_path, "w") as f:
                    f.write(repr(time.time()))
                raise RuntimeError("rank 1 failed")
            dist.barrier()  # never passes: rank 1 is gone
        return float(t.item())
    finally:
        if fail_path is None:
            dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun
    job(int(os.environ["RANK"]), sys.argv[1] if len(sys.argv) > 1 else None)
