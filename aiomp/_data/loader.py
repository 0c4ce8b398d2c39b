"""``aiomp.DataLoader``: torch's ``DataLoader`` names and meanings, async and sync, over an
:class:`aiomp.Pool` of persistent workers that survives them."""

from __future__ import annotations

import atexit
import functools
import secrets
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.abc

from .._loop import running_asyncio_loop, trio_running
from .._loop.taskhost import TaskHost
from .._pool.pool import Pool
from .._process.checks import check_start_method, count
from .._process.placement import slot_envs
from .epoch import Epoch
from .feeds import FeedEpoch
from .handoff import Batches, Handoff
from .sampling import Sampling, batch_count, is_map_style
from .streams import StreamEpoch
from .worker import init as _init_worker

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal


class DataLoader:
    """Batches of ``dataset`` built by ``num_workers`` worker processes.

    ::

        async with aiomp.DataLoader(dataset, 64, shuffle=True) as loader:
            for epoch in range(10):
                async for images, labels in loader:   # one epoch
                    ...

        with aiomp.DataLoader(dataset, 64, shuffle=True) as loader:   # no event loop
            for images, labels in loader:
                ...

    torch's names and meanings: ``dataset`` is map-style (``__getitem__`` and ``__len__``:
    a torch ``Dataset``, a list, an array) or iterable-style (a torch ``IterableDataset`` or
    any object with ``__iter__`` and no ``__getitem__``; each worker runs its own iterator
    and shards it by ``get_worker_info()``, as in torch). ``sampler`` and
    ``batch_sampler`` take torch's samplers; ``shuffle``, ``drop_last``, ``collate_fn``
    (default: :func:`default_collate`, straight into shared memory),
    ``worker_init_fn(worker_id)`` and ``prefetch_factor`` (at most
    ``prefetch_factor * num_workers`` batches requested and not yet handed out) as
    torch's. Workers are persistent: started by ``async with`` / ``with``, kept over
    epochs. ``start_method`` and ``env`` are the Pool's.

    ``seed`` (default: drawn when the loader is made, :attr:`seed`): batch ``k`` of epoch
    ``e`` is built with Python's ``random``, numpy's global RNG and torch's seeded from
    ``(seed, e, k)``, and shuffling is drawn from ``(seed, e)``: one seed, the same
    batches, whatever ``num_workers``.

    Faults: a worker that dies while building a batch is replaced and the batch built
    again, up to ``max_retries`` times, then :class:`aiomp.BrokenWorkerError` names the
    batch (``batch_index``, ``indices``). An exception raised by the dataset or
    ``collate_fn`` is raised here as its own type, the worker's traceback as its
    ``__cause__`` and a note naming the batch. ``timeout`` seconds from the moment a
    worker takes a batch: ``TimeoutError``, the worker replaced. Each of these is raised
    by the step that would have handed the batch out; iterating on gives the later
    batches, and the next epoch is whole.

    Resume: :meth:`state_dict` / :meth:`load_state_dict` (see there).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        shuffle: bool = False,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[list[Any]] | None = None,
        num_workers: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        seed: int | None = None,
        worker_init_fn: Callable[[int], object] | None = None,
        prefetch_factor: int = 2,
        timeout: float | None = None,
        max_retries: int = 2,
        in_order: bool = True,
        start_method: str = "spawn",
        env: Any = None,
    ) -> None:
        num_workers, prefetch_factor = _counts(num_workers, prefetch_factor, timeout, max_retries)
        self.dataset = dataset
        self.map_style = is_map_style(dataset)
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                    "sampler, and drop_last"
                )
            batch_size, drop_last = None, False
        elif batch_size is None:
            raise ValueError("batch_size=None (no batching) is not supported: use batch_size=1")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if not self.map_style and (sampler is not None or batch_sampler is not None or shuffle):
            raise ValueError(
                "DataLoader with an iterable-style dataset: expected unspecified sampler, "
                "batch_sampler and shuffle options"
            )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.timeout = timeout
        self.max_retries = max_retries
        self.in_order = in_order
        #: The seed every batch's RNGs and the shuffling derive from.
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.sampling = (
            Sampling(len(dataset), batch_size, shuffle, sampler, batch_sampler, drop_last)
            if self.map_style
            else None
        )
        check_start_method(start_method)
        envs = slot_envs(env, num_workers)  # TypeError now, as Pool(env=...) raises
        options: dict[str, Any] = {} if envs is None else {"env": envs.__getitem__}
        #: The workers' pool, made when the loader is entered (a pool made here and
        #: never entered would warn of it when collected).
        self._new_pool = functools.partial(
            Pool,
            num_workers,
            initializer=_init_worker,
            initargs=(dataset, num_workers, self.seed, collate_fn, worker_init_fn, _torch_in_use()),
            start_method=start_method,
            **options,
        )
        self._pool: Pool | None = None
        self._host: TaskHost | None = None
        self._next_epoch = 0  # the epoch the next ``async for`` iterates
        self._skip = 0  # batches of it already handed out (resumed)
        self._current: Epoch | StreamEpoch | None = None
        self._skip_sampler = False  # resumed by the user sampler's own state
        #: Batch requests running (of any epoch): leaving with some terminates workers.
        self.in_flight = 0
        self._drained: anyio.Event | None = None  # set when in_flight comes back to 0
        self._portal: BlockingPortal | None = None
        self._portal_cm: Any = None
        self._handoff: Handoff | None = None  # the sync face's current epoch, if any
        self._batches: Batches | None = None  # its iterator

    def __len__(self) -> int:
        """Batches per epoch (a map-style dataset, or an iterable one with ``__len__``)."""
        if self.sampling is not None:
            return len(self.sampling)
        assert self.batch_size is not None
        return batch_count(len(self.dataset), self.batch_size, self.drop_last)

    def __repr__(self) -> str:
        return (
            f"<aiomp.DataLoader {type(self.dataset).__name__} batch_size={self.batch_size} "
            f"num_workers={self.num_workers} seed={self.seed}>"
        )

    @property
    def pool(self) -> Pool:
        """The workers' pool, while the loader is entered."""
        if self._pool is None:
            raise RuntimeError("use `async with loader:` (or `with loader:`) first")
        return self._pool

    # -- epochs and resume -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next ``async for`` / ``for`` iterate ``epoch`` (from its start)."""
        self._next_epoch, self._skip = int(epoch), 0
        self._handoff = None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, as a small picklable dict: ``epoch``, ``batches`` (handed
        out of it so far), ``seed``, and ``sampler`` (a user sampler's ``state_dict()``,
        if it has one). Taken inside an epoch, it points at the next batch of it; taken
        after, at the start of the next epoch."""
        current, handed = self._position()
        if current is not None and not (self.sampling is not None and handed >= len(self.sampling)):
            epoch, batches = current.epoch, handed
        elif current is not None:
            epoch, batches = current.epoch + 1, 0
        else:
            epoch, batches = self._next_epoch, self._skip
        state: dict[str, Any] = {"epoch": epoch, "batches": batches, "seed": self.seed}
        user = None if self.sampling is None else self.sampling.user_sampler()
        if user is not None and hasattr(user, "state_dict"):
            state["sampler"] = user.state_dict()
        return state

    def _position(self) -> tuple[Epoch | StreamEpoch | None, int]:
        """The epoch being iterated (None between epochs) and its batches handed out; in
        sync code, handed to the consumer's thread (not those waiting in the handoff)."""
        handoff = self._handoff
        if handoff is not None and handoff.epoch is not None:
            return (None, 0) if handoff.ended else (handoff.epoch, handoff.base + handoff.taken)
        current = self._current
        return current, 0 if current is None else current.handed_count

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) was taken: the next ``async
        for`` / ``for`` starts at its next batch, with its seed, whatever ``num_workers``.
        The skipped batches are not built (their sample indices are skipped in the
        sampler's order; a user sampler with ``load_state_dict`` is restored instead and
        iterated from where it was). An iterable-style dataset restarts the stored epoch
        from its start (its iterators' positions live in the workers that ran them)."""
        epoch, batches, seed = _checked_state(state, self._batches_per_epoch())
        self.seed = seed
        self._handoff = None
        self._next_epoch = epoch
        self._skip = batches if self.map_style else 0
        user = None if self.sampling is None else self.sampling.user_sampler()
        if "sampler" in state and user is not None and hasattr(user, "load_state_dict"):
            user.load_state_dict(state["sampler"])
            self._skip_sampler = True

    def _batches_per_epoch(self) -> int | None:
        """``len(self)``, or None where it is unknown (an iterable dataset with no len)."""
        try:
            return len(self)
        except TypeError:
            return None

    # -- async -------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (concurrently: returns before they are ready). On failure or
        cancellation nothing is left running."""
        self._pool = pool = self._new_pool()
        await pool.__aenter__()
        host = TaskHost(lambda: None)
        try:
            await host.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await pool.__aexit__(None, None, None)
            self._pool = None
            raise
        self._host = host
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        """Stop the workers. Batches still being built (an epoch left early) are waited
        for up to 5 s, then dropped and their workers terminated (SIGTERM, the Pool's
        grace period, SIGKILL; shielded and bounded). On cancellation or an exception
        from the body: no wait."""
        _, exc, tb = exc_info
        self._abandon()
        host, self._host = self._host, None
        if exc is None and self.in_flight:
            # Nobody will take the batches still being built: let them finish for a
            # while (as torch joins its workers), then stop the workers still busy.
            with anyio.move_on_after(DRAIN_SECONDS):
                while self.in_flight:
                    self._drained = anyio.Event()
                    await self._drained.wait()
            if self.in_flight:
                exc = _Leaving()
        try:
            if host is not None:
                await host.stop(exc)
        finally:
            pool, self._pool = self.pool, None
            await pool.__aexit__(type(exc) if exc else None, exc, tb)

    def __aiter__(self) -> Epoch | StreamEpoch:
        """The next epoch (or the one :meth:`set_epoch` named), as an async iterator."""
        if self._host is None:
            raise RuntimeError("use `async with loader:` (or `with loader:`) before iterating")
        self._abandon()
        epoch, skip = self._next_epoch, self._skip
        self._next_epoch, self._skip = epoch + 1, 0
        current: Epoch | StreamEpoch
        if self.sampling is None:
            current = StreamEpoch(self, epoch)
        else:
            from_sampler, self._skip_sampler = self._skip_sampler, False
            batches = self.sampling.batches(self.seed, epoch, 0 if from_sampler else skip)
            # Per-slot feed tasks; with timeout=, a Pool task per batch (the Pool times it).
            kind = Epoch if self.timeout is not None else FeedEpoch
            current = kind(self, epoch, skip, batches)
        self._current = current
        return current

    def _abandon(self) -> None:
        """Drop the epoch left early, if any: its batches in flight are discarded."""
        if self._current is not None:
            self._current.close()
            self._current = None

    def host_tg(self) -> anyio.abc.TaskGroup:
        assert self._host is not None and self._host.tg is not None
        return self._host.tg

    def fetched(self) -> None:
        """Called as a batch request (or a shard) ends."""
        self.in_flight -= 1
        if not self.in_flight and self._drained is not None:
            self._drained.set()

    def finished(self, epoch: Epoch | StreamEpoch) -> None:
        """Called by ``epoch`` at its end."""
        if self._current is epoch:
            self._current = None

    # -- sync --------------------------------------------------------------------------
    def __enter__(self) -> Self:
        """Start the workers for a program with no event loop: the loader's async side
        runs on a private event loop in a thread, which this thread waits for."""
        if running_asyncio_loop() is not None or trio_running():
            raise RuntimeError(
                "`with loader:` blocks its thread: in async code use `async with loader:`"
            )
        from anyio.from_thread import start_blocking_portal

        cm = start_blocking_portal()
        portal = cm.__enter__()
        try:
            portal.call(self.__aenter__)
        except BaseException as exc:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._portal, self._portal_cm = portal, cm
        _opened(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Stop the workers as ``async with`` does, then the private loop. An iterator
        still referenced (``it = iter(loader)``, unfinished) is stopped first."""
        portal, cm = self._portal, self._portal_cm
        self._portal = self._portal_cm = None
        _OPEN.discard(self)
        if portal is None:
            return
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()
        if self._handoff is not None:
            self._handoff.items.clear()  # batches nobody will take
        try:
            portal.call(self.__aexit__, *exc_info)
        finally:
            cm.__exit__(None, None, None)

    def __iter__(self) -> Batches:
        """One epoch, for a sync loop (inside ``with loader:``). A pump task on the private
        loop moves the epoch's batches to this thread through a :class:`Handoff` (at most
        ``max(2, num_workers)`` batches wait there). A batch's error is raised here, and
        iterating on gives the later batches; leaving the loop early stops the pump."""
        portal = self._portal
        if portal is None:
            raise RuntimeError("use `with loader:` before iterating in sync code")
        if self._batches is not None:
            self._batches.close()  # the epoch left early: its pump stops
        self._handoff = handoff = Handoff(max(2, self.num_workers))
        self._batches = Batches(handoff, portal.start_task_soon(handoff.pump, self.__aiter__))
        return self._batches


#: How long leaving the loader waits for batches still being built before it stops their
#: workers (torch's loader joins its workers for 5 s before terminating them).
DRAIN_SECONDS = 5.0


#: The loaders entered by ``with`` (or a first ``for``) and not yet left.
_OPEN: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def _opened(loader: DataLoader) -> None:
    """Record ``loader`` as entered by ``with``. The first time: register
    :func:`_close_at_exit`, now that the workers have started (and aiomp's own exit hooks,
    and multiprocessing's, are registered): ``atexit`` runs it before them."""
    global _HOOKED
    if not _HOOKED:
        # weakref.finalize registers its own exit hook (which closes an epoch's queues)
        # with its first use: make sure it is registered before ours, so ours runs first.
        weakref.finalize(_close_at_exit, int).atexit = False
        atexit.register(_close_at_exit)
        _HOOKED = True
    _OPEN.add(loader)


_HOOKED = False


def _close_at_exit() -> None:
    """Leave each sync loader still open, as ``with`` would, before the interpreter tears
    down the modules its batches and threads need, and before aiomp's exit hook kills
    their workers."""
    for loader in list(_OPEN):
        try:
            loader.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - nothing to tell at exit; the workers die anyway
            pass


class _Leaving(Exception):
    """What the loader's block is left with when it is left normally: the Pool must not
    wait for batches nobody will take."""


def _torch_in_use() -> bool:
    """Whether this program uses torch (has imported it): its workers then load torch as
    they start, so that its RNG is seeded for every batch (even a dataset importing torch
    only in ``__getitem__``) and batches are collated as torch's."""
    return "torch" in sys.modules


def _checked_state(state: object, per_epoch: int | None) -> tuple[int, int, int]:
    """``(epoch, batches, seed)`` of a state dict, or ValueError naming its bad field."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a DataLoader state must be a dict, not {type(state).__name__}")
    got = []
    for field in ("epoch", "batches", "seed"):
        if field not in state:
            raise ValueError(f"DataLoader state: the field {field!r} is missing")
        value = state[field]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"DataLoader state: {field!r} must be an int, not {type(value).__name__}"
            )
        if field != "seed" and value < 0:
            raise ValueError(f"DataLoader state: {field!r} must be at least 0, not {value}")
        got.append(value)
    if per_epoch is not None and got[1] > per_epoch:
        raise ValueError(
            f"DataLoader state: 'batches' is {got[1]}, past the {per_epoch} batches of an epoch"
        )
    return got[0], got[1], got[2]


def _counts(
    num_workers: object, prefetch_factor: object, timeout: float | None, retries: int
) -> tuple[int, int]:
    """``num_workers`` and ``prefetch_factor`` as ints >= 1 (a float or a string is a
    TypeError, as Python's pools raise), once all four options are checked."""
    try:
        workers = count("num_workers", num_workers)
    except ValueError as exc:
        exc.add_note("(loading in the consumer, as torch's 0 does, would block its loop)")
        raise
    prefetch = count("prefetch_factor", prefetch_factor)
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive or None, not {timeout}")
    if retries < 0:
        raise ValueError(f"max_retries must be at least 0, not {retries}")
    return workers, prefetch
