"""What a :class:`aiomp.DataLoader` worker runs: its Pool initializer and its batch tasks.

The dataset, ``collate_fn`` and ``worker_init_fn`` come once, in the Pool's initializer;
a batch task carries only its batch index, sample indices and seed. Before building a
batch the worker seeds Python's ``random``, numpy's global generator (if numpy is loaded)
and torch's (if torch is loaded) from the batch's seed, and sets ``seed`` on its worker
information, so a batch's content depends on ``(seed, epoch, batch index)`` alone.

Standard library at module level: numpy and torch are used only where the dataset loaded
them already.
"""

from __future__ import annotations

import enum
import itertools
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .._child import info as _info
from .._child.seeds import reseed
from .collate import default_collate, default_convert
from .sampling import is_map_style


class Builder:
    """What builds a batch from sample indices: the dataset and the collate function.
    ``auto``: batches of samples (``collate_fn(list of samples)``); False (torch's
    ``batch_size=None``): each "batch" is one sample, ``collate_fn(sample)``."""

    def __init__(
        self, dataset: Any, collate_fn: Callable[[Any], Any] | None, auto: bool = True
    ) -> None:
        self.dataset = dataset
        self.auto = auto
        self.collate = collate_fn or (default_collate if auto else default_convert)

    def build(self, indices: list[Any]) -> Any:
        """The batch of ``indices`` (one index where not ``auto``), collated."""
        dataset = self.dataset
        if not self.auto:
            return self.collate(dataset[indices[0]])
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
        return self.collate(samples)

    def chunk(self, samples: list[Any]) -> Any:
        """An iterable dataset's batch: ``samples`` collated (one sample where not auto)."""
        return self.collate(samples) if self.auto else self.collate(samples[0])


#: Where an iterable dataset's epoch is: ``{"turn": shard, "shards": [{"batches": j,
#: "state": its dataset's state or None, "ended": bool}, ...]}`` (JSON-able where the
#: dataset's states are).
Position = dict[str, Any]


class ShardMark(enum.Enum):
    """What a shard's queue carries besides batches (never taken for a batch index)."""

    END = "end"  # (shard, END, None, state): put by :func:`stream` after its batches
    FAILED = "failed"  # (shard, FAILED, None, None): its task failed (put by the loader)


class _State:
    """This worker's loader: set once by :func:`init`."""

    builder: Builder = Builder(None, None)
    info: _info.WorkerInfo | None = None
    pristine: Any = None  # an iterable dataset as it came, for the shards of other slots
    copies: dict[int, Any] = {}  # noqa: RUF012 - one per worker process
    ends: dict[int, str] = {}  # noqa: RUF012 - shard -> the origin of its copy's last end


_state = _State()


def _slot() -> int:
    """This worker's slot in its Pool, as the Pool recorded it before the initializer."""
    known = _info.get_worker_info()
    if known is None:
        raise RuntimeError("aiomp.DataLoader's initializer runs in an aiomp.Pool worker only")
    return known.id


def init(
    dataset: Any,
    num_workers: int,
    seed: int,
    collate_fn: Callable[[Any], Any] | None,
    worker_init_fn: Callable[[int], object] | None,
    auto: bool = True,
) -> None:
    """The Pool's initializer: record who this worker is (``aiomp.get_worker_info()`` and,
    where torch is loaded, ``torch.utils.data.get_worker_info()``), then run
    ``worker_init_fn(id)`` as torch does, with the RNGs seeded for this worker."""
    from .sampling import derive

    slot = _slot()
    _state.builder = Builder(dataset, collate_fn, auto)
    if not is_map_style(dataset):
        _state.pristine = _copy(dataset)
    _state.info = _info.set_worker_info(slot, num_workers, derive(seed, slot), dataset)
    # Loaded before the first batch, so that its first draw is seeded too (a dataset may
    # import numpy only in __getitem__; numpy is a dependency of aiomp and of the default
    # collate). torch, too heavy to load for nothing, is seeded by build() instead.
    import numpy.random  # noqa: F401

    if "torch" in sys.modules:
        import torch.utils.data

        # One intra-op thread, as torch's workers run (the workers are the parallelism).
        # A forked worker must not use the OpenMP pool its parent had started: it has
        # none of the pool's threads, and its first parallel op waits for them forever
        # (issue 39 bug 3; torch's TestConvAfterFork). ``worker_init_fn`` may set more.
        torch.set_num_threads(1)
    _seed(_state.info.seed or 0)
    if worker_init_fn is not None:
        worker_init_fn(slot)
    _warm()


