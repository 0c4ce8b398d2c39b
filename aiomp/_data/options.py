"""torch's ``DataLoader`` arguments, checked as torch checks them and turned into what
aiomp's loader runs: the worker count, prefetch bound, timeout, start method and seed.

Everything here runs in the constructor (or in ``load_state_dict``) and owns nothing: a
bad argument raises in the caller's frame, with torch's exception type, before any
worker starts.
"""

from __future__ import annotations

import copy
import logging
import operator
import os
import secrets
import sys
import warnings
from collections.abc import Mapping
from typing import Any, SupportsIndex

from .._process.checks import START_METHODS, check_start_method, count, fork_hazard
from .._process.launch import preload_in_forkserver


def workers(num_workers: object) -> int:
    """``num_workers`` as an int >= 0 (0: loading in the calling process, as torch's)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, SupportsIndex):
        raise TypeError(
            f"num_workers must be an int >= 0, not {type(num_workers).__name__} ({num_workers!r})"
        )
    n = operator.index(num_workers)
    if n < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable "
            "multiprocessing."
        )
    return n


def check_sampling(
    map_style: bool,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: object,
    batch_sampler: object,
    drop_last: bool,
) -> None:
    """torch's checks of the sampling arguments, in torch's order and words (the first
    that fails is the one torch names)."""
    if not map_style:
        given = (
            ("shuffle", shuffle, shuffle not in (None, False)),
            ("sampler", sampler, sampler is not None),
            ("batch_sampler", batch_sampler, batch_sampler is not None),
        )
        for name, value, bad in given:
            if bad:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified {name} option, "
                    f"but got {name}={value!r}"
                )
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                "sampler, and drop_last"
            )
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )


def prefetch(prefetch_factor: object, num_workers: int) -> int:
    """torch's rule: ``None`` is 2 with workers; any other value needs workers."""
    if num_workers == 0:
        if prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing."
                "let num_workers > 0 to enable multiprocessing, otherwise set "
                "prefetch_factor to None."
            )
        return 2
    return 2 if prefetch_factor is None else count("prefetch_factor", prefetch_factor)


def timeout_of(timeout: float | None) -> float | None:
    """torch's ``timeout=0`` (the default) is no timeout; a negative one is refused."""
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    return float(timeout) or None


class LoaderTimeout(TimeoutError, RuntimeError):
    """No batch within the loader's ``timeout``: a ``TimeoutError`` (aiomp's, as
    ``anyio.fail_after`` and ``Pool.apply(timeout=)`` raise) that is also torch's
    ``RuntimeError`` with torch's text, so ``except RuntimeError`` code written for torch's
    loader catches it (docs/decisions/0085-loader-torch-compat.md)."""


def timed_out(timeout: float, cause: BaseException | None = None) -> LoaderTimeout:
    """The error of a batch not built within ``timeout`` seconds (``cause``: the wait's
    own error), with torch's message."""
    err = LoaderTimeout(f"DataLoader timed out after {timeout:g} seconds")
    err.__cause__ = cause
    return err


def user_error(exc: BaseException) -> BaseException:
    """What a batch's failure raises to the consumer: ``exc``, except where the workers'
    initializer raised (``worker_init_fn``, or the dataset that cannot be rebuilt in a
    worker): that exception itself, as torch raises it (the pool's ``BrokenPoolError``
    wraps it twice), with a note; the worker's traceback is its ``__cause__``."""
    from .._errors import BrokenPoolError, BrokenWorkerError

    if not isinstance(exc, BrokenPoolError):
        return exc
    worker = exc.__cause__
    if not isinstance(worker, BrokenWorkerError) or not isinstance(worker.__cause__, Exception):
        return exc
    # A copy: the pool keeps the original, which the tracebacks of each raise would
    # otherwise grow on, holding the consumer's frames (and the loader) alive.
    try:
        raised = copy.copy(worker.__cause__)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied: the pool's
        return exc
    raised.__cause__ = worker.__cause__.__cause__  # the worker's traceback
    raised.__notes__ = [
        *getattr(worker.__cause__, "__notes__", ()),
        "aiomp.DataLoader: raised by the workers' initializer (worker_init_fn, or the "
        f"dataset's unpickling) in worker {worker.error_index}: the loader's workers cannot "
        "start",
    ]
    return raised


def start_method_of(context: object, start_method: str | None, num_workers: int) -> str | None:
    """The workers' start method, from torch's ``multiprocessing_context`` (a start
    method's name, or a context from ``multiprocessing.get_context``) or aiomp's
    ``start_method``; both given must agree. None where neither says: each start
    chooses (:func:`safe_start_method`)."""
    from_context: str | None = None
    if context is not None:
        if num_workers == 0:
            raise ValueError(
                "multiprocessing_context can only be used with multi-process loading "
                "(num_workers > 0), but got num_workers=0"
            )
        if isinstance(context, str):
            if context not in START_METHODS:
                raise ValueError(
                    "multiprocessing_context option should specify a valid start method in "
                    f"{list(START_METHODS)!r}, but got multiprocessing_context={context!r}"
                )
            from_context = context
        elif callable(getattr(context, "get_start_method", None)):
            from_context = str(context.get_start_method())  # type: ignore[attr-defined]
        else:
            raise TypeError(
                "multiprocessing_context option should be a valid context object or a string "
                f"specifying the start method, but got multiprocessing_context={context!r}"
            )
    if start_method is not None:
        check_start_method(start_method)
        if from_context is not None and from_context != start_method:
            raise ValueError(
                f"multiprocessing_context={from_context!r} and start_method={start_method!r} "
                "disagree: give one"
            )
    return start_method or from_context


