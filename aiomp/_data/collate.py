"""The default collate of :class:`aiomp.DataLoader`: each batch straight into shared memory.

Runs in the loader's workers. Each leaf keeps its kind and is stacked along a new axis 0:
numpy arrays (and numpy scalars) into one ``aiomp.empty`` array; Python bools, ints and
floats into a bool, int64 or float64 ``aiomp.empty`` array; torch tensors into one tensor
on a shared storage (as torch's own collate does in a worker); strings and bytes into a
list. Dicts (same keys), namedtuples (same type), tuples and lists (a list, as torch's)
are collated field by field. The batch then travels as handles: the consumer maps the
worker's memory, with no copy after this one.

numpy and torch are looked up in ``sys.modules``: a sample holding an array or a tensor
has imported them already, so a torch-free dataset never imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack ``samples`` (one batch's, at least one) into shared memory, as described above."""
    elem = samples[0]
    kind = type(elem)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(elem, np.ndarray | np.generic):
        return _stack_numpy(samples, np)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(elem, torch.Tensor):
        return _stack_torch(samples, torch)
    if kind is bool or kind is int or kind is float:
        return _numbers(samples, kind)
    if isinstance(elem, str | bytes):
        return list(samples)
    if isinstance(elem, Mapping):
        return _mapping(samples, elem)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple
        return kind(*(default_collate(field) for field in _transpose(samples)))
    if isinstance(elem, tuple | list):
        return [default_collate(field) for field in _transpose(samples)]
    if isinstance(elem, int | float):  # a subclass (an IntEnum): as its base kind
        return _numbers(samples, float if isinstance(elem, float) else int)
    raise TypeError(
        f"default_collate: batch must contain numpy arrays, torch tensors, numbers, strings, "
        f"bytes, dicts or sequences; found {kind.__name__} (pass collate_fn= for it)"
    )


def _stack_numpy(samples: Sequence[Any], np: Any) -> Any:
    from .._arrays.shared import stack

    arrays = [np.asarray(sample) for sample in samples]
    shape = arrays[0].shape
    for i, array in enumerate(arrays):
        if array.shape != shape:
            raise ValueError(
                f"default_collate: sample {i} of the batch has shape {array.shape}, "
                f"sample 0 has {shape} (pass collate_fn= to batch them otherwise)"
            )
    return stack(arrays)


def _stack_torch(samples: Sequence[Any], torch: Any) -> Any:
    elem = samples[0]
    if elem.device.type != "cpu":
        return torch.stack(list(samples))
    # torch's own collate in a worker: stack into a storage made shared from the start,
    # so sending it sends its fd (and nothing is copied into shared memory afterwards).
    numel = sum(x.numel() for x in samples)
    storage = elem._typed_storage()._new_shared(numel, device=elem.device)
    out = elem.new(storage).resize_(len(samples), *elem.shape)
    return torch.stack(list(samples), out=out)


def _numbers(samples: Sequence[Any], kind: type) -> Any:
    import numpy as np

    from .._arrays.shared import empty

    dtype = {bool: np.bool_, int: np.int64, float: np.float64}[kind]
    out = empty((len(samples),), dtype)
    out[:] = samples
    return out


def _mapping(samples: Sequence[Any], elem: Mapping[Any, Any]) -> Any:
    keys = list(elem)
    for i, sample in enumerate(samples):
        if list(sample) != keys:
            raise ValueError(
                f"default_collate: sample {i} of the batch has keys {list(sample)}, "
                f"sample 0 has {keys}"
            )
    collated = {key: default_collate([s[key] for s in samples]) for key in keys}
    try:
        return type(elem)(collated)  # type: ignore[call-arg]  # keep an OrderedDict or a custom mapping's type
    except TypeError:
        return collated


def _transpose(samples: Sequence[Any]) -> list[list[Any]]:
    size = len(samples[0])
    for i, sample in enumerate(samples):
        if len(sample) != size:
            raise ValueError(
                f"default_collate: each sample of a batch must have the same number of "
                f"fields; sample {i} has {len(sample)}, sample 0 has {size}"
            )
    return [list(field) for field in zip(*samples, strict=True)]
