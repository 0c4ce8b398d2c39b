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

import multiprocessing
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .._child import info as _info
from .collate import default_collate


class _State:
    """This worker's loader: set once by :func:`init`."""

    dataset: Any = None
    collate: Callable[[Any], Any] = staticmethod(default_collate)
    info: _info.WorkerInfo | None = None
    #: The iterable dataset's iterator of the current epoch, and that epoch.
    iterator: Iterator[Any] | None = None
    epoch: int = -1


_state = _State()


def _slot() -> int:
    """This worker's slot in its Pool: from the Pool's own record when it sets one, else
    from the process name the Pool gives its workers (``aiomp-pool-<slot>``)."""
    known = _info.get_worker_info()
    if known is not None:
        return known.id
    name = multiprocessing.current_process().name
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def init(
    dataset: Any,
    num_workers: int,
    seed: int,
    collate_fn: Callable[[Any], Any] | None,
    worker_init_fn: Callable[[int], object] | None,
) -> None:
    """The Pool's initializer: record who this worker is (``aiomp.get_worker_info()`` and,
    where torch is loaded, ``torch.utils.data.get_worker_info()``), then run
    ``worker_init_fn(id)`` as torch does, with the RNGs seeded for this worker."""
    from .sampling import derive

    slot = _slot()
    _state.dataset = dataset
    if collate_fn is not None:
        _state.collate = collate_fn
    _state.info = _info.set_worker_info(slot, num_workers, derive(seed, slot), dataset)
    if "torch" in sys.modules:
        import torch.utils.data  # noqa: F401  (loaded by the dataset already: cheap)
    _seed(_state.info.seed or 0)
    if worker_init_fn is not None:
        worker_init_fn(slot)


def _seed(seed: int) -> None:
    """Seed the RNGs a sample may use, and point torch's worker record at ours."""
    info = _state.info
    assert info is not None
    info.seed = seed
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        torch.manual_seed(seed)
    # torch's get_worker_info() returns this module global: ours has the same names.
    twi = sys.modules.get("torch.utils.data._utils.worker")
    if twi is not None and getattr(twi, "_worker_info", None) is not info:
        twi._worker_info = info  # type: ignore[attr-defined]


def build(indices: list[Any], seed: int) -> Any:
    """One batch of a map-style dataset: its samples, collated."""
    _seed(seed)
    dataset = _state.dataset
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
    return _state.collate(samples)


#: What :func:`build_next` returns once this worker's share of the epoch is exhausted.
EXHAUSTED = "aiomp.DataLoader: exhausted"


def build_next(epoch: int, seed: int, batch_size: int, drop_last: bool) -> tuple[int, Any]:
    """The next batch of this worker's share of an iterable dataset in ``epoch``:
    ``(slot, batch)``, or ``(slot, EXHAUSTED)`` once its iterator is done."""
    info = _state.info
    assert info is not None
    _seed(seed)
    if _state.epoch != epoch:
        _state.epoch, _state.iterator = epoch, iter(_state.dataset)
    it = _state.iterator
    if it is None:
        return info.id, EXHAUSTED
    samples = []
    for sample in it:
        samples.append(sample)
        if len(samples) == batch_size:
            break
    if len(samples) < batch_size:
        _state.iterator = None
        if not samples or drop_last:
            return info.id, EXHAUSTED
    return info.id, _state.collate(samples)
