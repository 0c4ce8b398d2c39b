"""The services guide's web-service recipe, over real HTTP on loopback (issue 31 item 6).

uvicorn does not cancel a handler whose client has gone: with a plain endpoint, the
pool's workers ran on for results nobody read and the next requests waited for them.
The guide's ``unless_disconnected`` races the call against ``http.disconnect``. Here
the guide's own block is served by uvicorn; two clients leave while their requests
hold both workers, and a third request must be served at once. asyncio and uvloop only:
uvicorn does not run on trio.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import anyio
import pytest

from tests._gate import Gate
from tests.children import porting
from tests.meta.test_readme import python_blocks

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "services.md"

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

TIMEOUT = 30


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ModuleType]:
    """The guide's service block, imported as a module the pool's workers can import."""
    (code,) = [c for _, c in python_blocks(GUIDE) if "def unless_disconnected" in c]
    name = f"readme_service_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(tmp_path))


async def get(url: str) -> httpx.Response:
    """One request on a client of its own: cancelled, its connection closes (it leaves)."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        return await client.get(url)


@pytest.mark.anyio
async def test_a_client_that_leaves_frees_its_worker(
    service: ModuleType, anyio_backend: object, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 6: the next requests waited for abandoned work. With the README's
    recipe the abandoned calls are cancelled: their workers are replaced, and a new
    request is served without waiting for them."""
    if "trio" in str(anyio_backend):
        pytest.skip("uvicorn runs on asyncio (and uvloop) only")
    # The README's crunch, held at the gate: the test knows when both workers hold one.
    monkeypatch.setattr(service, "crunch", porting.crunch_at_gate)
    # The workers inherit it (an abstract address: its leading NUL cannot be in a variable).
    monkeypatch.setenv("AIOMP_TEST_GATE", gate.address.lstrip("\0"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/crunch"
    server = uvicorn.Server(uvicorn.Config(service.app, lifespan="on", log_level="warning"))
    try:
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, [sock])
                async with anyio.create_task_group() as clients:
                    for _ in range(2):  # work held at the gate: both workers busy
                        clients.start_soon(get, f"{url}?seconds=3600")
                    await gate.ready(2)
                    clients.cancel_scope.cancel()  # both clients leave
                pool = service.app.state.pool
                response = await get(f"{url}?seconds=0")
                assert response.status_code == 200 and response.json() == {"seconds": 0.0}
                assert pool.statistics().replaced == 2  # the abandoned calls' workers
                server.should_exit = True
    finally:
        sock.close()
