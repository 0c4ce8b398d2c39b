"""Children for the many-to-many comparison (``bench_m2m``): 4 producers, 2 consumers.

Module level, standard library only at import time (see ``_targets``): numpy, torch and
aiomp are imported inside the functions that need them. Unpinned: this is throughput of
six processes on the machine's cores, for every library alike.

One protocol for every queue, so that no library's own flush or count is needed:

- a producer waits for ``(kind, n)`` on its own ``go`` queue, puts ``n`` items of that
  kind on ``data``, then one :data:`MARK`; ``n == 0`` ends it;
- a consumer waits for ``True`` on its own ``go`` queue, then takes items off ``data``,
  counting them; on a :data:`MARK` it reports ``"mark"`` on ``done`` (a producer's items
  all came before its mark, so the fourth mark means every item was taken); on ``None``
  it reports its count on ``done`` and waits for its next ``go`` (so the parent's two
  ``None``s reach both consumers); ``False`` ends it.

Every child reports ``"ready"`` on ``done`` once it has imported what it needs.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: A producer's last item of a round.
MARK = 1
SMALL = b"x" * 64
#: float32 elements of a 100 KiB array
ARRAY_LEN = 100 * 1024 // 4


def _fresh(use_torch: bool = False) -> Any:
    """The maker of an ``array`` item: a fresh copy of a 100 KiB numpy array (for torch's
    queue, a ``torch.from_numpy`` tensor of it, which ``put`` moves into shared memory)."""
    import numpy as np

    src = np.arange(ARRAY_LEN, dtype=np.float32)
    if not use_torch:
        return src.copy
    import torch

    return lambda: torch.from_numpy(src.copy())


def _empty() -> Any:
    """The maker of an ``empty`` item: the array built straight into an ``aiomp.empty``
    block (``put`` sends a handle; the block is reused once the consumer drops it too)."""
    import numpy as np

    import aiomp

    src = np.arange(ARRAY_LEN, dtype=np.float32)

    def make() -> Any:
        a = aiomp.empty(ARRAY_LEN, np.float32)
        np.copyto(a, src)
        return a

    return make


def _produce(go: Any, put: Any, fresh: Any, empty: Any = None) -> None:
    """A blocking producer's protocol (the module docstring), for any queue's calls."""
    while (msg := go())[1] > 0:
        kind, n = msg
        if kind == "small":
            for _ in range(n):
                put(SMALL)
        else:
            make = fresh if kind == "array" else empty
            for _ in range(n):
                put(make())
        put(MARK)


# -- multiprocessing.Queue and torch.multiprocessing.Queue ---------------------------------


def produce_mp(rank: int, data: Any, gos: Any, done: Any, use_torch: bool) -> None:
    """A producer for ``multiprocessing.Queue`` (or torch's, whose arrays go as tensors)."""
    fresh = _fresh(use_torch)
    done.put("ready")
    _produce(gos[rank].get, data.put, fresh)


def consume_mp(rank: int, data: Any, gos: Any, done: Any, use_torch: bool) -> None:
    if use_torch:
        import torch  # noqa: F401  (rebuilding the tensors needs it)
    _consume(gos[rank].get, data.get, done.put)


def _consume(go: Any, get: Any, report: Any) -> None:
    """A blocking consumer's protocol (the module docstring), for any queue's calls."""
    report("ready")
    while go():
        count = 0
        while (x := get()) is not None:
            if x.__class__ is int:
                report("mark")
            else:
                count += 1
        report(count)


# -- aiomp.Queue ----------------------------------------------------------------------------


def produce_aiomp_sync(rank: int, data: Any, gos: Any, done: Any) -> None:
    """A producer through ``q.sync``: ``small``, ``array`` (which ``put`` copies into
    shared memory, as for the baselines) and ``empty`` items."""
    fresh, empty = _fresh(), _empty()
    done.sync.put("ready")
    _produce(gos[rank].sync.get, data.sync.put, fresh, empty)


def consume_aiomp_sync(rank: int, data: Any, gos: Any, done: Any) -> None:
    _consume(gos[rank].sync.get, data.sync.get, done.sync.put)


async def produce_aiomp_async(rank: int, data: Any, gos: Any, done: Any) -> None:
    """:func:`produce_aiomp_sync` with ``await q.put``."""
    fresh, empty = _fresh(), _empty()
    go, put = gos[rank], data.put
    await done.put("ready")
    while (msg := await go.get())[1] > 0:
        kind, n = msg
        if kind == "small":
            for _ in range(n):
                await put(SMALL)
        else:
            make = fresh if kind == "array" else empty
            for _ in range(n):
                await put(make())
        await put(MARK)


async def consume_aiomp_async(rank: int, data: Any, gos: Any, done: Any) -> None:
    go, get, report = gos[rank], data.get, done.put
    await report("ready")
    while await go.get():
        count = 0
        while (x := await get()) is not None:
            if x.__class__ is int:
                await report("mark")
            else:
                count += 1
        await report(count)


# -- the datagram floor ------------------------------------------------------------------------


def produce_dgram(rank: int, sock: Any, gos: Any, done: Any) -> None:
    """A producer for the datagram floor: each item one raw 64 B ``send`` on the shared
    ``SOCK_SEQPACKET`` socket (blocking), no pickling; the mark is a 1-byte ``m``.
    ``gos`` and ``done`` are ``multiprocessing.Queue``s, as for the baselines."""
    go, send = gos[rank], sock.send
    done.put("ready")
    while (msg := go.get())[1] > 0:
        for _ in range(msg[1]):
            send(SMALL)
        send(b"m")


def consume_dgram(rank: int, sock: Any, gos: Any, done: Any) -> None:
    """A consumer for the datagram floor: ``recv`` until the parent's 1-byte ``e``."""
    go, recv, report = gos[rank], sock.recv, done.put
    report("ready")
    while go.get():
        count = 0
        while True:
            x = recv(64)
            if len(x) == 64:
                count += 1
            elif x == b"m":
                report("mark")
            else:
                break
        report(count)
