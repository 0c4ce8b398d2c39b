"""This process's CUDA IPC state: ONE object, :data:`state`, holding the lock, the
producer's and the consumer's bookkeeping, the pool of IPC-safe blocks and the
outstanding-block limit.

Every module of this package reads and writes these through :data:`state` (never a copy
of a field), so that resetting it after a fork (:meth:`IpcState.after_fork_in_child`,
registered here) or in a test (:meth:`IpcState.reset`) reaches all of them. A forked
child owns none of its parent's leases: it drops its copies and releases nothing.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from .blocks import BlockPool
from .slots import DEFAULT_IPC_LIMIT

if TYPE_CHECKING:
    from .consumer import Consumer
    from .producer import Producer


class IpcState:
    """The lock and everything it guards, for this process."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.pool = BlockPool(self.lock, self.reclaim)
        self.limit = DEFAULT_IPC_LIMIT
        # What a forked child inherited and must never free: the parent's idle blocks and
        # sent records (freeing them here would reach CUDA in a forked child).
        self.fork_orphans: list[object] = []

    def own_producer(self) -> Producer | None:
        """The producer, if this process made it (not one inherited through fork)."""
        prod = self.producer
        return prod if prod is not None and prod.pid == os.getpid() else None

    def reclaim(self, dev: int) -> None:
        """Out of device memory: free released sent blocks and idle IPC-safe blocks."""
        with self.lock:
            prod = self.own_producer()
            if prod is not None:
                prod.collect()
            self.pool.free_idle(dev)

    def _new_pool(self) -> None:
        self.pool.retire()
        self.pool = BlockPool(self.lock, self.reclaim)

    def after_fork_in_child(self) -> None:
        """Drop the parent's state, closing the fds the child inherited of it."""
        self.lock = threading.RLock()
        self.fork_orphans.append(self.pool)  # the parent's idle blocks: kept, never reused
        self._new_pool()
        prod, self.producer = self.producer, None
        cons, self.consumer = self.consumer, None
        fds: list[int] = []
        if prod is not None:
            fds.extend(prod.drop_fds())
            self.fork_orphans.append(prod)
        if cons is not None:
            fds.extend(cons.drop_fds())
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def reset(self) -> None:
        """Forget all state, closing this process's lease fds (tests only)."""
        with self.lock:
            self._new_pool()
            prod, self.producer = self.producer, None
            cons, self.consumer = self.consumer, None
            if prod is not None:
                prod.close()
            if cons is not None:  # live views' finalizers see a new state and do nothing
                for fd in cons.drop_fds():
                    os.close(fd)
                cons.slots.clear()


state = IpcState()
os.register_at_fork(after_in_child=state.after_fork_in_child)
