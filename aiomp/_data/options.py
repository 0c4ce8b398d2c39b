"""torch's ``DataLoader`` arguments, checked as torch checks them and turned into what
aiomp's loader runs: the worker count, prefetch bound, timeout, start method and seed.

Everything here runs in the constructor (or in ``load_state_dict``) and owns nothing: a
bad argument raises in the caller's frame, with torch's exception type, before any
worker starts.
"""

from __future__ import annotations

import logging
import operator
import secrets
import sys
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


def length(loader: object) -> int | None:
    """``len(loader)``, or None where it is unknown (an iterable dataset with no len)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


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
