"""Placement: each child's environment (``env=``) and torchrun's rendezvous variables.

:func:`slot_envs` checks a Pool's or spawn's ``env=`` in the caller (a ``TypeError``
before anything starts) and gives each slot's dict once: a replacement worker gets its
slot's again. :func:`rendezvous` is what ``torchrun`` sets, with a free ``MASTER_PORT``
per job. :func:`spawn_environment` puts an env in place for a ``spawn`` start, in the
new interpreter's initial environment: before it runs anything, ``sitecustomize`` and
CUDA's initialisation included. Owns the ports handed out to rendezvous jobs.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

#: ``env=``: a mapping of str to str for every slot, or a callable ``env(slot)``.
Env = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None

#: Ports given to rendezvous jobs lately: never given again while in here, so that two
#: jobs never share one even before the first job's rank 0 has bound its own.
_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=4096)


#: The longest ``NAME=value`` string (its NUL included) that ``execve`` takes: Linux's
#: ``MAX_ARG_STRLEN``, 32 pages. A longer one fails the exec with E2BIG.
MAX_ENV_STRING = 32 * 4096


def check_env(env: object, where: str = "env") -> dict[str, str]:
    """``env`` as a plain dict, checked as ``execve`` and ``os.environ`` will take it:
    ``TypeError`` naming the first key or value that is not a str, ``ValueError`` naming
    a name that cannot be a variable's (empty, ``=`` or NUL in it), a NUL in a value, or a
    variable longer than exec takes (E2BIG)."""
    if not isinstance(env, Mapping):
        raise TypeError(f"{where} must be a dict of str to str, not {type(env).__name__}")
    out = {}
    for k, v in env.items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: the key {k!r} is a {type(k).__name__}, not a str")
        if not isinstance(v, str):
            raise TypeError(f"{where}[{k!r}] is a {type(v).__name__}, not a str: {v!r:.80}")
        if not k or "=" in k or "\0" in k:
            raise ValueError(f"{where}: {k!r} cannot name an environment variable")
        if "\0" in v:
            raise ValueError(f"{where}[{k!r}] holds a NUL character, which exec cannot pass")
        size = len(os.fsencode(k)) + len(os.fsencode(v)) + 2
        if size > MAX_ENV_STRING:
            raise ValueError(
                f"{where}[{k!r}] is {size} bytes as NAME=value, over the "
                f"{MAX_ENV_STRING} bytes exec takes for one variable (E2BIG): pass "
                "large data as an argument or in a file instead"
            )
        out[k] = v
    return out


def slot_envs(env: Env, n: int) -> list[dict[str, str]] | None:
    """Each of ``n`` slots' env (None: no ``env=``), checked: ``env(slot)`` is called
    here, once per slot."""
    if env is None:
        return None
    if callable(env):
        return [check_env(env(i), f"env({i})") for i in range(n)]
    one = check_env(env)
    return [one] * n


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now and that no job of this
    process was given lately."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port
    raise OSError("no free port for MASTER_PORT")  # pragma: no cover


def rendezvous(n: int) -> list[dict[str, str]]:
    """torchrun's variables for each of ``n`` local ranks, with one free port for all."""
    common = {
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]


class _ForkExecWithEnv:
    """``_posixsubprocess`` for multiprocessing's ``spawnv_passfds`` called from the
    thread that installed it: its ``fork_exec`` gets an environment (the module's
    sixth argument; multiprocessing passes None, "inherit"). Other threads get the
    real module's, unchanged."""

    def __init__(self, real: Any, env: list[bytes]) -> None:
        self._real = real
        self._env = env
        self._thread = threading.get_ident()

    def fork_exec(self, *args: Any) -> Any:
        if threading.get_ident() == self._thread and args[5] is None:
            args = (*args[:5], self._env, *args[6:])
        return self._real.fork_exec(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def spawn_environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """While in it, a ``spawn`` process started by this thread execs with ``os.environ``
    merged with ``env``. This process's own environment is never changed (no
    ``putenv`` that other threads could race)."""
    if not env:
        yield
        return
    import _posixsubprocess
    from multiprocessing import resource_tracker

    # The tracker is started by the first spawn start: never with a slot's env.
    resource_tracker.ensure_running()
    merged = {**os.environ, **env}
    items = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in merged.items()]
    sys.modules["_posixsubprocess"] = _ForkExecWithEnv(_posixsubprocess, items)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.modules["_posixsubprocess"] = _posixsubprocess
