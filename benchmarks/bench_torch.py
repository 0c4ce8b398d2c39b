"""torch tensors through a queue: already shared (4 KiB to 256 MiB), and fresh (256 MiB).

Run as ``python -m benchmarks.bench_torch``. Parent on one core, the child on the other.
Each sample is a put of the tensor and the child's tiny ack coming back (the child drops
the tensor before it acks). The aiomp parent awaits; both children block (aiomp's
through ``q.sync``, torch's on its queue), like for like.

- Already shared (``share_memory_()``'d float32): the 256 MiB round trip within 2x of the
  4 KiB one (flat in size), and at least 3x faster than ``torch.multiprocessing.Queue``
  carrying the same tensor (torch's default ``file_descriptor`` strategy: its fd goes
  through a listener thread in the sender, the resource sharer).
- Fresh (a plain 256 MiB tensor, touched): aiomp moves it into shared memory in place, as
  torch does, so every put pays a new segment's page faults. Compared with one memcpy of
  256 MiB into mapped memory, and with ``torch.multiprocessing.Queue`` sending a fresh
  tensor (the same move). The fresh tensors are made between timed puts.
"""

from __future__ import annotations

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks.bench_arrays import (
    FRESH_SIZE,
    SHARED_SIZES,
    AiompLink,
    Memcpy,
    TorchLink,
    TorchSend,
    fresh_row,
    measure,
    shared_reps,
    shared_rows,
    size_name,
)


class Fresh(h.Variant):
    """Puts a fresh, touched tensor each time; they are made outside the timed calls."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fresh: list[object] = []

    def make(self, n: int) -> None:
        import torch

        self.fresh = [torch.ones(self.nbytes // 4, dtype=torch.float32) for _ in range(n)]
        assert not any(t.is_shared() for t in self.fresh)  # type: ignore[attr-defined]

    async def batch(self, n: int) -> list[float]:
        self.make(n)
        try:
            return await super().batch(n)
        finally:
            self.fresh.clear()


class AiompTensor(Fresh):
    def __init__(self, link: AiompLink, nbytes: int, shared: bool) -> None:
        super().__init__(nbytes)
        self.link, self.shared = link, shared
        self.name = f"aiomp {'shared' if shared else 'fresh'} {size_name(nbytes)}"

    async def start(self) -> None:
        import torch

        self.t = torch.zeros(self.nbytes // 4, dtype=torch.float32).share_memory_()
        self.put, self.get = self.link.qin.put, self.link.qout.get

    async def batch(self, n: int) -> list[float]:
        return await (Fresh.batch(self, n) if not self.shared else h.Variant.batch(self, n))

    async def once(self) -> None:
        await self.put(self.t if self.shared else self.fresh.pop())
        await self.get()


class TorchFresh(Fresh):
    is_async = False

    def __init__(self, link: TorchLink, nbytes: int) -> None:
        super().__init__(nbytes)
        self.link = link
        self.name = f"torch fresh {size_name(nbytes)}"

    async def start(self) -> None:
        self.put, self.get = self.link.qin.put, self.link.qout.get

    def once_sync(self) -> None:
        t = self.fresh.pop()
        self.put(t)
        self.get()
        del t


async def main() -> None:
    if not c.have("torch"):
        rows = [c.row("torch tensors", None, None, "—", None, "torch not installed")]
        c.emit("torch", rows, ["torch not installed: nothing measured"])
        return
    import torch

    pinning = c.pin_parent()
    missing = c.aiomp_missing("_spawn", "_queue", "_arrays.torch")
    tlink, link = TorchLink(), AiompLink()
    links: list[AiompLink | TorchLink] = [tlink]
    shared: list[h.Variant] = [TorchSend(tlink, n) for n in SHARED_SIZES]
    fresh: list[h.Variant] = [Memcpy(FRESH_SIZE), TorchFresh(tlink, FRESH_SIZE)]
    if missing is None:
        links.append(link)
        shared += [AiompTensor(link, n, True) for n in SHARED_SIZES]
        fresh.append(AiompTensor(link, FRESH_SIZE, False))
    fb, fn = c.reps(3, 2), c.reps(2, 1)
    med = await measure(links, shared, fresh, (fb, fn, 1))
    fname = size_name(FRESH_SIZE)
    rows = shared_rows(med, "tensor", missing or "")
    in_place = missing or "moved in place into a new segment, as torch does"
    rows.append(fresh_row(med, "tensor", None, in_place))
    base = f"torch.mp.Queue, fresh {fname} tensor"
    a, b = med.get(f"aiomp fresh {fname}"), med.get(f"torch fresh {fname}")
    what = f"fresh {fname} tensor put -> child ack"
    rows.append(c.row(what, a, b, base, c.at_most(1.2), missing or ""))
    batches, n = shared_reps()
    notes = [
        f"torch: {pinning}; async aiomp parent, blocking children; float32; shared: median "
        f"of up to {batches * n} round trips per size in {batches} alternating batches; "
        f"fresh: median of {fb * fn} puts, each of a new touched tensor made before the "
        f"timed call; torch sharing strategy: {torch.multiprocessing.get_sharing_strategy()}."
    ]
    c.emit("torch", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
