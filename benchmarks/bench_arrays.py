"""Arrays through a queue: already shared (4 KiB to 256 MiB), and fresh (256 MiB).

Run as ``python -m benchmarks.bench_arrays``. Parent on one core, the child on the other.
Each sample is a put of the array and the child's tiny ack coming back (the child drops
the array before it acks, so the parent may recycle its memory). The aiomp parent awaits;
both children block (aiomp's through ``q.sync``, torch's on its queue), like for like.

- Already shared (``aiomp.zeros(...)``): the 256 MiB round trip within 2x of the 4 KiB one;
  vs ``torch.multiprocessing.Queue`` carrying a ``share_memory_()``'d float32 tensor of
  the same size (torch's default ``file_descriptor`` strategy): aiomp >= 3x faster.
- Fresh (a plain 256 MiB numpy array, so every put copies it into shared memory): at most
  2x one ``np.copyto`` of 256 MiB into memory that is already mapped and touched.
"""

from __future__ import annotations

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import ack_aiomp_sync, ack_torch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

KiB, MiB = 1 << 10, 1 << 20
SHARED_SIZES = (4 * KiB, 1 * MiB, 256 * MiB)
FRESH_SIZE = 256 * MiB


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


class AiompLink:
    """One child receiving from ``qin`` and acking on ``qout``."""

    async def start(self) -> None:
        import aiomp

        self.qin, self.qout = aiomp.Queue(), aiomp.Queue()
        self.ctx = await aiomp.spawn(
            ack_aiomp_sync, 1, args=(self.qin, self.qout), grace_period=1.0
        )

    async def stop(self) -> None:
        await self.qin.put(None)
        await h.end_spawn(self.ctx, 10)


class AiompSend(h.Variant):
    def __init__(self, link: AiompLink, nbytes: int, shared: bool) -> None:
        self.link, self.nbytes, self.shared = link, nbytes, shared
        self.name = f"aiomp {'shared' if shared else 'fresh'} {size_name(nbytes)}"

    async def start(self) -> None:
        import numpy as np

        import aiomp

        n = self.nbytes // 4
        if self.shared:
            self.arr = aiomp.zeros(n, dtype=np.float32)
            assert aiomp.is_shared(self.arr)
        else:
            self.arr = np.ones(n, dtype=np.float32)  # touched: no page faults left to pay
            assert not aiomp.is_shared(self.arr)
        self.put, self.get = self.link.qin.put, self.link.qout.get

    async def once(self) -> None:
        await self.put(self.arr)
        await self.get()


class TorchLink:
    async def start(self) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.qin, self.qout = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=ack_torch, args=(self.qin, self.qout), daemon=True)
        self.proc.start()
        assert self.qout.get(timeout=120) == b"ready"

    async def stop(self) -> None:
        self.qin.put(None)
        h.reap(self.proc, 10)


