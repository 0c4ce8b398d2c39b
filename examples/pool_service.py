"""An HTTP service on asyncio streams that offloads CPU-heavy numpy work to an aiomp.Pool.

The event loop only parses requests and writes responses; each ``/radius`` request runs
an eigenvalue computation in a pool worker, so slow requests never stall the others and
the service uses every core. A worker that crashes fails only its own request (503); a
computation that overruns its deadline is stopped and answered with 504.

Run it as a script: it starts the service on an ephemeral port of 127.0.0.1, sends
itself ``--requests`` concurrent requests, checks the answers, prints ``ok`` and exits::

    python examples/pool_service.py --requests 8
    python examples/pool_service.py --serve      # keep serving until Ctrl-C

Endpoints: ``GET /radius?n=300&seed=1`` (spectral radius of a random n x n matrix) and
``GET /stats`` (the pool's statistics).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from urllib.parse import parse_qs, urlsplit

# One BLAS thread per worker: the pool is the parallelism. Without it each worker starts a
# BLAS thread per core, and on a busy machine the oversubscribed threads made one 300x300
# eigvals take over 30 s (the request's deadline) instead of 50 ms.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # after the environment is set

import aiomp

MAX_N = 2000
DEADLINE = 30.0  # seconds a computation may take before its worker is stopped


def spectral_radius(n: int, seed: int) -> dict[str, float | int]:
    """The CPU-heavy part: runs in a pool worker."""
    rng = np.random.default_rng(seed)
    matrix = rng.standard_normal((n, n))
    radius = float(np.abs(np.linalg.eigvals(matrix)).max())
    return {"n": n, "seed": seed, "radius": radius}


class Service:
    def __init__(self, pool: aiomp.Pool) -> None:
        self.pool = pool

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await self.respond(reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()
            return
        payload = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        try:
            await writer.drain()
        finally:
            writer.close()

    async def respond(self, reader: asyncio.StreamReader) -> tuple[str, object]:
        request_line = (await reader.readline()).decode("latin-1").split()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # headers: nothing here needs them
        if len(request_line) != 3 or request_line[0] != "GET":
            return "405 Method Not Allowed", {"error": "only GET"}
        url = urlsplit(request_line[1])
        if url.path == "/stats":
            return "200 OK", dataclasses.asdict(self.pool.statistics())
        if url.path != "/radius":
            return "404 Not Found", {"error": f"no such path: {url.path}"}
        query = parse_qs(url.query)
        try:
            n = int(query.get("n", ["200"])[0])
            seed = int(query.get("seed", ["0"])[0])
            if not 1 <= n <= MAX_N:
                raise ValueError(f"n must be in 1..{MAX_N}")
        except ValueError as exc:
            return "400 Bad Request", {"error": str(exc)}
        try:
            result = await self.pool.apply(spectral_radius, (n, seed), timeout=DEADLINE)
        except TimeoutError:
            return "504 Gateway Timeout", {"error": f"no answer within {DEADLINE} s"}
        except aiomp.BrokenWorkerError as exc:
            return "503 Service Unavailable", {"error": str(exc)}
        return "200 OK", result


async def get(port: int, target: str) -> tuple[int, object]:
    """A minimal HTTP/1.1 client: ``(status code, decoded JSON body)``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--serve", action="store_true", help="serve until interrupted")
    args = parser.parse_args()

    async with aiomp.Pool(args.processes) as pool:
        server = await asyncio.start_server(Service(pool).handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(f"listening on http://127.0.0.1:{port}", flush=True)
        async with server:
            if args.serve:
                await server.serve_forever()
                return
            start = time.perf_counter()
            answers = await asyncio.gather(
                *(get(port, f"/radius?n={args.n}&seed={i}") for i in range(args.requests))
            )
            elapsed = time.perf_counter() - start
            for status, body in answers:
                assert status == 200, (status, body)
                print(f"  {body}")
            # The same seed gives the same matrix, whichever worker computed it.
            assert answers[0] == await get(port, f"/radius?n={args.n}&seed=0")
            assert (await get(port, "/radius?n=0"))[0] == 400
            assert (await get(port, "/nowhere"))[0] == 404
            status, stats = await get(port, "/stats")
            print(f"{args.requests} requests in {elapsed:.2f} s; pool: {stats}")
    print("ok")


if __name__ == "__main__":  # pool workers import this module: start nothing there
    asyncio.run(main())
