"""examples/inference_service.py (issue 28): the script runs, and the app answers real
HTTP requests on loopback, batched, with one worker per device; a client that hangs up
mid-request is cancelled without killing a worker; a request whose worker crashes gets 503
and the service goes on. uvicorn runs on asyncio and uvloop (it has no trio server)."""

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
async def serving(gate: Gate) -> AsyncIterator[tuple[Any, str]]:
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
