"""The lease slots of one CUDA producer: a slot per sent block, kept until released.

:class:`SlotTable` owns the *slot file*, a small memfd whose byte ``n`` stands for slot
``n``: each message in flight (through its handoff description) and each consumer holding
a view takes an OFD lease on the slot's byte, and the producer frees a slot once the
kernel reports no lease on it (:meth:`SlotTable.collect`), SIGKILLed holders included.
No CUDA here: a record is whatever the caller keeps alive.
"""

from __future__ import annotations

import heapq
import os
from typing import Generic, TypeVar

from .._errors import IpcLimitError
from .._memory import lease as _lease
from .meta import held_ranges

#: Blocks a process may have sent and not yet seen released, unless changed with
#: :func:`aiomp.cuda.set_ipc_limit`.
DEFAULT_IPC_LIMIT = 1000

R = TypeVar("R")


class SlotTable(Generic[R]):
    """Slots of one producer lease file and the record kept alive for each sent slot.

    No CUDA here: a record is whatever the caller keeps alive. Not thread-safe (the
    producer serialises calls).
    """

    def __init__(self, limit: int = DEFAULT_IPC_LIMIT) -> None:
        self.fd = os.memfd_create("aiomp-cuda-lease", os.MFD_CLOEXEC)
        self.ident = _lease.identity(self.fd)
        self.limit = limit
        self.records: dict[int, R] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first keeps ranges short
        self._next = 0

    def __len__(self) -> int:
        return len(self.records)

    def allocate(self, record: R) -> int:
        """A free slot for ``record``; IpcLimitError when ``limit`` slots are outstanding.

        The caller must hold the slot's lease (through a handoff description) before
        the next :meth:`collect`, which otherwise frees it at once.
        """
        self.check_room()
        slot = heapq.heappop(self._free) if self._free else self._next
        if slot == self._next:
            self._next += 1
        self.records[slot] = record
        return slot

    def check_room(self) -> None:
        """Raise IpcLimitError if no slot may be allocated."""
        if len(self.records) >= self.limit:
            raise IpcLimitError(
                f"{len(self.records)} CUDA blocks sent by this process are still held by "
                f"their consumers (the limit is {self.limit}): consumers must drop the "
                "arrays they received (or copy them) before more can be sent. Wait for "
                "them (for example for a reply), then retry; or raise the limit with "
                "aiomp.cuda.set_ipc_limit()"
            )

    def discard(self, slot: int) -> R:
        """Forget ``slot`` now (a send that failed before its lease was taken)."""
        record = self.records.pop(slot)
        heapq.heappush(self._free, slot)
        return record

    def collect(self) -> list[R]:
        """Free every slot that no description holds; returns their records."""
        if not self.records:
            return []
        held = held_ranges(self.fd, 0, self._next)
        released: list[R] = []
        i = 0
        for slot in sorted(self.records):
            while i < len(held) and held[i][1] <= slot:
                i += 1
            if i < len(held) and held[i][0] <= slot:
                continue
            released.append(self.records.pop(slot))
            heapq.heappush(self._free, slot)
        if not self.records:  # all free: start again from slot 0
            self._free.clear()
            self._next = 0
        return released

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
