"""``aiomp.DataLoader``: torch's ``DataLoader`` names and meanings, async and sync, over an
:class:`aiomp.Pool` of persistent workers that survives them."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import anyio.abc

from .._loop.taskhost import TaskHost
from .._pool.pool import Pool
from .._process.placement import slot_envs
from . import options as _options
from .epoch import Handed, MapEpoch
from .handoff import Batches, Handoff
from .local import LocalEpoch
from .sampling import (
    BuiltinBatchSampler,
    BuiltinSampler,
    Sampling,
    batch_count,
    is_map_style,
)
from .streams import StreamEpoch, checked_shards, shards_at
from .syncface import SyncFace
from .worker import Builder, Position
from .worker import init as _init_worker

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal


class DataLoader(SyncFace):
    """Batches of ``dataset`` built by ``num_workers`` worker processes.

    ::

        async with aiomp.DataLoader(dataset, 64, shuffle=True) as loader:
            for epoch in range(10):
                async for images, labels in loader:   # one epoch
                    ...

        with aiomp.DataLoader(dataset, 64, shuffle=True) as loader:   # no event loop
            for images, labels in loader:
                ...

    torch's signature, order and meanings (a drop-in: ``for batch in loader`` needs no
    ``with``; the first iteration starts the workers, which persist until :meth:`close`
    or exit). ``dataset`` is map-style or iterable-style (each worker shards
    its own copy by ``get_worker_info()``); ``num_workers=0`` builds the batches in this
    process (in a thread, in ``async for``); ``batch_size=None`` gives the samples
    unbatched; ``multiprocessing_context`` (or ``start_method``) names the start method
    (default: fork where no thread runs and CUDA is not initialised, else forkserver);
    ``pin_memory`` pins where CUDA is there; ``timeout=0`` is none; the default collate is
    torch's ``default_collate`` where a sample holds a tensor, else
    :func:`default_collate` (straight into shared memory). Differences from torch, each
    with its reason: docs/data-loading-differences.md.

    ``seed`` (default: drawn from ``generator``, or torch's global RNG where torch is
    imported, else fresh: :attr:`seed`): batch ``k`` of epoch ``e`` is built with
    Python's ``random``, numpy's global RNG and torch's seeded from ``(seed, e, k)``, and
    shuffling is drawn from ``(seed, e)``: one seed, the same batches, whatever
    ``num_workers`` (>= 1).

    Faults: a worker that dies while building a batch is replaced and the batch built
    again, up to ``max_retries`` times, then :class:`aiomp.BrokenWorkerError` names the
    batch (``batch_index``, ``indices``). An exception raised by the dataset or
    ``collate_fn`` is raised here as its own type, the worker's traceback as its
    ``__cause__`` and a note naming the batch; a ``BaseException`` too (``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``), as :meth:`aiomp.Pool.apply` and
    ``concurrent.futures`` raise it: wrapping it would let ``except Exception`` swallow a
    sample's request to stop, and raised by the step that hands its batch out, it is the
    consumer's to catch (it never stops the event loop or the loader). ``timeout``
    seconds from the moment a worker takes a batch: ``TimeoutError``, the worker
    replaced. Each of these is raised by the step that would have handed the batch out;
    iterating on gives the later batches, and the next epoch is whole.

    Resume: :meth:`state_dict` / :meth:`load_state_dict` (see there).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[list[Any]] | None = None,
        num_workers: int = 2,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float | None = 0,
        worker_init_fn: Callable[[int], object] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        max_retries: int = 2,
        start_method: str | None = None,
        env: Any = None,
    ) -> None:
        num_workers = _options.workers(num_workers)
        timeout = _options.timeout_of(timeout)
        prefetch = _options.prefetch(prefetch_factor, num_workers)
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        self.map_style = is_map_style(dataset)
        _options.check_sampling(
            self.map_style, batch_size, shuffle, sampler, batch_sampler, drop_last
        )
        if batch_sampler is not None:
            batch_size, drop_last = None, False
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.prefetch_factor = prefetch
        self.timeout = timeout
        self.max_retries = _options.retries(max_retries)
        self.in_order = in_order
        self.persistent_workers = persistent_workers  # workers persist anyway (see docs)
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self._pin = _options.pin_memory_of(pin_memory, pin_memory_device)
        self.generator = generator
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        method = _options.start_method_of(multiprocessing_context, start_method, num_workers)
        self.multiprocessing_context = multiprocessing_context
        self._start_method = method  # None: chosen at each start
        #: The seed every batch's RNGs and the shuffling derive from.
        self.seed = _options.seed_of(seed, generator)
        auto = batch_size is not None or batch_sampler is not None
        self.sampling = (
            Sampling(dataset, batch_size, bool(shuffle), sampler, batch_sampler, drop_last)
            if self.map_style
            else None
        )
        self._builder = Builder(dataset, collate_fn, auto)  # num_workers=0: in this process
        envs = slot_envs(env, max(num_workers, 1))  # TypeError now, as Pool(env=...) raises
        options: dict[str, Any] = {} if envs is None else {"env": envs.__getitem__}
        #: The workers' pool, made when the loader is entered (a pool made here and
        #: never entered would warn of it when collected).
        self._new_pool = functools.partial(
            Pool,
            num_workers,
            initializer=_init_worker,
            initargs=(dataset, num_workers, self.seed, collate_fn, worker_init_fn, auto),
            **options,
        )
        self._pool: Pool | None = None
        self._host: TaskHost | None = None
        self._next_epoch = 0  # the epoch the next ``async for`` iterates
        self._skip = 0  # batches of it already handed out (resumed)
        self._later: tuple[int, ...] = ()  # and those past them (in_order=False)
        self._current: MapEpoch | StreamEpoch | LocalEpoch | None = None
        self._skip_sampler = False  # resumed by the user sampler's own state
        #: An iterable dataset's shards' start (worker.Position): from a state dict, or
        #: the states their datasets ended the last epoch in.
        self._resume: Position | None = None
        #: Batch requests running (of any epoch): leaving with some terminates workers.
        self.in_flight = 0
        self._drained: anyio.Event | None = None  # set when in_flight comes back to 0
        self._portal: BlockingPortal | None = None
        self._portal_cm: Any = None
        self._handoff: Handoff | None = None  # the sync face's current epoch, if any
        self._batches: weakref.ref[Batches] | None = None  # its iterator (which holds us)
        self._entered = False  # num_workers=0: ``with`` / ``async with`` entered
        self._reported_len: int | None = None  # ``len(self)`` last asked (iterable dataset)
        self._initialized = True

    #: What torch refuses to have assigned once the loader is made.
    _FIXED = frozenset(
        ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FIXED and self.__dict__.get("_initialized"):
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        super().__setattr__(name, value)

    def __class_getitem__(cls, item: Any) -> Any:
        """``aiomp.DataLoader[T]`` at run time, as torch's ``DataLoader[T]`` (for mypy the
        class is not generic: the sample type of an untyped dataset cannot be inferred)."""
        return types.GenericAlias(cls, item)

    @property
    def sampler(self) -> Any:
        """The sampler (torch's name): the one given, or the built-in one (``None`` for an
        iterable-style dataset, whose workers iterate it)."""
        if self.sampling is None:
            return self.__dict__.get("_iterable_sampler")
        user = self.sampling.sampler
        if user is not None:
            return user
        if self.sampling.batch_sampler is not None:
            return None
        return BuiltinSampler(self.sampling, lambda: (self.seed, self._next_epoch))

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler (torch's name): the one given, or ``sampler`` in lists of
        ``batch_size`` (None with ``batch_size=None``, or an iterable-style dataset)."""
        if self.sampling is None or self.sampling.batch_sampler is not None:
            return None if self.sampling is None else self.sampling.batch_sampler
        if self.batch_size is None:
            return None
        return BuiltinBatchSampler(self.sampler, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per epoch, from ``len(dataset)`` each time, as torch's (an iterable
        dataset giving more than this then warns: :class:`~.options.LengthWatch`)."""
        n = self._per_epoch()
        if self.sampling is None:
            self._reported_len = n
        return n

    def _per_epoch(self) -> int:
        if self.sampling is not None:
            return len(self.sampling)
        n = len(self.dataset)
        return n if self.batch_size is None else batch_count(n, self.batch_size, self.drop_last)

    def pinned(self, batch: Any) -> Any:
        """``batch`` in page-locked memory where ``pin_memory`` and CUDA are there."""
        return batch if self._pin is None else _options.pin_batch(batch)

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
        self._next_epoch, self._skip, self._later = int(epoch), 0, ()
        self._resume = None
        self._handoff = None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, as a small picklable dict: ``epoch``, ``batches`` (handed
        out of it so far), ``seed``, ``sampler`` (a user sampler's ``state_dict()``, if it
        has one), and ``shards`` (an iterable dataset's per-worker states, where its
        dataset or iterator has ``state_dict()``). Taken inside an epoch, it points at the
        next batch of it; taken after, at the start of the next epoch."""
        current, handed = self._position()
        later: Iterable[int] = ()
        if current is not None and not (
            self.sampling is not None and handed.prefix >= len(self.sampling)
        ):
            epoch, batches, later = current.epoch, handed.prefix, handed.later
        elif current is not None:
            epoch, batches = current.epoch + 1, 0
        else:
            epoch, batches, later = self._next_epoch, self._skip, self._later
        state: dict[str, Any] = {"epoch": epoch, "batches": batches, "seed": self.seed}
        if later:  # in_order=False: batches handed out past ``batches``
            state["later"] = sorted(later)
        shards = shards_at(current, handed.prefix, self._resume, self._handoff is not None)
        if shards is not None:
            state["shards"] = shards
        user = None if self.sampling is None else self.sampling.user_sampler()
        if user is not None and hasattr(user, "state_dict"):
            state["sampler"] = user.state_dict()
        return state

    def _position(self) -> tuple[MapEpoch | StreamEpoch | LocalEpoch | None, Handed]:
        """The epoch being iterated (None between epochs) and its batches handed out; in
        sync code, handed to the consumer's thread (not those waiting in the handoff)."""
        handoff, current = self._handoff, self._current
        if handoff is not None and handoff.epoch is not None:
            return (None, Handed(0)) if handoff.ended else (handoff.epoch, handoff.handed)
        if isinstance(current, MapEpoch):
            return current, current.handed_out
        return current, Handed(0 if current is None else current.handed_count)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) was taken: the next ``async
        for`` / ``for`` starts at its next batch, with its seed, whatever ``num_workers``.
        The skipped batches are not built (their sample indices are skipped in the
        sampler's order; a user sampler with ``load_state_dict`` is restored instead and
        iterated from where it was). An iterable-style dataset whose dataset (or iterator)
        has ``load_state_dict`` resumes each worker's share at its next batch, as
        torchdata's ``StatefulDataLoader`` (with the same ``num_workers``); one with none
        replays the stored epoch from its start (docs/decisions/0085-loader-torch-compat.md)."""
        try:
            per_epoch: int | None = self._per_epoch()
        except TypeError:  # an iterable dataset with no len
            per_epoch = None
        epoch, batches, seed, later = _options.checked_state(state, per_epoch)
        self._close_batches()  # an epoch in progress is left (on its loop): ``state`` rules
        self._abandon() if self._portal is None else self._portal.call(self._abandon)
        self.seed = seed
        self._handoff = None
        self._next_epoch = epoch
        self._skip = batches  # an iterable dataset replays the epoch (see above)
        self._later = later
        self._resume = checked_shards(state.get("shards"), max(self.num_workers, 1))
        user = None if self.sampling is None else self.sampling.user_sampler()
        if "sampler" in state and user is not None and hasattr(user, "load_state_dict"):
            user.load_state_dict(state["sampler"])
            self._skip_sampler = True

    # -- async -------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (concurrently: returns before they are ready). On failure or
        cancellation nothing is left running. ``num_workers=0``: nothing to start."""
        if self.num_workers == 0:
            return self
        _options.check_worker_count(self.num_workers)
        method = self._start_method or _options.safe_start_method(self.dataset)
        self._pool = pool = self._new_pool(start_method=method)
        try:
            await pool.__aenter__()
        except RuntimeError as exc:
            if "through inheritance" in str(exc):  # an mp.Value or lock in the dataset
                exc.add_note(
                    "aiomp.DataLoader: the dataset holds a multiprocessing object; give "
                    "multiprocessing_context='fork' (torch's default on Linux), or use "
                    "aiomp.Queue / shared arrays instead"
                )
            raise
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
        if self.num_workers == 0:
            return
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

    def __aiter__(self) -> MapEpoch | StreamEpoch | LocalEpoch:
        """The next epoch (or the one :meth:`set_epoch` named), as an async iterator."""
        if self._host is None and self.num_workers:
            raise RuntimeError("use `async with loader:` (or `with loader:`) before iterating")
        epoch = self._open_epoch()
        if isinstance(epoch, StreamEpoch):
            epoch.watch = self._length_watch()
        return epoch

    def _open_epoch(self) -> MapEpoch | StreamEpoch | LocalEpoch:
        self._abandon()
        epoch, skip, later = self._next_epoch, self._skip, self._later
        self._next_epoch, self._skip, self._later = epoch + 1, 0, ()
        resume, self._resume = self._resume, None
        batches = None
        if self.sampling is not None:
            from_sampler, self._skip_sampler = self._skip_sampler, False
            batches = self.sampling.batches(self.seed, epoch, 0 if from_sampler else skip)
        current: MapEpoch | StreamEpoch | LocalEpoch
        if batches is None:
            skip = 0  # an iterable dataset's epoch resumes by its shards' states, or replays
        # The epoch (and its tasks) hold the loader weakly: a loader dropped by its user
        # is collected at once, and stops its workers (see SyncFace.__del__).
        owner = cast("DataLoader", weakref.proxy(self))
        if self.num_workers == 0:
            current = LocalEpoch(owner, epoch, skip, self._builder, batches, resume)
            current.watch = self._length_watch()
            current.keep = self  # held by the consumer: the loader lives while it iterates
        elif batches is None:
            current = StreamEpoch(owner, epoch, resume)
        else:
            current = MapEpoch(owner, epoch, skip, batches, later)
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

    def finished(self, epoch: object) -> None:
        """Called by ``epoch`` at its end."""
        if self._current is epoch:
            self._current = None
        if isinstance(epoch, (StreamEpoch, LocalEpoch)):  # (not a map-style's with workers)
            self._resume = epoch.carried()  # the next epoch starts from its datasets' states


#: How long leaving the loader waits for batches still being built before it stops their
#: workers (torch's loader joins its workers for 5 s before terminating them).
DRAIN_SECONDS = 5.0


class _Leaving(Exception):
    """What the loader's block is left with when it is left normally: the Pool must not
    wait for batches nobody will take."""
