"""The child side of :func:`aiomp.spawn`: the target of every process spawn starts.

The child runs :func:`aiomp._child.bootstrap.begin`; receives ``(fn, args, is_async)``
with its start or on its report socket (fds for shared arrays and queues travel in the
same message); runs ``fn(rank, *args)``, on a fresh event loop if it is a coroutine
function; and sends back ``("ok", result)`` or ``("err", ErrorPayload)``
(``aiomp._child.report``) *before* the interpreter shuts down, so a failure reaches the
parent at once, then exits (code 1 after an error). A KeyboardInterrupt or a cancelled
coroutine is reported as an error, never as success. Owns the child's end of the report
socket. Standard library and [child] modules only.
"""

from __future__ import annotations

import socket
import sys

from .._child.bootstrap import begin, exit_fast
from .._child.output import forward_logging
from .._child.report import report_error, send_message
from .._child.runner import run_fn
from .._process.start import Start
from .._wire import datagram as _transport
from .._wire import pickling as _reduction


def main(
    rank: int,
    sock: socket.socket,
    start: Start,
    fn: object = None,
    spawned: bool = False,
    payload: bytes | None = None,
) -> None:
    """Entry point of a child :func:`aiomp.spawn` started (``multiprocessing.Process``
    target). ``start``: see :class:`aiomp._child.bootstrap.Start`. ``spawned``: started
    by the ``spawn`` method, whose children exit through the interpreter's teardown (fork
    and forkserver children skip it already). ``payload``: the datagram of ``(fn, args,
    is_async)`` when it came with the start; None: it arrives on ``sock`` (it holds fds)."""
    begin(start)
    if payload is None:
        got = _transport.recv_sync(sock)
        assert got is not None
    else:
        got = (payload, [])
    _, body, fds = _transport.decode(*got)
    loaded: tuple[object, tuple[object, ...], bool] = _reduction.loads(body, fds)  # type: ignore[assignment]
    payload_fn, args, is_async = loaded
    if fn is None:
        fn = payload_fn
    del got, body, fds, payload, loaded
    if start.output is not None:
        forward_logging(start.output[3], start.output[4])
    try:
        result = run_fn(fn, (rank, *args), is_async)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, cancellation: failures
        report_error(sock, exc)
        sock.close()
        sys.exit(1)
    try:
        out = _reduction.dumps(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        report_error(sock, exc, f"the return value of rank {rank} could not be pickled")
        sock.close()
        sys.exit(1)
    send_message(sock, out)
    # Left open: it closes as this process exits, and that hang-up is when the parent
    # reads the report, with the exit itself. Detached, so that collecting it neither
    # closes nor warns.
    sock.detach()
    if spawned:
        del result, out
        exit_fast()
