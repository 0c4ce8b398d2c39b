"""An async inference server feeding GPU worker processes with CuPy batches.

    python examples/cuda_inference.py

The parent plays an async server: N_REQUESTS concurrent request handlers each build a
batch on the GPU and put it on a request queue; GPU worker processes take batches, run a
"model" (a matrix product and an argmax) and put the result back; a dispatcher task
routes every result to the handler waiting for it. Batches and results travel as CUDA
IPC handles: no copy through the host. Each batch is built in an IPC-safe block
(``aiomp.cuda.empty``) and travels in place; the workers' small label arrays come from
CuPy's pool, so aiomp copies each into an IPC-safe staging block on the worker's stream
(a CUDA IPC handle would otherwise share the neighbours the driver packs beside them).

The release protocol, done right (see ``aiomp.cuda``):

- The parent (producer of batches) may drop its batch right after ``put``: aiomp keeps
  the memory alive until the worker has released it.
- A worker drops each batch as soon as it has used it (``del batch``), which releases
  it to the parent, and sends back a result array it owns.
- The parent copies each result to the host and drops it at once, which releases it to
  the worker.
- Shutdown: the parent asks the workers to stop only after every result has been
  received and dropped, so no worker exits while someone still holds its memory; each
  worker checks ``aiomp.cuda.ipc_collect() == 0`` before it returns.

Exits cleanly, with a message, on a machine without a GPU or without cupy.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import anyio

import aiomp

N_WORKERS = 2
N_REQUESTS = 32
BATCH, FEATURES, CLASSES = 256, 1024, 16


def gpu_missing() -> str | None:
    """Why this machine cannot run the example, or None."""
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc}); pip install 'aiomp[cuda]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:  # no driver, or no device
        return str(exc)
    return None if count > 0 else "no CUDA device is visible"


def weights() -> object:
    """The model: the same weights in every process."""
    import cupy

    return cupy.random.default_rng(0).standard_normal((FEATURES, CLASSES), dtype=cupy.float32)


def worker(rank: int, requests: aiomp.Queue, replies: aiomp.Queue) -> tuple[int, int]:
    """A GPU worker: batches in, labels out, until it receives None."""
    import cupy

    w = weights()
    served = 0
    while True:
        item = requests.sync.get()
        if item is None:
            break
        request_id, batch = item
        del item
        logits = batch @ w  # this stream waits for the parent's work on the batch
        del batch  # release it: the parent may reuse that memory once our kernels finish
        labels = cupy.argmax(logits, axis=1).astype(cupy.int32)
        replies.sync.put((request_id, rank, labels))  # our array: we keep it alive for them
        served += 1
    # The parent dropped every result before asking us to stop: nothing of ours is held.
    return served, aiomp.cuda.ipc_collect()


async def serve() -> None:
    import cupy

    requests, replies = aiomp.Queue(maxsize=2 * N_WORKERS), aiomp.Queue()
    w = weights()
    rng = cupy.random.default_rng(1)
    done: dict[int, anyio.Event] = {}
    results: dict[int, tuple[int, Any]] = {}
    agree = 0

    async def dispatcher() -> None:
        for _ in range(N_REQUESTS):
            request_id, rank, labels = await replies.get()
            host = cupy.asnumpy(labels)  # copy out (waits for the worker's kernels) ...
            del labels  # ... and drop the view: the worker may reuse its memory
            results[request_id] = (rank, host)
            done[request_id].set()

    async def handle(request_id: int) -> None:
        nonlocal agree
        batch = aiomp.cuda.empty((BATCH, FEATURES), dtype=cupy.float32)  # travels in place
        batch[...] = rng.standard_normal((BATCH, FEATURES), dtype=cupy.float32)
        expected = cupy.asnumpy(cupy.argmax(batch @ w, axis=1))
        done[request_id] = anyio.Event()
        await requests.put((request_id, batch))
        del batch  # fine: aiomp keeps it alive until the worker has released it
        await done[request_id].wait()
        _rank, labels = results.pop(request_id)
        agree += int((labels == expected).mean() >= 0.99)

    async with aiomp.spawn(worker, N_WORKERS, args=(requests, replies)) as ctx:
        async with anyio.create_task_group() as tg:
            tg.start_soon(dispatcher)
            for i in range(N_REQUESTS):
                tg.start_soon(handle, i)
        for _ in range(N_WORKERS):
            await requests.put(None)

    outcomes = cast("list[tuple[int, int]]", ctx.results)
    per_worker = [served for served, _held in outcomes]
    still_held = sum(held for _served, held in outcomes) + aiomp.cuda.ipc_collect()
    print(
        f"served {sum(per_worker)} requests with {N_WORKERS} GPU workers "
        f"(per worker: {per_worker}); results correct: {agree}/{N_REQUESTS}; "
        f"blocks still held: {still_held}"
    )
    if agree != N_REQUESTS or still_held:
        raise SystemExit(1)


def main() -> int:
    reason = gpu_missing()
    if reason is not None:
        print(f"no GPU here ({reason}): nothing to serve")
        return 0
    anyio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
