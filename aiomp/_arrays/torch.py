"""torch tensors in aiomp messages, shared as ``torch.multiprocessing`` shares them.

aiomp never imports torch: :func:`aiomp._wire.pickling.init_reductions` calls
:func:`init_reductions` once torch is in ``sys.modules``, and a receiver imports this
module (and torch) when a message holding a tensor arrives.

What travels is decided per *storage*, the unit torch shares; every tensor is rebuilt
on its storage with its dtype, storage offset, size, strides and ``requires_grad`` (a
``Parameter`` stays a ``Parameter``). Within one message each storage travels once,
however many tensors view it: views stay views, and many tensors on one storage send
one fd (R1 in docs/architecture.md).

- A storage already in shared memory travels as that memory, whatever its size:
  a ``file_descriptor`` storage (``share_memory_()``, or received) as its fd, inside the
  same ``sendmsg`` as the message (torch's ``_share_fd_cpu_`` / ``_new_shared_fd_cpu``,
  without torch's listener thread in the sender, so the sender may exit before the
  message is read); a ``file_system`` storage as its name, through torch's own
  manager and reference count (``_share_filename_cpu_``). Writes are seen both ways.
- A storage of :data:`INLINE_THRESHOLD` bytes or more that is not shared yet is moved
  into shared memory *in place*, as torch does (``share_memory_()``: the sender's
  tensors use the shared copy from then on), with torch's sharing strategy
  (``torch.multiprocessing.set_sharing_strategy``), then sent as above.
- A smaller storage travels inside the message, copied, as torch's pickling would.
- Quantized tensors go through torch's own pickling; CUDA, sparse, nested and meta
  tensors through torch's own reducer
  (``torch.multiprocessing.reductions.reduce_tensor``: CUDA IPC handles and torch's
  reference counting), carried by aiomp's transport; the CPU storages inside a sparse or
  nested tensor come back here. CUDA events too (``reduce_event``).

A receiver maps a storage once: storages are cached by segment in torch's own
``shared_cache``, so a tensor received twice, or from torch.multiprocessing too, is one
storage. It holds the fd while the storage lives, as torch does.
"""

from __future__ import annotations

import ctypes
from typing import Any, cast

# torch is optional for type checking: absent (import-not-found) in a venv without it.
import torch  # type: ignore[import-not-found,unused-ignore]
import torch.multiprocessing  # type: ignore[import-not-found,unused-ignore]
import torch.utils.hooks  # type: ignore[import-not-found,unused-ignore]
from torch.multiprocessing import reductions  # type: ignore[import-not-found,unused-ignore]

from .._errors import TransportError
from .._wire import pickling as _reduction

# torch's reducers, strategy and storage internals are untyped: used through Any.
_torch_reductions: Any = reductions
_torch_mp: Any = torch.multiprocessing
_Storage: Any = torch.UntypedStorage

#: Storages with fewer bytes than this, not yet shared, travel inside the message.
INLINE_THRESHOLD = 64 * 1024


def init_reductions() -> None:
    """Register aiomp's reducers for torch's types (as torch's ``init_reductions`` does
    for ``ForkingPickler``). Called once torch has been imported."""
    register = _reduction.register
    register(torch.cuda.Event, _torch_reductions.reduce_event)
    for cls in torch._storage_classes:
        if cls is torch.UntypedStorage:
            register(cls, _reduce_storage)
        else:
            register(cls, _torch_reductions.reduce_typed_storage_child)
    register(torch.storage.TypedStorage, _torch_reductions.reduce_typed_storage)
    tensor_classes: list[type] = [*torch._tensor_classes, torch.Tensor, torch.nn.Parameter]
    for tensor_cls in tensor_classes:
        register(tensor_cls, _reduce_tensor)


def _reduce_tensor(t: torch.Tensor) -> tuple[Any, ...]:
    if t.device.type != "cpu" or t.layout is not torch.strided or t.is_nested:
        return cast("tuple[Any, ...]", _torch_reductions.reduce_tensor(t))
    if t.is_quantized:  # torch's pickling (its storage still comes back here)
        # Untyped where torch is installed, unknown where it is not.
        return cast("tuple[Any, ...]", t.__reduce_ex__(5))  # type: ignore[no-untyped-call,unused-ignore]
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
            "autograd does not support crossing process boundaries. If you just want to "
            "transfer the data, call detach() on the tensor before putting it in an aiomp "
            "message (torch.multiprocessing refuses it the same way)"
        )
    torch.utils.hooks.warn_if_has_hooks(t)
    dtype = _DTYPE_CODES.get(t.dtype, t.dtype)
    return _rebuild_tensor, (
        _storage(t.untyped_storage()),
        dtype,
        t.storage_offset(),
        tuple(t.size()),
        t.stride(),
        t.requires_grad,
        type(t) is torch.nn.Parameter,
    )