def _warm() -> None:
    """Make this worker's first shared segment for small blocks now, while the Pool is
    still starting the other workers, rather than on the first batch's path: a batch's
    small leaves (its labels) go to a segment of their own, allocated whole and
    pre-faulted (8 MiB). Where numpy is not loaded the default collate makes no array."""
    np = sys.modules.get("numpy")
    if np is None:
        return
    from .._arrays.shared import empty

    empty((1,), np.uint8)  # dropped at once: its block goes back to this worker's pool


def _seed(seed: int) -> None:
    """Seed the RNGs a sample may use, and point torch's worker record at ours."""
    info = _state.info
    assert info is not None
    _info.update(info, seed=seed)
    reseed(seed)
    # torch's get_worker_info() returns this module global: ours has the same names.
    twi = sys.modules.get("torch.utils.data._utils.worker")
    if twi is not None and getattr(twi, "_worker_info", None) is not info:
        twi._worker_info = info  # type: ignore[attr-defined]


def ready() -> None:
    """Nothing: a task that returns once a worker is ready to take one."""


def build(indices: list[Any], seed: int) -> Any:
    """One batch of a map-style dataset: its samples, collated, with the RNGs seeded from
    ``seed``. A dataset that imports torch while building it (in ``__getitem__``) drew
    from torch's RNG unseeded: the batch is built again, torch seeded (once per worker)."""
    had_torch = "torch" in sys.modules
    _seed(seed)
    batch = _state.builder.build(indices)
    if not had_torch and "torch" in sys.modules:
        del batch
        _seed(seed)
        batch = _state.builder.build(indices)
    return batch


def stream(
    epoch: int,
    seed: int,
    batch_size: int,
    drop_last: bool,
    queue: Any,
    start: tuple[int, int, Any],
    skip: int = 0,
) -> None:
    """Put the batches of one shard of an iterable dataset's ``epoch`` on ``queue`` as
    ``(shard, j, batch, state)``, then ``(shard, ShardMark.END, None, state)``. ``start`` is
    ``(shard, first, resume)``: the shard's batches start at ``j = first``, its dataset
    (and iterator) restored from ``resume`` (:func:`restore`); ``state`` is their state
    after batch ``j`` (:func:`snapshot`; None where they keep none). Batches before
    ``skip`` are drawn from the iterator but neither collated nor put (a replay after a
    dead worker).

    While it runs, this worker's ``get_worker_info().id`` is the shard: whichever worker
    the Pool gives the task, the dataset's own sharding by worker id gives that shard.
    Batch ``j`` is drawn with the RNGs seeded from ``(seed, epoch, shard, j)``, so a replay
    draws the same batches. A closed queue (the consumer left the epoch) ends it quietly.
    """
    from .._errors import QueueClosed
    from .sampling import derive

    shard, first, resume = start
    info = _state.info
    assert info is not None
    own = info.id
    dataset = _shard_dataset(shard, own)
    _info.update(info, id=shard, dataset=dataset)
    try:
        _seed(derive(seed, epoch, shard, first))
        samples = iter(dataset)
        restore(dataset, samples, resume, first > 0, _state.ends.get(shard))
        for j in itertools.count(first):
            _seed(derive(seed, epoch, shard, j))
            batch = take(samples, batch_size)
            if not batch or (len(batch) < batch_size and drop_last):
                break
            if j >= skip:
                queue.sync.put((shard, j, _state.builder.chunk(batch), snapshot(dataset, samples)))
            del batch
        state = ended(dataset, samples, _state.ends, shard)
        queue.sync.put((shard, ShardMark.END, None, state))
    except QueueClosed:
        pass
    finally:
        _info.update(info, id=own, dataset=_state.builder.dataset)


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    """The next ``n`` samples of ``iterator`` (fewer at its end), by ``next()`` alone, as
    torch's fetcher draws them: ``islice`` would call ``iter()`` on it again, which
    restarts a dataset that is its own iterator."""
    batch = []
    for _ in range(n):
        try:
            batch.append(next(iterator))
        except StopIteration:
            break
    return batch


