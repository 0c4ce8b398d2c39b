"""Helpers shared by the CUDA IPC tests: the fake backend's set-up and round trips."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from aiomp._cuda.state import state as _state
from aiomp._wire import pickling as _reduction

ROOT = Path(__file__).resolve().parents[2]


def received(obj: object) -> Any:
    """Like :func:`roundtrip`, but unpickled as another process would: through the IPC
    handles (the consumer opens them), not through the producer's own records."""
    out = _reduction.dumps(obj)
    try:
        fds = [os.dup(fd) for fd in out.fds]
        prod = _state.producer
        _state.producer = None
        try:
            return _reduction.loads(out.body, fds)
        finally:
            _state.producer = prod
    finally:
        out.close()


MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install aiomp[cuda])"
    # Probe in a throwaway process: initialising CUDA here would make every later
    # fork-based test in this session refuse to fork (R14).
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        r = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return "probing for a CUDA device timed out"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"no usable CUDA device ({last})"
    if int(r.stdout.strip() or "0") < 1:
        return "no CUDA device visible"
    return None
