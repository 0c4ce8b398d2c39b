"""CUDA IPC with real CuPy in spawned children (``@pytest.mark.gpu``).

The test process itself never imports cupy or initialises CUDA (so later fork-based tests in
the same session stay legal); it only probes for a device in a throwaway subprocess. The tests
skip with the reason when cupy is missing or no device is visible.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import anyio
import pytest

import aiomp
from tests.children import cuda as _funcs_cuda
from tests.cuda._cuda import ROOT, _env

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


GPU_TIMEOUT = 180  # children import cupy and initialise CUDA: seconds, not milliseconds


async def run_pair(
    producer: Any, pargs: tuple[object, ...], consumer: Any, cargs: tuple[object, ...]
) -> tuple[Any, Any]:
    # Leaving joins the consumer, then the producer (which outlives what it sent).
    with anyio.fail_after(GPU_TIMEOUT):
        async with (
            aiomp.spawn(producer, 1, args=pargs, grace_period=2) as pctx,
            aiomp.spawn(consumer, 1, args=cargs, grace_period=2) as cctx,
        ):
            pass
    return pctx.results[0], cctx.results[0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("arrays", ["whole", "slice", "several", "ipc_safe"])
async def test_gpu_transfer(gpu: None, arrays: str) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (verdict, held, producer_view), ok = await run_pair(
        _funcs_cuda.gpu_send, (q, back, arrays), _funcs_cuda.gpu_check, (q, back, arrays)
    )
    same, held_in, open_in, held_after, open_after = verdict
    assert ok is True and same is True  # contents equal after transfer
    # several small arrays: copied into one staging block, one slot, one open
    assert (held_in, open_in) == (1, 1)
    assert (held_after, open_after) == (0, 0)  # dropping the views released and closed
    assert held == 0  # the producer saw the release
    if arrays == "ipc_safe":  # in place: the consumer's writes, seen by the producer
        assert producer_view == [-1.0] * 100
    elif arrays == "slice":  # under 2 MiB: it travelled as a copy
        assert producer_view == [float(i) for i in range(1000, 1100)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_two_arrays_in_one_allocation_both_stay_alive(gpu: None) -> None:
    """Defect 1 (issue 16) on hardware: two arrays split from one pool allocation, in one
    message, both deleted by the producer, which then allocates over freed memory."""
    q, back = aiomp.Queue(), aiomp.Queue()
    (one_allocation, sums, held), got = await run_pair(
        _funcs_cuda.gpu_two_chunks_send, (q, back), _funcs_cuda.gpu_two_chunks_check, (q, back)
    )
    assert one_allocation, "CuPy did not split one allocation: the test proves nothing"
    assert tuple(sums) == tuple(got) == (1.0 * (1 << 20), 2.0 * (1 << 20))
    assert held == 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_ipc_safe_blocks(gpu: None) -> None:
    with anyio.fail_after(GPU_TIMEOUT):
        ctx = await aiomp.spawn(_funcs_cuda.gpu_ipc_safe_blocks, 1, grace_period=2)
        await ctx.join()
    aligned_and_zeroed, recycled, bigger_aligned = ctx.results[0]
    assert aligned_and_zeroed and recycled and bigger_aligned


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_stream_ordering(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (pending, _done), (total, minimum) = await run_pair(
        _funcs_cuda.gpu_stream_order_send, (q, back), _funcs_cuda.gpu_stream_order_check, (q, back)
    )
    assert pending, "the producer's kernel finished before put: the test proves nothing"
    assert minimum == 7.0
    assert total == 7.0 * (1 << 20)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_many_transfers_do_not_grow_device_memory(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (held, samples, pstats), (bad, cstats) = await run_pair(
        _funcs_cuda.gpu_many_send, (q, back, 200), _funcs_cuda.gpu_many_check, (q, back)
    )
    assert bad == 0
    assert held == 0
    (used0, total0, free0), (used1, total1, free1) = samples
    assert used1 <= used0  # every sent block went back to the pool
    assert total1 <= total0  # ...and was reused, not reallocated
    assert free1 >= free0 - (64 << 20)
    assert aiomp.cuda.IpcStatistics(*pstats).events == 0
    assert aiomp.cuda.IpcStatistics(*cstats)[3:5] == (0, 0)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_consumer_killed_does_not_pin_memory(gpu: None) -> None:
    q, back, ctl = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(GPU_TIMEOUT):
        cctx = await aiomp.spawn(_funcs_cuda.gpu_hold_then_block, 1, args=(q, back), grace_period=1)
        try:
            async with aiomp.spawn(
                _funcs_cuda.gpu_send_then_collect, 1, args=(q, ctl), grace_period=2
            ) as pctx:
                tag, first = await back.get()
                assert (tag, first) == ("holding", 3.0)
                os.kill(cctx.pids()[0], signal.SIGKILL)
                with pytest.raises(aiomp.ProcessExitedException):
                    await cctx.join()
                await ctl.put("killed")
        finally:
            await cctx.terminate()
    # (still held or in flight before the kill, held by nobody after it)
    assert pctx.results == [(1, 0)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_sending_a_received_array_onward_raises(gpu: None) -> None:
    q, q2, back, back2 = aiomp.Queue(), aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(GPU_TIMEOUT):
        async with (
            aiomp.spawn(_funcs_cuda.gpu_send_one, 1, args=(q, back), grace_period=2) as s,
            aiomp.spawn(_funcs_cuda.gpu_forward, 1, args=(q, q2, back, back2), grace_period=2) as f,
            aiomp.spawn(_funcs_cuda.gpu_recv_forwarded, 1, args=(q2, back2), grace_period=2) as r,
        ):
            pass
    assert s.results == ["done"]
    assert str(f.results[0]).startswith(
        "refused: cannot send a CuPy array that this process received"
    )
    assert r.results[0] == list(range(16))  # the copy travelled


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_device_not_visible_to_the_consumer(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    sent, got = await run_pair(
        _funcs_cuda.gpu_send_one, (q, back), _funcs_cuda.gpu_recv_invisible, (q, back)
    )
    assert sent == "failed"
    assert str(got).startswith("CudaIpcError: a CuPy array on the GPU at PCI bus id")
    # CUDA_VISIBLE_DEVICES="" hides every device: the runtime's own reason is given
    assert "has no usable CUDA device" in str(got) and "CUDA_VISIBLE_DEVICES" in str(got)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_fork_with_cuda_initialised_raises(gpu: None) -> None:
    with anyio.fail_after(GPU_TIMEOUT):
        ctx = await aiomp.spawn(_funcs_cuda.gpu_fork_after_init, 1, grace_period=2)
        await ctx.join()
    assert "cannot fork: CUDA is initialised" in str(ctx.results[0])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_example_serves_requests(gpu: None) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cuda_inference.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GPU_TIMEOUT,
        env=_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "served 32 requests" in r.stdout
    assert "still hold" not in r.stderr
