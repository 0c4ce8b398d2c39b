"""torch tensors in aiomp messages (README "Coming from torch.multiprocessing", issue 12).

CPU tensors travel as torch.multiprocessing shares them: an already shared storage as its
fd inside the message, a non-shared storage of 64 KiB or more moved into shared memory in
place first, a smaller one inline. Pure parts first (through a queue read back in this
process, or ``_reduction.dumps`` alone), then contract tests with children: spawn args and
results, a sender that exits first, torch's ``file_system`` strategy, Pool tasks, the
Hogwild example. Skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")

import aiomp  # noqa: E402
from aiomp._arrays import torch as _torch  # noqa: E402
from aiomp._wire import pickling as _reduction  # noqa: E402
from tests.children import torch as funcs  # noqa: E402

TIMEOUT = 60  # children import torch: seconds each on two busy cores
GRACE = 0.5
REPO = Path(__file__).resolve().parents[2]
INLINE = _torch.INLINE_THRESHOLD
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])


def roundtrip(obj: object) -> Any:
    """Send ``obj`` through a fresh queue and read it back in this process."""
    q = aiomp.Queue()
    q.sync.put(obj)
    got = q.sync.get(timeout=5)
    q.close()
    return got


def same_storage(a: Any, b: Any) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def by_fd(t: Any) -> bool:
    try:
        t.untyped_storage()._get_shared_fd()
    except RuntimeError:
        return False
    return True


# -- pure: through a queue in this process -------------------------------------------------


def test_a_shared_tensor_travels_as_its_fd_whatever_its_size() -> None:
    sizes = []
    for n in (1 << 10, 1 << 16, 1 << 22):
        t = torch.zeros(n).share_memory_()
        out = _reduction.dumps(t)
        sizes.append(len(out.body))
        assert out.fds == [t.untyped_storage()._get_shared_fd()], "its own fd, once"
        out.close()
    assert max(sizes) - min(sizes) < 16 and max(sizes) < 512, sizes


def test_a_received_shared_tensor_is_the_same_memory() -> None:
    t = torch.zeros(1000).share_memory_()  # small, but shared: by fd, never inline
    got = roundtrip(t)
    assert got.is_shared() and by_fd(got)
    got[3] = 5.0
    assert t[3] == 5.0
    t[4] = 6.0
    assert got[4] == 6.0
    assert same_storage(roundtrip(got), t), "received back: torch's cache maps it once"


def test_a_large_tensor_is_moved_into_shared_memory_in_place() -> None:
    """Issue 12: a 4 MiB tensor arrived as a pickled copy (torch's ``__reduce__``)."""
    t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB, not shared
    view = t[100:]
    got = roundtrip(t)
    assert t.is_shared() and view.is_shared(), "moved in place, as torch does"
    assert got.is_shared() and torch.equal(got, torch.arange(1 << 20, dtype=torch.float32))
    got[100] = -1.0
    assert t[100] == -1.0 and view[0] == -1.0, "writes are seen both ways"


def test_a_small_tensor_travels_inline() -> None:
    t = torch.arange(INLINE // 4 - 1, dtype=torch.float32)
    out = _reduction.dumps(t)
    assert out.fds == [] and not t.is_shared()
    out.close()
    got = roundtrip(t)
    assert torch.equal(got, t) and not got.is_shared()
    got[0] = 9.0
    assert t[0] == 0.0, "a copy"


def test_views_sent_together_stay_views() -> None:
    """Issue 12: ``[x, x[2], x[:, 1]]`` with an 8 MiB ``x`` gave copies, not views."""
    x = torch.arange(1024 * 1024, dtype=torch.float64).reshape(1024, 1024)
    for msg in ([x, x[2], x[:, 1]], [x[2], x[:, 1], x]):
        got = roundtrip(msg)
        rx = got[0] if got[0].dim() == 2 else got[2]
        row = got[1] if got[0].dim() == 2 else got[0]
        col = got[2] if got[0].dim() == 2 else got[1]
        assert same_storage(rx, row) and same_storage(rx, col)
        assert (row.storage_offset(), row.stride()) == (2048, (1,))
        assert (col.storage_offset(), col.stride()) == (1, (1024,))
        rx[2, 1] = -7.0
        assert row[1] == -7.0 and col[2] == -7.0
        x[2, 1] = 0.0


def test_small_views_of_one_small_storage_stay_views() -> None:
    x = torch.arange(100, dtype=torch.int32)
    a, b = roundtrip([x[10:20], x[15:]])
    assert same_storage(a, b) and not a.is_shared()
    assert (a.storage_offset(), b.storage_offset()) == (10, 15)
    a[5] = -1
    assert b[0] == -1 and x[15] == 15


def test_many_tensors_on_one_storage_send_one_fd() -> None:
    x = torch.zeros(1000, 100).share_memory_()
    out = _reduction.dumps([x[i] for i in range(1000)])
    assert len(out.fds) == 1, "R1: one fd per storage, not per tensor"
    out.close()


@pytest.mark.parametrize(
    "dtype",
    [
        "bool",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int64",
        "complex64",
        "float64",
    ],
)
@pytest.mark.parametrize("n", [7, INLINE], ids=["inline", "shared"])
def test_dtypes_strides_offsets_and_grad(dtype: str, n: int) -> None:
    dt = getattr(torch, dtype)
    base = (torch.arange(n * 4) % 3).to(dt).reshape(n, 4)
    views = [base, base.t(), base[1:, ::2], base[:, 3]]
    got = roundtrip(views)
    for sent, back in zip(views, got, strict=True):
        assert back.dtype == dt and torch.equal(back, sent)
        assert (back.stride(), back.storage_offset()) == (sent.stride(), sent.storage_offset())
        assert same_storage(back, got[0])
    if dt.is_floating_point:
        leaf = torch.ones(n, dtype=dt, requires_grad=True)
        param = torch.nn.Parameter(torch.ones(n, dtype=dt), requires_grad=False)
        g, p = roundtrip([leaf, param])
        assert g.requires_grad and g.is_leaf and type(p) is torch.nn.Parameter
        assert not p.requires_grad


def test_a_non_leaf_tensor_requiring_grad_is_refused_at_put() -> None:
    w = torch.ones(INLINE, requires_grad=True)
    q = aiomp.Queue()
    with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
        q.sync.put([w * 2])
    assert q.empty()
    q.close()


def test_a_storage_on_its_own_and_empty_tensors() -> None:
    s = torch.arange(INLINE, dtype=torch.uint8).untyped_storage()
    t = torch.empty(0)
    got_s, got_t = roundtrip([s, t])
    assert isinstance(got_s, torch.UntypedStorage) and got_s.is_shared()
    assert got_t.shape == (0,)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse checks, deprecations
def test_other_layouts_travel_through_torch_reducers() -> None:
    sparse = torch.randn(300, 300).to_sparse()  # its values' storage: moved, by fd
    quantized = torch.quantize_per_tensor(torch.randn(100), 0.1, 0, torch.qint8)
    meta = torch.empty(3, 4, device="meta")
    got_sparse, got_q, got_meta = roundtrip([sparse, quantized, meta])
    assert torch.equal(got_sparse.to_dense(), sparse.to_dense())
    assert torch.equal(got_q.int_repr(), quantized.int_repr()) and got_q.q_scale() == 0.1
    assert got_meta.is_meta and got_meta.shape == (3, 4)


def test_too_many_storages_for_one_message_say_what_to_do() -> None:
    params = [torch.zeros(4).share_memory_() for _ in range(300)]
    with pytest.raises(Exception, match="at most") as info:
        _reduction.dumps(params)
    assert any("file_system" in note for note in getattr(info.value, "__notes__", []))


def test_aiomp_never_imports_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import aiomp
        q = aiomp.Queue()
        q.sync.put([np.zeros(100_000), 1])
        q.sync.get(timeout=5)
        q.close()
        assert "torch" not in sys.modules, "aiomp imported torch"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=TIMEOUT)


# -- with children ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_shared_tensor_in_spawn_args_is_written_in_place() -> None:
    """Issue 12: a ``share_memory_()`` tensor in spawn args arrived as a pickled copy, so
    the children's in-place writes never reached the parent (Hogwild stopped sharing)."""
    t = torch.zeros(2, 1000).share_memory_()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.add_inplace, 2, args=(t, 1.0), grace_period=GRACE):
            pass
    assert (t[0] == 1.0).all() and (t[1] == 2.0).all(), "1 + rank, added by each rank"


