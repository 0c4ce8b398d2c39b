"""Connecting to Ray for :class:`aiomp.ray.Pool`: where ``ray.init`` will connect, a probe
that something answers there, and one ``ray.init`` in a worker thread whose caller may
leave first. Owns the lock held around a pool's ``ray.init`` and ``ray.shutdown``.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio

#: Seconds a TCP connection to the cluster's address may take before the pool raises
#: ``ConnectionError``: ``ray.init`` itself retries an address where nothing answers for
#: minutes, in a thread that cannot be interrupted.
PROBE_TIMEOUT = 5.0

#: Held (in worker threads only) around a pool's ray.init and ray.shutdown: one at a time,
#: one whose caller was cancelled and has left included.
connect_lock = threading.Lock()


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError('aiomp.ray.Pool needs Ray: pip install "aiomp[ray]"') from exc
    return ray


def bootstrap_address(address: str | None) -> tuple[str, int] | None:
    """Where ``ray.init(address)`` will connect: the cluster's GCS (a ``ray://`` address:
    its Ray Client server), or None where it starts a local instance (or where the address
    says no port: ``ray.init`` says what is wrong with it). Blocks (it may scan processes).
    """
    target: str | None
    if address is not None and address.startswith("ray://"):
        target = address.removeprefix("ray://")
    else:
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # Ray moved it: the address as given
            target = None if address in (None, "auto", "local") else address
        else:
            # As ray.init resolves it: RAY_ADDRESS, the latest local instance, localhost
            # as the node's IP. (Typed as taking a str, it takes None too: its docstring.)
            try:
                target = canonicalize_bootstrap_address(address)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - nothing to probe: ray.init says what is wrong
                return None
    if not target:
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


async def probe(host: str, port: int, address: str | None) -> None:
    """Raise ``ConnectionError`` unless something accepts a TCP connection at ``host:port``
    within :data:`PROBE_TIMEOUT` seconds (cancellable: it runs on the loop)."""
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            stream = await anyio.connect_tcp(host, port)
    except OSError as exc:  # TimeoutError included
        raise ConnectionError(
            f"no Ray cluster answers at address={address!r}: connecting to {host}:{port} "
            f"failed ({exc or f'no answer in {PROBE_TIMEOUT:g} s'})"
        ) from exc
    await stream.aclose()


class Connecting:
    """One ``ray.init`` in a worker thread, whose caller may be cancelled and leave first.

    Whichever of the two is done first takes the one token: the thread, when ``ray.init``
    has returned (the caller then owns the session it opened, ``started``), or the caller
    as it leaves (the thread then shuts that session down itself: nobody would use or
    close it).
    """

    def __init__(self, ray: Any, address: str | None) -> None:
        self._ray = ray
        self._address = address
        self._token = [None]
        self.started = False  # this ray.init opened the session

    def run(self) -> bool:
        """(In the worker thread) Connect; True if this opened the session."""
        ray = self._ray
        with connect_lock:
            if not ray.is_initialized():
                try:
                    ray.init(address=self._address)
                except SystemExit as exc:  # Ray's core worker gives up on an absent GCS so
                    raise ConnectionError(
                        f"ray.init(address={self._address!r}) gave up: SystemExit({exc.code})"
                    ) from exc
                self.started = True
            if self.take():
                return self.started
            if self.started:
                ray.shutdown()
            return False

    def take(self) -> bool:
        """Take the token (atomic: list.pop); False if the other side has it."""
        try:
            self._token.pop()
        except IndexError:
            return False
        return True


def shutdown_ray(ray: Any) -> None:
    with connect_lock:
        ray.shutdown()


async def connect(ray: Any, address: str | None) -> bool:
    """``ray.init(address=address)`` in a worker thread, after a :func:`probe` of the
    address (``ConnectionError`` where nothing answers); True if it opened the session.
    Cancelled, it leaves at once: a session it opened is shut down (by the thread, if it is
    still connecting; else here, shielded)."""
    where = await anyio.to_thread.run_sync(bootstrap_address, address, abandon_on_cancel=True)
    if where is not None:
        await probe(*where, address)
    connecting = Connecting(ray, address)
    try:
        return await anyio.to_thread.run_sync(connecting.run, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        if not connecting.take() and connecting.started:  # it had connected: ours to end
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shutdown_ray, ray)
        raise