#: Common dtypes travel as a small int: unpickling ``torch.float32`` costs a global lookup.
_DTYPES = tuple(
    getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    )
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _rebuild_tensor(
    storage: Any,
    dtype: Any,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    if type(dtype) is int:
        dtype = _DTYPES[dtype]
    t = torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_storage(storage: Any) -> tuple[Any, ...]:
    if storage.device.type != "cpu":
        return cast("tuple[Any, ...]", _torch_reductions.reduce_storage(storage))
    return _same, (_storage(storage),)


def _same(storage: Any) -> Any:
    return storage


def _storage(storage: Any) -> object:
    """What stands for ``storage`` in the message being pickled: one object per storage
    and message, so that the pickler's memo sends it once and the receiver rebuilds one
    storage for all the tensors on it."""
    pad = _reduction.current()
    holders: dict[int, object] = pad.once(_storage, dict)  # storage cdata -> its holder
    hit = holders.get(storage._cdata)
    if hit is not None:
        return hit
    nbytes = storage.nbytes()
    holder: object
    if storage.is_shared():
        fd = _shared_fd(storage)
        holder = _FdStorage(storage, fd, nbytes) if fd >= 0 else _NamedStorage(storage)
    elif nbytes < INLINE_THRESHOLD:
        holder = _InlineStorage(ctypes.string_at(storage.data_ptr(), nbytes) if nbytes else b"")
    elif _torch_mp.get_sharing_strategy() == "file_system":
        holder = _NamedStorage(storage)
    else:
        fd, size = storage._share_fd_cpu_()  # moves it into shared memory, in place
        holder = _FdStorage(storage, fd, size)
    pad.keep_alive(storage)  # so that its cdata, the key, stays its own while pickling
    holders[storage._cdata] = holder
    return holder


def _shared_fd(storage: Any) -> int:
    """The fd of a ``file_descriptor`` shared storage; -1 for a ``file_system`` one."""
    try:
        return int(storage._get_shared_fd())
    except RuntimeError:
        return -1


class _FdStorage:
    """A shared storage's fd, attached to the message (SCM_RIGHTS)."""

    __slots__ = ("fd", "key", "size", "storage")

    def __init__(self, storage: Any, fd: int, size: int) -> None:
        self.storage, self.fd, self.size = storage, fd, size
        self.key = _remember(storage, fd)

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            index = _reduction.add_fd(self.fd)
        except TransportError as exc:  # too many fds for one message
            exc.add_note(
                "each shared torch storage in a message carries its fd: send fewer "
                "separate tensors per message, or use "
                "torch.multiprocessing.set_sharing_strategy('file_system')"
            )
            raise
        # The fd is the storage's own: keep the storage (and so the fd) until sent.
        storage = self.storage
        _reduction.on_sent(lambda: storage)
        return _rebuild_fd_storage, (index, self.size, self.key)


#: storage cdata -> (weak ref, segment key), for the storages put in torch's cache here
_remembered: dict[int, tuple[Any, tuple[int, int]]] = {}


def _remember(storage: Any, fd: int) -> tuple[int, int]:
    """As torch does at every send, once per storage: put it in torch's ``shared_cache``,
    so that this process, receiving its segment back, gets this very storage. Returns
    the segment's key (torch's ``fd_id``), which travels with the fd."""
    hit = _remembered.get(storage._cdata)
    if hit is not None and not hit[0].expired():
        return hit[1]  # our weak ref keeps the storage's cdata from being reused meanwhile
    ref, key = _torch_reductions.StorageWeakRef(storage), _torch_reductions.fd_id(fd)
    _torch_reductions.shared_cache[key] = ref
    if len(_remembered) >= 256:
        for cdata, (old, _) in list(_remembered.items()):
            if old.expired():
                del _remembered[cdata]
    _remembered[storage._cdata] = (ref, key)
    return key  # type: ignore[no-any-return]  # torch's storage keys are untyped


def _rebuild_fd_storage(index: int, size: int, key: tuple[int, int]) -> Any:
    # The key names the segment (no fstat needed here): the fd travelled with it in the
    # same datagram, so it cannot be another segment's.
    fd = _reduction.peek_fd(index)  # loads closes it; torch keeps its own duplicate
    storage = _torch_reductions.storage_from_cache(torch.UntypedStorage, key)
    if storage is None:
        storage = _Storage._new_shared_fd_cpu(fd, size)
        _torch_reductions.shared_cache[key] = _torch_reductions.StorageWeakRef(storage)
    return storage


class _NamedStorage:
    """A ``file_system`` shared storage: its name, held by torch's reference count while
    the message is in flight (as torch does), released if the message is never sent."""

    __slots__ = ("storage",)

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        storage = self.storage
        manager, handle, size = storage._share_filename_cpu_()
        storage._shared_incref()
        _reduction.on_unsent(storage._shared_decref)
        _reduction.on_copy(storage._shared_incref)
        return _rebuild_named_storage, (manager, handle, size)


def _rebuild_named_storage(manager: bytes, handle: bytes, size: int) -> Any:
    return _torch_reductions.rebuild_storage_filename(_Storage, manager, handle, size)


class _InlineStorage:
    """A small storage's bytes, inside the message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_inline_storage, (self.data,)


def _rebuild_inline_storage(data: bytes) -> Any:
    if not data:
        return _Storage()
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)