def safe_start_method(dataset: object) -> str:
    """The start method of a loader that names none, chosen as its workers start (on the
    thread that will start them): ``fork``, torch's default on Linux and the fastest,
    where nothing makes it unsafe (:func:`~aiomp._process.checks.fork_hazard`: another
    thread running, CUDA initialised); else ``forkserver``, its server importing the
    dataset's module and torch (where this program uses it) once for every worker.
    See docs/decisions/0080-loader-start-method.md."""
    why = fork_hazard()
    if why is None:
        return "fork"
    logging.getLogger("aiomp").debug("aiomp.DataLoader: forkserver, not fork: %s", why)
    modules = [type(dataset).__module__]
    if torch_in_use():
        modules.append("torch")
    preload_in_forkserver(modules)
    return "forkserver"


def check_worker_count(num_workers: int) -> None:
    """torch's warning (a ``UserWarning``, in torch's words) where the loader will start
    more workers than the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0))
    if num_workers > cpus:
        warnings.warn(
            f"This DataLoader will create {num_workers} worker processes in total. Our "
            f"suggested max number of worker in current system is {cpus}, which is smaller "
            "than what this DataLoader is going to create. Please be aware that excessive "
            "worker creation might get DataLoader running slow or even freeze, lower the "
            "worker number to avoid potential slowness/freeze if necessary.",
            UserWarning,
            stacklevel=4,
        )


class LengthWatch:
    """torch's warning where an iterable dataset gives more batches than ``len(loader)``
    said, once the loader's length was asked (an iterable dataset not split by
    ``get_worker_info()`` gives its samples once per worker). Counts the batches one
    iterator hands out, in the consumer's thread."""

    def __init__(self, reported: int | None, num_workers: int, dataset: object) -> None:
        self.reported = reported  # ``len(loader)`` when last asked (None: never)
        self.num_workers = num_workers
        self.dataset = dataset
        self.handed = 0

    def step(self) -> None:
        """One batch is handed out: warn if it is past the length reported."""
        self.handed += 1
        if self.reported is None or self.handed <= self.reported:
            return
        msg = (
            f"Length of IterableDataset {self.dataset} was reported to be {self.reported} "
            f"(when accessing len(dataloader)), but {self.handed} samples have been fetched. "
        )
        if self.num_workers > 0:
            msg += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker (split it by "
                "get_worker_info())."
            )
        warnings.warn(msg, UserWarning, stacklevel=3)


def seed_of(seed: int | None, generator: Any) -> int:
    """The loader's seed: ``seed``; else drawn from torch's ``generator``, or from torch's
    global RNG where this program uses torch (so ``torch.manual_seed(0)`` makes the
    shuffling and the workers' RNGs reproducible, as in torch); else fresh."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, SupportsIndex):
            raise TypeError(f"seed must be an int or None, not {type(seed).__name__}")
        return operator.index(seed)
    torch = sys.modules.get("torch")
    if generator is not None or torch is not None:
        if torch is None:
            raise TypeError("generator= is a torch.Generator: import torch first")
        draw = torch.empty((), dtype=torch.int64).random_(generator=generator)
        return int(draw.item()) & ((1 << 63) - 1)
    return secrets.randbits(63)


def torch_in_use() -> bool:
    """Whether this program uses torch (has imported it): its workers then load torch as
    they start, so that its RNG is seeded for every batch (even a dataset importing torch
    only in ``__getitem__``) and batches are collated as torch's."""
    return "torch" in sys.modules


def pin_memory_of(pin_memory: bool, device: str) -> str | None:
    """The device to pin batches for (None: no pinning): as torch, pinning is a no-op
    where no accelerator is there."""
    if not pin_memory:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return device or "cuda"


def checked_state(state: object, per_epoch: int | None) -> tuple[int, int, int, tuple[int, ...]]:
    """``(epoch, batches, seed, later)`` of a state dict, or ValueError naming its bad
    field (``later``, optional: the batches handed out past ``batches``)."""
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
    later = state.get("later", ())
    if not isinstance(later, list | tuple) or not all(
        isinstance(k, int) and not isinstance(k, bool) and k > got[1] for k in later
    ):
        raise ValueError(f"DataLoader state: 'later' must list batches past 'batches' ({got[1]})")
    if per_epoch is not None and any(k >= per_epoch for k in later):
        raise ValueError(
            f"DataLoader state: 'later' names a batch past the {per_epoch} of an epoch"
        )
    return got[0], got[1], got[2], tuple(later)


def retries(max_retries: object) -> int:
    return count("max_retries", max_retries, least=0)


def pin_batch(batch: Any) -> Any:
    """``batch`` with each torch tensor in it copied to page-locked memory."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)({k: pin_batch(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin_batch(v) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(pin_batch(v) for v in batch)
    return batch
