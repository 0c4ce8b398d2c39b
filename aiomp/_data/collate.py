"""The default collate of :class:`aiomp.DataLoader`: each batch straight into shared memory.

Runs in the loader's workers. Each leaf keeps its kind and is stacked along a new axis 0:
numpy arrays (and numpy scalars) into one ``aiomp.empty`` array; Python bools, ints and
floats into a bool, int64 or float64 ``aiomp.empty`` array; strings and bytes into a
list. Dicts (same keys), namedtuples (same type), tuples and lists (a list, as torch's)
are collated field by field. The batch then travels as handles: the consumer maps the
worker's memory, with no copy after this one.

Where torch is in use (a sample holds a torch tensor) the batch is torch's own
``default_collate``'s (numbers become tensors, so an unchanged training loop runs); in a
worker it stacks into shared storage, as in torch's loader.

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
    torch = sys.modules.get("torch")
    if torch is not None and _holds_tensor(elem, torch.Tensor):
        from torch.utils.data import default_collate as torch_collate

        return torch_collate(list(samples))
    return _collate(samples)


def default_convert(sample: Any) -> Any:
    """The collate of ``batch_size=None`` (each sample alone): the sample as it is, or
    torch's ``default_convert`` of it where it holds a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and _holds_tensor(sample, torch.Tensor):
        from torch.utils.data import default_convert as torch_convert

        return torch_convert(sample)  # type: ignore[no-untyped-call]
    return sample


def _holds_tensor(elem: Any, tensor: type, depth: int = 0) -> bool:
    """Whether ``elem`` is, or holds (in dicts, tuples and lists), a torch tensor."""
    if isinstance(elem, tensor):
        return True
    if depth > 4 or isinstance(elem, str | bytes):
        return False
    if isinstance(elem, Mapping):
        return any(_holds_tensor(v, tensor, depth + 1) for v in elem.values())
    if isinstance(elem, tuple | list):
        return any(_holds_tensor(v, tensor, depth + 1) for v in elem[:64])
    return False


def _collate(samples: Sequence[Any]) -> Any:
    """aiomp's own collate (no torch tensor in the samples)."""
    elem = samples[0]
    kind = type(elem)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(elem, np.ndarray | np.generic):
        return _stack_numpy(samples, np)
    if kind is bool or kind is int or kind is float:
        return _numbers(samples, kind)
    if isinstance(elem, str | bytes):
        return list(samples)
    if isinstance(elem, Mapping):
        return _mapping(samples, elem)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple
        return kind(*(_collate(field) for field in _transpose(samples)))
    if isinstance(elem, tuple | list):
        return [_collate(field) for field in _transpose(samples)]
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
    collated = {key: _collate([s[key] for s in samples]) for key in keys}
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