@pytest.mark.anyio
@ONE_LOOP
async def test_tensors_returned_by_an_exited_child() -> None:
    n = INLINE  # 256 KiB of float32
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.make_tensors, 1, args=(n,), grace_period=GRACE)
        await ctx.join()
    big, view, small = ctx.results[0]
    assert big.is_shared() and torch.equal(big, torch.arange(n, dtype=torch.float32))
    assert same_storage(big, view) and view.storage_offset() == 10
    assert torch.equal(small, torch.arange(5, dtype=torch.int16)) and not small.is_shared()


@pytest.mark.anyio
@ONE_LOOP
async def test_the_sender_exits_before_the_receiver_reads() -> None:
    # R2: the fd travels in the message; torch's listener thread would be gone here.
    n = 50_000
    q = aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.put_then_exit, 1, args=(q, n), grace_period=GRACE):
            pass  # joined: the child has exited
        shared, moved, small = await q.get()
    assert (shared == 3.0).all() and shared.is_shared()
    assert torch.equal(moved, torch.arange(n, dtype=torch.float64)) and moved.is_shared()
    assert torch.equal(small, torch.ones(3))
    q.close()


@pytest.mark.anyio
@ONE_LOOP
async def test_a_tensor_forwarded_by_a_child_comes_back_as_the_same_storage() -> None:
    # Pipelines forward buffers: the child sends on the storage it received, by its fd.
    from tests.children import queue as qfuncs

    x = torch.arange(INLINE, dtype=torch.float32)  # moved into shared memory by the put
    qin, qout = aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(qfuncs.q_forward, 1, args=(qin, qout), grace_period=GRACE):
            await qin.put((x, x[5:]))
            back, tail = await qout.get()
            qin.close()
    assert same_storage(back, x) and same_storage(tail, x), "mapped once: x's own storage"
    assert tail.storage_offset() == 5
    back[0] = -1.0
    assert x[0] == -1.0
    qout.close()


