"""The sync face of :class:`aiomp.DataLoader`: ``with loader:`` and ``for batch in loader``
in a program with no event loop.

The loader's async side runs on a private event loop in a thread (anyio's blocking
portal); an epoch's batches reach the consumer's thread through a
:class:`~.handoff.Handoff`. A ``for`` with no ``with`` starts the workers, as torch's
loader does; they persist until :meth:`SyncFace.close` or the program's exit
(:func:`~.handoff.opened` closes it then, before aiomp's own exit hook), or its
collection: its epochs hold it weakly, its iterator strongly (it lives while a ``for``
runs), so dropped, it is collected at once and stops its workers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

# With the loader (as torch's DataLoader imports its machinery), not on the first batch's
# path (20 ms; issue 39, "Speed from the first batch").
from anyio.from_thread import start_blocking_portal

from .._loop import running_asyncio_loop, trio_running
from .._process.checks import waiting_for_start
from . import options as _options
from .handoff import OPEN, Batches, Handoff, opened
from .local import LocalEpoch

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

    from .epoch import MapEpoch
    from .sampling import Sampling
    from .streams import StreamEpoch


class SyncFace:
    """The sync methods of :class:`aiomp.DataLoader` (a base of it; its state is the
    loader's)."""

    num_workers: int
    _portal: BlockingPortal | None
    _portal_cm: Any
    _handoff: Handoff | None
    _batches: weakref.ref[Batches] | None
    sampling: Sampling | None
    dataset: Any
    _reported_len: int | None

    if TYPE_CHECKING:  # the loader's, used here

        def _open_epoch(self) -> MapEpoch | StreamEpoch | LocalEpoch: ...
        def _abandon(self) -> None: ...
        async def __aenter__(self) -> Self: ...
        async def __aexit__(self, *exc_info: Any) -> None: ...

    def __enter__(self) -> Self:
        """Start the workers for a program with no event loop: the loader's async side
        runs on a private event loop in a thread, which this thread waits for."""
        if self.num_workers == 0 or self._portal is not None:
            return self
        if running_asyncio_loop() is not None or trio_running():
            raise RuntimeError(
                "`with loader:` blocks its thread: in async code use `async with loader:`"
            )
        cm = start_blocking_portal()
        portal = cm.__enter__()
        try:
            with waiting_for_start():  # this thread waits: a fork has nothing to fear of it
                portal.call(self.__aenter__)
        except BaseException as exc:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._portal, self._portal_cm = portal, cm
        opened(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Stop the workers as ``async with`` does, then the private loop. An iterator
        still referenced (``it = iter(loader)``, unfinished) is stopped first."""
        portal, cm = self._portal, self._portal_cm
        self._portal = self._portal_cm = None
        OPEN.discard(self)
        if portal is None:
            self._abandon()
            return
        self._close_batches()
        try:
            portal.call(self.__aexit__, *exc_info)
        finally:
            # Stop the private loop, cancelling what is left on it (a pump whose iterator
            # was collected in a cycle before the loader), never waiting for it: given an
            # exception, the portal's context manager cancels its remaining tasks.
            stop = _Stop()
            cm.__exit__(_Stop, stop, None)
            if self._handoff is not None:
                self._handoff.items.clear()  # batches nobody will take

    def __iter__(self) -> Batches | LocalEpoch:
        """One epoch, for a sync loop. As torch's, it needs no ``with``: the first
        iteration starts the workers, which persist until :meth:`close` or the program's
        exit. A pump task on the private loop moves the
        epoch's batches to this thread through a :class:`Handoff` (at most ``max(2,
        num_workers)`` batches wait there). A batch's error is raised here, and iterating
        on gives the later batches; leaving the loop early stops the pump."""
        if self.num_workers == 0:
            epoch = self._open_epoch()
            assert isinstance(epoch, LocalEpoch)
            return epoch
        if self._portal is None:
            self.__enter__()
        portal = self._portal
        assert portal is not None
        self._close_batches()  # the epoch left early: its pump stops
        self._handoff = handoff = Handoff(max(2, self.num_workers))
        pump = portal.start_task_soon(handoff.pump, _opener(weakref.ref(self)))
        # The iterator holds the loader (``for b in DataLoader(...)`` keeps it alive), the
        # loader holds the iterator weakly: dropping both collects the loader at once.
        batches = Batches(handoff, pump, self, self._length_watch())
        self._batches = weakref.ref(batches)
        return batches

    def _length_watch(self) -> _options.LengthWatch | None:
        """What counts the batches of an iterable dataset's next iterator (None for a
        map-style dataset, whose length is its sampler's)."""
        if self.sampling is not None:
            return None
        return _options.LengthWatch(self._reported_len, self.num_workers, self.dataset)

    def _close_batches(self) -> None:
        """Stop the pump of the current sync iterator, if any."""
        ref, self._batches = self._batches, None
        batches = None if ref is None else ref()
        if batches is not None:
            batches.close()

    def _workers_epoch(self) -> MapEpoch | StreamEpoch:
        epoch = self._open_epoch()
        assert not isinstance(epoch, LocalEpoch)
        return epoch

    def close(self) -> None:
        """Stop the workers a ``for`` started (as leaving ``with loader:`` does)."""
        self.__exit__(None, None, None)

    def __del__(self) -> None:
        # Collected with its workers running (a ``for`` with no ``with``): stop them, as
        # torch's loader does, unless collected on an event loop's thread (then at exit).
        if self.__dict__.get("_portal") is not None and running_asyncio_loop() is None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing to tell from a finalizer
                pass


def _opener(ref: weakref.ref[SyncFace]) -> Callable[[], MapEpoch | StreamEpoch]:
    """What the pump calls to open its epoch, holding the loader weakly (so that no
    reference from the private loop's thread keeps a dropped loader alive)."""

    def open_epoch() -> MapEpoch | StreamEpoch:
        loader = ref()
        if loader is None:
            raise RuntimeError("aiomp.DataLoader: the loader was collected")
        return loader._workers_epoch()

    return open_epoch


class _Stop(Exception):
    """Thrown into the private loop's context manager as the loader leaves, so that it
    cancels its remaining tasks (it returns without raising it)."""
