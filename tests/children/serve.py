"""Functions that workers and spawned children run in the placement and batching tests
(importable by children)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

import aiomp

ENV_KEYS = (
    "AIOMP_TEST_SLOT",
    "AIOMP_TEST_FIXED",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def who() -> tuple[int, int, object, object, int] | None:
    """This process's worker info as a tuple, or None."""
    info = aiomp.get_worker_info()
    if info is None:
        return None
    return info.id, info.num_workers, info.seed, info.dataset, info.pid


def who_rank(rank: int) -> tuple[int, tuple[int, int, object, object, int] | None]:
    return rank, who()


def who_in_subprocess() -> str:
    """What ``get_worker_info()`` says in a process this worker starts itself."""
    code = "import aiomp; print(aiomp.get_worker_info())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def who_in_fork() -> str:
    """What ``get_worker_info()`` says in a plain ``os.fork`` of this worker."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the fork
        os.write(w, repr(aiomp.get_worker_info()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


def environ(*_: object) -> dict[str, str | None]:
    """The variables the placement tests set, as this process sees them."""
    return {k: os.environ.get(k) for k in ENV_KEYS}


def environ_rank(rank: int) -> dict[str, str | None]:
    return environ()


def seen_at_import() -> str | None:
    """``AIOMP_TEST_SLOT`` as it was when this process's interpreter started (read by
    ``sitecustomize``-like code: the environment of ``/proc/self/environ``)."""
    with open("/proc/self/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"AIOMP_TEST_SLOT="):
                return item.split(b"=", 1)[1].decode()
    return None


def seen_at_import_rank(rank: int) -> str | None:
    return seen_at_import()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def all_reduce(rank: int) -> list[float]:
    """A two-rank gloo all-reduce, set up by ``rendezvous=True`` alone."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
        dist.all_reduce(t)
        return [float(v) for v in t]
    finally:
        dist.destroy_process_group()


# -- batching --------------------------------------------------------------------------


def double_all(xs: Sequence[int]) -> list[tuple[int, int]]:
    """Each input doubled, with the batch's size: ``(2 * x, len(xs))``."""
    return [(2 * x, len(xs)) for x in xs]


async def double_all_async(xs: Sequence[int]) -> list[tuple[int, int]]:
    return double_all(xs)


def raise_value_error(xs: Sequence[object]) -> list[object]:
    raise ValueError(f"bad batch of {len(xs)}")


def one_short(xs: Sequence[object]) -> list[object]:
    return list(xs)[1:]


def die_in_batch(xs: Sequence[object]) -> list[object]:
    os.kill(os.getpid(), signal.SIGKILL)
    return list(xs)


def gate_then_double(xs: Sequence[tuple[str, int]]) -> list[int]:
    """Meet the test at the gate named by the first item, then double each number."""
    from tests.children.common import gate_wait

    gate_wait(os.getpid(), xs[0][0])
    return [2 * x for _, x in xs]


def stacked_times_two(batch: np.ndarray) -> np.ndarray:
    """A stacked batch: where it lives, and each row doubled (a new array)."""
    assert isinstance(batch, np.ndarray) and batch.ndim >= 2
    return batch * 2


def stacked_info(batch: np.ndarray) -> np.ndarray:
    """Row i: (batch size, is it shared memory, row i's first value)."""
    shared = float(aiomp.is_shared(batch))
    out = np.empty((batch.shape[0], 3))
    out[:, 0] = batch.shape[0]
    out[:, 1] = shared
    out[:, 2] = batch.reshape(batch.shape[0], -1)[:, 0]
    return out


def model_init(dim: int, seed: int) -> None:
    """An initializer that loads a 'model': ``tanh(x @ W)``."""
    global _W
    _W = np.random.default_rng(seed).standard_normal((dim, dim)).astype(np.float32) / dim**0.5


_W: np.ndarray | None = None


def model(batch: np.ndarray) -> np.ndarray:
    assert _W is not None
    return np.tanh(batch @ _W)


def who_at_gate(address: str) -> tuple[tuple[int, int, object, object, int] | None, str | None]:
    """Meet the test at the gate (so that every worker takes one), then say who this is
    and what its ``AIOMP_TEST_SLOT`` is."""
    from tests.children.common import gate_wait

    gate_wait(os.getpid(), address)
    return who(), os.environ.get("AIOMP_TEST_SLOT")


# -- examples/inference_service.py's model, with faults ---------------------------------

#: A request whose first value is CRASH kills its worker; HOLD holds its batch at the gate.
CRASH, HOLD = 1e6, 2e6
_gate_address = ""


def service_init(dim: int, seed: int, gate_address: str) -> None:
    from examples.inference_service import load_model

    global _gate_address
    _gate_address = gate_address
    load_model(dim, seed)


def service_model(batch: np.ndarray) -> np.ndarray:
    from examples.inference_service import predict
    from tests.children.common import gate_wait

    first = batch[:, 0]
    if (first == CRASH).any():
        os.kill(os.getpid(), signal.SIGKILL)
    if (first == HOLD).any():
        gate_wait(os.getpid(), _gate_address)
    return predict(batch)


# -- issue 40: serving under real traffic ------------------------------------------------


def fails_on_negative(xs: Sequence[int]) -> list[tuple[int, int]]:
    """A batch with a negative row raises, naming those rows; else ``double_all``."""
    bad = [x for x in xs if x < 0]
    if bad:
        raise ValueError(f"negative rows {bad}")
    return double_all(xs)


def init_at_gate(address: str) -> None:
    """An initializer that meets the test at the gate first (a model that loads slowly)."""
    from tests.children.common import gate_wait

    gate_wait(os.getpid(), address)


def finite_or_raise(batch: np.ndarray) -> np.ndarray:
    """A stacked batch doubled; one with a row that is not finite raises."""
    bad = int((~np.isfinite(batch)).any(axis=1).sum())
    if bad:
        raise ValueError(f"{bad} row(s) not finite")
    return batch * 2
