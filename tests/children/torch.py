"""Functions that ``tests/arrays/test_torch.py``'s children run.

Standard library only at module level (children unpickle their function from here);
torch is imported inside the functions, as a user's worker would.
"""

from __future__ import annotations

from typing import Any


def add_inplace(rank: int, t: Any, value: float) -> None:
    """Hogwild-style: write into a tensor given in spawn args (each rank its own row)."""
    t[rank].add_(value + rank)


def make_tensors(rank: int, n: int) -> tuple[Any, Any, Any]:
    """Return a fresh large tensor, a view of it and a small one; the child then exits."""
    import torch

    big = torch.arange(n, dtype=torch.float32)
    return big, big[10:20], torch.arange(5, dtype=torch.int16)


def put_then_exit(rank: int, q: Any, n: int) -> None:
    """Put tensors and return at once: the process exits before the parent reads them."""
    import torch

    shared = torch.full((n,), 3.0).share_memory_()
    q.sync.put((shared, torch.arange(n, dtype=torch.float64), torch.ones(3)))


def file_system_pair(rank: int, q: Any, reply: Any) -> object:
    """Rank 0 shares a tensor under torch's ``file_system`` strategy and sends it with a
    view of it; rank 1 checks what arrived and writes into it; rank 0 sees the write."""
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    if rank == 0:
        t = torch.zeros(100_000).share_memory_()
        q.sync.put((t, t[10:]))
        assert reply.sync.get(timeout=60) == "written"
        return float(t[0]), float(t[15])
    got, tail = q.sync.get(timeout=60)
    try:
        got.untyped_storage()._get_shared_fd()
        by_fd = True
    except RuntimeError:
        by_fd = False
    same = got.untyped_storage().data_ptr() == tail.untyped_storage().data_ptr()
    got[0] = 7.0
    tail[5] = 8.0
    reply.sync.put("written")
    return got.is_shared(), by_fd, same, tail.storage_offset()


def scale_(t: Any, factor: float) -> Any:
    """A Pool task: scale ``t`` in place, return a fresh tensor (sent back shared)."""
    t.mul_(factor)
    return t * 0 + float(t.sum())


def cuda_send(rank: int, q: Any, back: Any) -> Any:
    """Put a CUDA tensor; hold it until the consumer reports (torch's producer rule)."""
    import torch

    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    q.sync.put(t)
    return back.sync.get(timeout=60)


def cuda_check(rank: int, q: Any, back: Any) -> tuple[str, bool, str]:
    """Receive the CUDA tensor, check it in place, and try to send it onward (refused)."""
    import torch

    got = q.sync.get(timeout=60)
    same = bool(torch.equal(got.cpu(), torch.arange(1000, dtype=torch.float32)))
    try:
        q.sync.put(got)
        onward = "sent"
    except RuntimeError as exc:
        onward = str(exc)
    report = (got.device.type, same, onward)
    del got
    back.sync.put(report)
    return report