def snapshot(dataset: Any, iterator: Any) -> dict[str, Any] | None:
    """The state of an iterable dataset and of its iterator, as torchdata's
    ``StatefulDataLoader`` keeps them: each one's ``state_dict()`` where it has one (the
    iterator's only where it is not the dataset); None where neither has."""
    of_dataset = getattr(dataset, "state_dict", None)
    of_iterator = None if iterator is dataset else getattr(iterator, "state_dict", None)
    if not callable(of_dataset) and not callable(of_iterator):
        return None
    return {
        "dataset": of_dataset() if callable(of_dataset) else None,
        "iterator": of_iterator() if callable(of_iterator) else None,
    }


def ended(dataset: Any, iterator: Any, ends: dict[Any, str], key: Any) -> dict[str, Any] | None:
    """:func:`snapshot` at the end of a shard's epoch, marked with a new ``origin`` kept
    in ``ends[key]``: the copy that ended in it need not load it again."""
    state = snapshot(dataset, iterator)
    if state is not None:
        state["origin"] = ends[key] = secrets.token_hex(8)
    return state


def restore(
    dataset: Any, iterator: Any, state: Any, mid_epoch: bool, origin: str | None = None
) -> None:
    """Load ``state`` (from :func:`snapshot`) into a dataset whose iterator was just made
    and not yet drawn from (a generator's body has not run): the dataset's part, and the
    iterator's where resuming ``mid_epoch`` (a new epoch starts a new iterator). A state
    this very copy ended its last epoch in (``origin``) is not loaded: the copy goes on
    as torch's persistent workers' datasets do; another worker's copy loads it."""
    if not state or (origin is not None and state.get("origin") == origin):
        return
    if state.get("dataset") is not None:
        dataset.load_state_dict(state["dataset"])
    if mid_epoch and state.get("iterator") is not None and iterator is not dataset:
        iterator.load_state_dict(state["iterator"])


def _shard_dataset(shard: int, own: int) -> Any:
    """The dataset object that shard ``shard`` iterates in this worker: the worker's own
    for its own slot, else a copy made once per shard from the dataset as it came. So, as
    in torch (each worker iterates its own copy), a dataset that keeps state in itself
    never sees another shard's iteration (issue 39 bug 6)."""
    if shard == own or _state.pristine is None:
        return _state.builder.dataset
    dataset = _state.copies.get(shard)
    if dataset is None:
        dataset = _state.copies[shard] = _copy(_state.pristine)
    return dataset


def _copy(dataset: Any) -> Any:
    """A deep copy of ``dataset``, or None where it cannot be copied (then shards share)."""
    import copy

    try:
        return copy.deepcopy(dataset)
    except Exception:  # noqa: BLE001 - a dataset holding a lock or a file: shared, as before
        return None


def feed(requests: Any, results: Any, slot: int) -> None:
    """Build the batches requested on ``requests`` (``(k, indices, seed)``, in order) and put
    each on ``results`` as ``(slot, k, True, batch)``, or ``(slot, k, False, (error, pid))``
    where the dataset or ``collate_fn`` raised or the batch cannot be sent. Returns when
    either queue is closed (the epoch ended or was left).

    One Pool task serves a whole epoch: the next request is already waiting in the
    worker's queue when a batch is done, so the worker never idles for a round trip to
    the consumer (see docs/decisions/0047-loader-feeds.md).
    """
    from .._child.report import ErrorPayload
    from .._errors import QueueClosed

    get, put = requests.sync.get, results.sync.put
    while True:
        try:
            k, indices, seed = get()
        except QueueClosed:
            return
        try:
            item = (slot, k, True, build(indices, seed))
        except BaseException as exc:  # noqa: BLE001 - the batch's outcome (SystemExit too), raised by the consumer
            item = (slot, k, False, (ErrorPayload.of(exc), os.getpid()))
        try:
            put(item)
        except QueueClosed:
            return
        except Exception as exc:  # noqa: BLE001 - the batch cannot be pickled: say so instead
            why = ErrorPayload.of(exc, "the batch could not be sent to the consumer")
            put((slot, k, False, (why, os.getpid())))
        del item
