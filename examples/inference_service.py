"""An inference service: FastAPI, one pool worker per device, dynamic batching.

The app's lifespan opens an ``aiomp.Pool`` with one worker per device: ``env=`` gives
worker ``i`` ``CUDA_VISIBLE_DEVICES=i`` before its interpreter starts, so each worker
sees its own GPU as device 0 (here a CPU ``tanh(x @ W)`` model stands in for one). The
initializer loads the model once per worker. Each ``POST /predict`` is one call of
``pool.batched(..., stack=True)``: concurrent requests are stacked straight into one
shared-memory array and the model runs once per batch.

The service takes no traffic before its model is loaded: the lifespan waits for
``pool.wait_ready()``, and a model that cannot load stops the start (``BrokenPoolError``
with the initializer's exception as ``__cause__``). Errors reach the app's exception
handlers as themselves: a malformed row fails only its own request (the batch's other
rows run again without it) with its ``ValueError``, answered 422; a request whose worker
crashes gets 503 (``BrokenWorkerError``) and the pool replaces the worker; past
``max_pending`` batches waiting, a request is refused at once with 503 and
``Retry-After`` (``PoolOverloadedError``). A client that disconnects mid-request has its
call cancelled (taken out of its batch, or its row discarded if the batch already runs:
the worker is never killed for it).

Run it as a script: it serves on an ephemeral port of 127.0.0.1, sends itself
``--requests`` concurrent requests, checks the answers, prints ``ok`` and exits::

    python examples/inference_service.py --requests 64
    python examples/inference_service.py --serve --port 8000   # until Ctrl-C

Endpoints: ``POST /predict`` with ``{"x": [DIM floats]}`` answers ``{"y": [...]}``;
``GET /stats``: the pool's statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

# One BLAS thread per worker: the pool is the parallelism.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import anyio
import numpy as np  # after the environment is set
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import aiomp

DIM = 512
SEED = 0

_weights: np.ndarray[Any, Any] | None = None


def load_model(dim: int, seed: int) -> None:
    """The pool's initializer: load the model once per worker. A real service would
    ``torch.load`` here and move it to ``cuda:0``, its own device."""
    global _weights
    rng = np.random.default_rng(seed)
    _weights = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)


def predict(batch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One batch: ``batch`` is the stacked rows of every request in it. A row that is not
    finite is refused (the pool runs the rows again to find it: only its caller fails)."""
    assert _weights is not None, "load_model runs first"
    if not np.isfinite(batch).all():
        raise ValueError("x must be finite numbers")
    return np.tanh(batch @ _weights)


def one_device_each(slot: int) -> dict[str, str]:
    """Worker ``slot`` sees only device ``slot``."""
    return {"CUDA_VISIBLE_DEVICES": str(slot)}


async def cancel_on_disconnect(request: Request, scope: Any) -> None:
    """Cancel ``scope`` when the client hangs up (the body has been read already, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def unless_disconnected(request: Request, call: Callable[[Any], Any], x: Any) -> Any:
    """``await call(x)``, cancelled if the client hangs up first (then None).

    What ``call`` raises is raised here as itself, outside the task group that watches
    the client, so that the app's exception handlers see it (raised inside, it would
    leave as an ``ExceptionGroup``, which no handler for ``ValueError`` catches).
    """
    result: Any = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_disconnect, request, tg.cancel_scope)
        try:
            result = await call(x)
        except Exception as exc:  # noqa: BLE001 - raised below, as itself
            error = exc
        tg.cancel_scope.cancel()  # done: stop watching
    if error is not None:
        raise error
    return result


def create_app(
    devices: int = 2,
    *,
    model: Callable[[Any], Any] = predict,
    initializer: Callable[..., object] = load_model,
    initargs: tuple[object, ...] = (DIM, SEED),
    start_method: str = "spawn",
    max_batch_size: int = 32,
    max_delay: float = 0.005,
    max_pending: int | None = 64,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aiomp.Pool(
            devices,
            initializer=initializer,
            initargs=initargs,
            env=one_device_each,
            start_method=start_method,
            max_pending=max_pending,  # batches waiting for a worker, at most
        ) as pool:
            await pool.wait_ready()  # no traffic before the model is loaded
            app.state.pool = pool
            app.state.model = pool.batched(
                model, max_batch_size=max_batch_size, max_delay=max_delay, stack=True
            )
            app.state.disconnected = 0
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/predict")
    async def predict_endpoint(request: Request) -> Any:
        body = await request.json()
        x = np.asarray(body.get("x"), dtype=np.float32)
        if x.shape != (DIM,):
            raise ValueError(f"x must be {DIM} numbers")
        y = await unless_disconnected(request, app.state.model, x)
        if y is None:  # the client hung up: its call was cancelled
            app.state.disconnected += 1
            return JSONResponse({"error": "client disconnected"}, status_code=499)
        return {"y": y.tolist()}

    @app.exception_handler(ValueError)
    async def bad_input(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=422)

    @app.exception_handler(aiomp.BrokenWorkerError)
    async def worker_died(request: Request, exc: aiomp.BrokenWorkerError) -> JSONResponse:
        return JSONResponse({"error": f"the worker died: {exc}"}, status_code=503)

    @app.exception_handler(aiomp.PoolOverloadedError)
    async def overloaded(request: Request, exc: aiomp.PoolOverloadedError) -> JSONResponse:
        return JSONResponse({"error": "overloaded"}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/stats")
    async def stats() -> Any:
        return dataclasses.asdict(app.state.pool.statistics())

    return app


async def self_test(requests: int, devices: int) -> None:
    """Serve on an ephemeral port, send ``requests`` concurrent requests, check them."""
    import httpx
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(create_app(devices), host="127.0.0.1", port=0, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # it failed to start: say why
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    load_model(DIM, SEED)
    xs = np.random.default_rng(1).standard_normal((requests, DIM)).astype(np.float32)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            replies = await asyncio.gather(
                *(c.post("/predict", json={"x": x.tolist()}) for x in xs)
            )
            for x, r in zip(xs, replies, strict=True):
                r.raise_for_status()
                np.testing.assert_allclose(r.json()["y"], predict(x[None])[0], atol=1e-4)
            stats = (await c.get("/stats")).json()
            assert stats["completed"] < requests, stats  # batches formed
    finally:
        server.should_exit = True
        await task
    print("ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    if args.serve:
        import uvicorn

        uvicorn.run(create_app(args.devices), host="127.0.0.1", port=args.port)
    else:
        asyncio.run(self_test(args.requests, args.devices))


if __name__ == "__main__":
    main()