class TorchSend(h.Variant):
    is_async = False

    def __init__(self, link: TorchLink, nbytes: int) -> None:
        self.link, self.nbytes = link, nbytes
        self.name = f"torch shared {size_name(nbytes)}"

    async def start(self) -> None:
        import torch

        self.t = torch.zeros(self.nbytes // 4, dtype=torch.float32).share_memory_()
        self.put, self.get = self.link.qin.put, self.link.qout.get

    def once_sync(self) -> None:
        self.put(self.t)
        self.get()


class Memcpy(h.Variant):
    """One np.copyto of the whole array into shared memory already mapped and touched."""

    is_async = False

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.name = f"memcpy {size_name(nbytes)}"

    async def start(self) -> None:
        import mmap

        import numpy as np

        self.mm = mmap.mmap(-1, self.nbytes)  # MAP_SHARED | MAP_ANONYMOUS: shmem, like aiomp's
        self.dst = np.frombuffer(self.mm, dtype=np.float32)
        self.dst.fill(0)
        self.src = np.ones(self.nbytes // 4, dtype=np.float32)

    def once_sync(self) -> None:
        import numpy as np

        np.copyto(self.dst, self.src)

    async def stop(self) -> None:
        del self.dst
        self.mm.close()


def shared_rows(med: dict[str, float], what: str, note: str) -> list[dict[str, Any]]:
    """The rows of already shared ``what`` (array, tensor): the largest against the
    smallest, and each size against torch's queue carrying a shared tensor."""
    small, big = SHARED_SIZES[0], SHARED_SIZES[-1]
    aiomp = {n: med.get(f"aiomp shared {size_name(n)}") for n in SHARED_SIZES}
    flat = f"aiomp, shared {size_name(small)} {what}"
    what_big = f"shared {size_name(big)} {what} put -> child ack"
    rows = [c.row(what_big, aiomp[big], aiomp[small], flat, c.at_most(2), note)]
    for n in SHARED_SIZES:
        name, target = size_name(n), c.faster(3) if n == big else None
        torch_q = f"torch.mp.Queue, shared {name} tensor"
        what_n = f"shared {name} {what} put -> child ack"
        rows.append(c.row(what_n, aiomp[n], med.get(f"torch shared {name}"), torch_q, target, note))
    return rows


def fresh_row(med: dict[str, float], what: str, target: Any, note: str) -> dict[str, Any]:
    """The row of a fresh ``what`` (array, tensor) against one memcpy of it."""
    name = size_name(FRESH_SIZE)
    copy, aiomp = f"one np.copyto of {name} into mapped memory", med.get(f"aiomp fresh {name}")
    what = f"fresh {name} {what} put -> child ack"
    return c.row(what, aiomp, med[f"memcpy {name}"], copy, target, note)


async def measure(
    links: list[Any], shared: list[h.Variant], fresh: list[h.Variant], fresh_reps: tuple[int, ...]
) -> dict[str, float]:
    """Start ``links``, then time the ``shared`` variants (:func:`shared_reps`) and the
    ``fresh`` ones (``fresh_reps``: batches, puts a batch, warm-up puts); the medians by
    name."""
    started = []
    try:
        for ln in links:
            await ln.start()
            started.append(ln)
        s = await h.interleave(shared, *shared_reps(), warmup=20)
        s.update(await h.interleave(fresh, *fresh_reps))
    finally:
        for ln in reversed(started):
            await ln.stop()
    return {k: c.median(v) for k, v in s.items()}


def shared_reps() -> tuple[int, int]:
    return c.reps(6, 2), c.reps(200, 50)


async def main() -> None:
    pinning = c.pin_parent()
    missing = c.aiomp_missing("_spawn", "_queue", "_arrays", "_memory")
    has_torch = c.have("torch")
    links: list[AiompLink | TorchLink] = []
    shared: list[h.Variant] = []
    fresh: list[h.Variant] = [Memcpy(FRESH_SIZE)]
    if missing is None:
        links.append(link := AiompLink())
        shared += [AiompSend(link, n, True) for n in SHARED_SIZES]
        fresh.append(AiompSend(link, FRESH_SIZE, False))
    if has_torch:
        links.append(tlink := TorchLink())
        shared += [TorchSend(tlink, n) for n in SHARED_SIZES]
    fb, fn = c.reps(5, 2), c.reps(4, 2)
    med = await measure(links, shared, fresh, (fb, fn, 3))
    rows = shared_rows(med, "array", missing or ("" if has_torch else "torch not installed"))
    rows.append(fresh_row(med, "array", c.at_most(2), missing or ""))
    batches, n = shared_reps()
    notes = [
        f"arrays: {pinning}; async aiomp parent, blocking children; float32; shared: median "
        f"of up to {batches * n} round trips "
        f"per size in {batches} alternating batches; fresh: median of {fb * fn} after "
        "3 warm-up puts (the first fresh puts allocate and fault in segments; steady state "
        "recycles them)."
    ]
    if has_torch:
        import torch

        notes.append(f"torch sharing strategy: {torch.multiprocessing.get_sharing_strategy()}")
    else:
        notes.append("torch not installed: torch rows skipped")
    c.emit("arrays", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