@pytest.mark.anyio
@ONE_LOOP
async def test_torch_file_system_strategy_is_kept() -> None:
    # Both ends are children: torch's file_system strategy starts torch_shm_manager as a
    # child of the process that shares first, and connects to it from the receiver.
    q, reply = aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.file_system_pair, 2, args=(q, reply), grace_period=GRACE
        ) as ctx:
            pass
    written, received = ctx.results
    assert received == (True, False, True, 10), "shared, by name (not fd), one storage, view"
    assert written == (7.0, 8.0), "the receiver's writes reached the sender"
    q.close()
    reply.close()


@pytest.mark.anyio
@ONE_LOOP
async def test_pool_args_and_results() -> None:
    t = torch.ones(INLINE)  # 256 KiB: moved into shared memory by the call
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, grace_period=GRACE) as pool:
            result = await pool.apply(funcs.scale_, (t, 2.0))
    assert t.is_shared() and (t == 2.0).all(), "the worker scaled the caller's tensor"
    assert result.is_shared() and (result == 2.0 * INLINE).all()


@pytest.mark.slow
@pytest.mark.leaks_ok  # its own interpreter: nothing of it is ours; and in its 10-60 s, names
# that other runs on this machine leave in /dev/shm would be counted against it
def test_hogwild_example_runs() -> None:
    """Two ranks for two epochs (the example's default is four for three): each rank's
    torch import is most of its cost, and two already write the shared parameters."""
    proc = subprocess.run(
        [sys.executable, "examples/hogwild_torch.py", "--ranks", "2", "--epochs", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loss" in proc.stdout and "ok" in proc.stdout.splitlines()[-1], proc.stdout


def _cuda_missing() -> str | None:
    """Why torch cannot use CUDA here, asked in a throwaway interpreter (this one must not
    initialise CUDA: the driver's fds would outlive the test, and fork would be illegal)."""
    probe = "import torch; print(torch.cuda.device_count())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"torch cannot probe CUDA: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None if int(r.stdout.strip() or 0) > 0 else "no CUDA device for torch"


@pytest.mark.gpu
@pytest.mark.anyio
@ONE_LOOP
async def test_cuda_tensor_through_torch_ipc() -> None:
    # Issue 32, first run on a GPU (H100): the parent made the tensor, so it held CUDA's
    # fds past the test, and the child sent the received tensor back, which torch refuses.
    # Now one child produces, another consumes, and the parent never touches CUDA.
    why = _cuda_missing()
    if why is not None:
        pytest.skip(why)
    q, back = aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT * 2):
        async with (
            aiomp.spawn(funcs.cuda_send, 1, args=(q, back), grace_period=GRACE) as producer,
            aiomp.spawn(funcs.cuda_check, 1, args=(q, back), grace_period=GRACE),
        ):
            pass
    device, same, onward = producer.results[0]
    assert (device, same) == ("cuda", True)
    assert "Consider cloning before sending" in onward  # torch's rule, raised at put


def test_leak_check_sees_torch_fds_go() -> None:
    # A received storage keeps torch's duplicate of the fd while it lives (as in torch);
    # it goes with the storage.
    before = set(os.listdir("/proc/self/fd"))
    got = roundtrip(torch.zeros(INLINE).share_memory_())
    assert got.is_shared()
    del got
    gc.collect()
    assert set(os.listdir("/proc/self/fd")) <= before
