"""examples/inference_service.py (issue 28): the script runs, and the app answers real
HTTP requests on loopback, batched, with one worker per device; a client that hangs up
mid-request is cancelled without killing a worker; a request whose worker crashes gets 503
and the service goes on. Issue 40: a malformed row fails only its own request, and the
app's exception handler sees the model's own ``ValueError``; a model that cannot load
stops the service's start. uvicorn runs on asyncio and uvloop (it has no trio server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

from tests._gate import Gate
from tests._run import run_python
from tests.children import serve as funcs

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
service = pytest.importorskip("examples.inference_service")

TIMEOUT = 60
LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
pytestmark = pytest.mark.anyio


def test_example_runs() -> None:
    proc = run_python("examples/inference_service.py", "--requests", "48", timeout=180)
    assert proc.stdout.splitlines()[-1] == "ok", proc.stdout


@asynccontextmanager
async def serving(gate: Gate, app: Any = None) -> AsyncIterator[tuple[Any, str]]:
    if app is None:
        app = service.create_app(
            2,
            model=funcs.service_model,
            initializer=funcs.service_init,
            initargs=(service.DIM, service.SEED, gate.address),
            start_method="forkserver",
            max_delay=0.02,
        )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # uvicorn says so by a flag only
            assert not task.done(), task
            await asyncio.sleep(0.005)  # handshake-free: uvicorn's flag, bounded above
        port = server.servers[0].sockets[0].getsockname()[1]
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


JSON_TYPE = {"Content-Type": "application/json"}


def body(x: np.ndarray) -> dict[str, list[float]]:
    return {"x": x.tolist()}


@LOOPS
async def test_requests_batched_disconnect_and_crash(anyio_backend: object) -> None:
    service.load_model(service.DIM, service.SEED)
    xs = np.random.default_rng(2).standard_normal((24, service.DIM)).astype(np.float32)
    gate = Gate()
    try:
        with anyio.fail_after(TIMEOUT):
            async with serving(gate) as (app, url), httpx.AsyncClient(base_url=url) as c:
                # Real requests, each answered with its own row, in fewer batches.
                replies = await asyncio.gather(*(c.post("/predict", json=body(x)) for x in xs))
                for x, r in zip(xs, replies, strict=True):
                    assert r.status_code == 200, r.text
                    np.testing.assert_allclose(
                        r.json()["y"], service.predict(x[None])[0], atol=1e-4
                    )
                stats = (await c.get("/stats")).json()
                assert stats["completed"] < len(xs) and stats["workers"] == 2

                # A client that hangs up while its batch runs: cancelled, worker kept.
                held = xs[0].copy()
                held[0] = funcs.HOLD
                raw = json.dumps(body(held)).encode()
                host, port = url.removeprefix("http://").split(":")
                _, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
                )
                await writer.drain()
                await gate.ready(1)  # its batch runs in a worker
                writer.close()
                await writer.wait_closed()
                # The server's own task notices (not a child: nothing to hand-shake with).
                while app.state.disconnected == 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)  # handshake-free: uvicorn's flag, bounded above
                gate.release()
                r = await c.post("/predict", json=body(xs[1]))
                assert r.status_code == 200
                stats = (await c.get("/stats")).json()
                assert stats["replaced"] == 0

                # A request whose worker crashes: 503; the next request is served.
                crash = xs[2].copy()
                crash[0] = funcs.CRASH
                r = await c.post("/predict", json=body(crash))
                assert r.status_code == 503 and "died" in r.json()["error"]
                r = await c.post("/predict", json=body(xs[3]))
                assert r.status_code == 200
                np.testing.assert_allclose(
                    r.json()["y"], service.predict(xs[3][None])[0], atol=1e-4
                )
                assert (await c.get("/stats")).json()["replaced"] == 1
    finally:
        gate.close()


@LOOPS
async def test_a_bad_row_fails_alone_and_its_handler_sees_its_own_error(
    anyio_backend: object,
) -> None:
    """issue 40 items 1 and 6: one malformed request among 16 concurrent ones took down
    its whole batch, and its ValueError left the request's task group as an
    ExceptionGroup that no handler for ValueError catches (a plain 500). Now only the
    bad request fails, with 422 from the app's handler, which sees the model's own
    ValueError and the worker's traceback."""
    service.load_model(service.DIM, service.SEED)
    xs = np.random.default_rng(3).standard_normal((16, service.DIM)).astype(np.float32)
    bad = 5
    seen: list[BaseException] = []
    app = service.create_app(2, start_method="forkserver", max_delay=0.02)
    handler = app.exception_handlers[ValueError]

    async def recording(request: Any, exc: Exception) -> Any:
        seen.append(exc)
        return await handler(request, exc)

    app.add_exception_handler(ValueError, recording)
    gate = Gate()
    try:
        with anyio.fail_after(TIMEOUT):
            async with serving(gate, app) as (_, url), httpx.AsyncClient(base_url=url) as c:
                bodies = [body(x) for x in xs]
                bodies[bad]["x"][0] = float("nan")  # (JSON's NaN: Python's json reads it)
                replies = await asyncio.gather(
                    *(c.post("/predict", content=json.dumps(b), headers=JSON_TYPE) for b in bodies)
                )
    finally:
        gate.close()
    for i, (x, r) in enumerate(zip(xs, replies, strict=True)):
        if i == bad:
            assert r.status_code == 422, r.text
            assert r.json() == {"error": "x must be finite numbers"}
        else:
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["y"], service.predict(x[None])[0], atol=1e-4)
    assert len(seen) == 1 and type(seen[0]) is ValueError, seen
    assert "in predict" in str(seen[0].__cause__)  # the worker's traceback


@LOOPS
async def test_a_model_that_cannot_load_stops_the_start(anyio_backend: object) -> None:
    """issue 40 item 3: a model that cannot load left a live server answering 500. The
    lifespan's wait_ready raises, so uvicorn does not start the service."""
    from tests.children import common

    app = service.create_app(
        2, initializer=common.pool_init_fail, initargs=(), start_method="forkserver"
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on")
    )
    with anyio.fail_after(TIMEOUT), pytest.raises(SystemExit):
        await server.serve()
    assert not server.started
