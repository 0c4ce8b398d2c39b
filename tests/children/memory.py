"""Functions that the shared-memory tests (tests/memory/) and the chaos suite run in children.

Kept apart from ``tests.children.common`` (shared by every area). Standard library (and that
module) only at
module level: spawn children import this module to unpickle their function.
"""

from __future__ import annotations

import os

from tests.children.common import block_forever, fd_count


def drain(rank: int, q: object, n: int, strategy: str) -> list[int]:
    """Take ``n`` arrays and return each one's first value."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    seen = []
    for _ in range(n):
        arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        seen.append(int(arr[0]))
        del arr
    return seen


def put_unread_and_wait(rank: int, q: object, ready: object, strategy: str) -> None:
    """Put a shared array on ``q`` that nobody will read, say ready, and wait to die."""
    import signal

    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    q.sync.put(np.full(200_000, rank, np.float64))  # type: ignore[attr-defined]
    ready.sync.put(os.getpid())  # type: ignore[attr-defined]
    while True:
        signal.pause()


def signal_then_wait(started: object, go: object) -> bool:
    """Pool task: say it runs, then wait for ``go`` (keeps its worker busy)."""
    started.set()  # type: ignore[attr-defined]
    return bool(go.sync.wait(timeout=60))  # type: ignore[attr-defined]


def nbytes(arr: object) -> int:
    return int(arr.nbytes)  # type: ignore[attr-defined]


def shm_inspect(rank: int, *args: object) -> list[object]:
    """Describe each argument: for an array ``(is_shared, writeable, dtype, shape,
    strides, checksum bytes)``; containers recursively; others as they are."""
    import aiomp

    def describe(obj: object) -> object:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return (
                "array",
                aiomp.is_shared(obj),
                obj.flags.writeable,
                obj.dtype.str,
                obj.shape,
                obj.strides,
                obj.tobytes(),
            )
        if isinstance(obj, dict):
            return {k: describe(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(describe(v) for v in obj)
        return obj

    return [describe(a) for a in args]


def shm_stripe(rank: int, nprocs: int, w: object, flag: object, q: object, go: object) -> float:
    """Hogwild-style: write into this rank's stripe of the shared ``w``, both as received
    in args and as received from ``q`` (the same memory); then, once ``go`` is set, return
    what the parent wrote into the shared ``flag`` after this process started."""
    w_from_queue = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    w[rank::nprocs] = rank + 1  # type: ignore[index]
    w_from_queue[rank::nprocs] += 100  # type: ignore[index]
    assert go.sync.wait(timeout=20)  # type: ignore[attr-defined]
    return float(flag[0])  # type: ignore[index]


def shm_return_arrays(rank: int, n: int, strategy: str) -> dict[str, object]:
    """Return fresh arrays (shared, and not yet shared) to the parent."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    shared = aiomp.zeros(n, np.int64)
    shared[:] = np.arange(n) * (rank + 1)
    return {
        "plain": np.arange(n, dtype=np.float32) + rank,
        "shared": shared,
        "small": np.arange(3) + rank,
    }


def shm_write_marks(rank: int, q: object, reply: object) -> None:
    """For every array received, write ``rank + 1`` at index 0 and ack with its id."""
    for arr, token in q.sync:  # type: ignore[attr-defined]
        arr[0] = rank + 1
        reply.sync.put(token)  # type: ignore[attr-defined]
        del arr


def shm_views(rank: int, q: object, reply: object) -> dict[str, object]:
    """Receive two messages naming the same segments; report how they were mapped.

    The first message is ``(a, a[10:], b, x[:600], x[400:])``, the second ``a`` again.
    """
    import numpy as np

    a, a_tail, b, x_head, x_tail = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    a2 = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    with open("/proc/self/maps") as f:
        maps = [line for line in f if "aiomp-shm" in line or "/dev/shm/aiomp" in line]
    out = {
        "a_tail_is_view_of_a": bool(np.shares_memory(a, a_tail)) and a_tail.base is a.base,
        "a_again_same_memory": bool(np.shares_memory(a, a2)),
        "a_again_same_base": a2.base is a.base,
        "a_b_separate": not np.shares_memory(a, b),
        "x_views_share_one_buffer": bool(np.shares_memory(x_head, x_tail)),
        "mappings": len(maps),
    }
    x_head[500] = -2.0  # seen through x_tail[100]
    out["x_write_seen_through_other_view"] = bool((x_tail[100] == -2.0).all())
    a_tail[0] = -1.0  # seen by the parent through a[10]
    reply.sync.put(out)  # type: ignore[attr-defined]
    return out


def shm_send_then_exit(rank: int, q: object, n: int, strategy: str) -> None:
    """Put arrays and return at once: the process exits before the parent reads them."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    q.sync.put(np.arange(n, dtype=np.float64))  # type: ignore[attr-defined]
    shared = aiomp.share_memory(np.full(n, 7, np.int32))
    q.sync.put(shared)  # type: ignore[attr-defined]
    q.sync.put([np.arange(2 * n, dtype=np.int16)[::2], "tail"])  # type: ignore[attr-defined]


def shm_send_and_wait(rank: int, q: object, received: object, n: int) -> None:
    """Under ``file_system``: put an array, wait until the parent has it, then exit."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy("file_system")
    q.sync.put(np.arange(n, dtype=np.float64))  # type: ignore[attr-defined]
    assert received.sync.wait(timeout=20)  # type: ignore[attr-defined]


def shm_make_named(rank: int) -> int:
    """Create a named segment under ``file_system`` and return normally, keeping nothing."""
    import aiomp

    aiomp.set_sharing_strategy("file_system")
    arr = aiomp.zeros(1000)
    del arr
    return len([n for n in os.listdir("/dev/shm") if n.startswith(f"aiomp-{os.getpid()}-")])


def shm_echo_many(rank: int, qin: object, qout: object) -> tuple[int, int]:
    """Echo arrays until ``qin`` is closed; return (fds at the first item, most fds seen)."""
    first = most = 0
    for i, arr in enumerate(qin.sync):  # type: ignore[attr-defined]
        qout.sync.put(arr)  # type: ignore[attr-defined]
        del arr
        n = fd_count()
        if i == 0:
            first = n
        most = max(most, n)
    return first, most


def shm_hold_named_then_block(rank: int, ready: object, n: int) -> None:
    """Create named segments under ``file_system``, hold them, say ready, and block."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy("file_system")
    held = [aiomp.zeros(n, np.uint8), aiomp.share_memory(np.ones(3 * n, np.uint8))]
    ready.sync.put(
        sorted(  # type: ignore[attr-defined]
            name for name in os.listdir("/dev/shm") if name.startswith(f"aiomp-{os.getpid()}-")
        )
    )
    block_forever()
    del held
