"""A child's fd 1 and fd 2 onto the parent's sockets, and its logging records to the parent.

The child's side of ``aiomp._output``: :func:`redirect_output` makes the sockets the
parent's forwarder gave it this process's stdout and stderr; :func:`forward_logging`
sends logging records on the third. Owns the child's ends once they are handed over.
Standard library only (every child imports it).
"""

from __future__ import annotations

import os
import socket
import sys


def redirect_output(
    ends: tuple[socket.socket, socket.socket, bool, socket.socket, int],
) -> None:
    """Make fd 1 and fd 2 the given sockets (see ``aiomp._output.forwarder``).

    ``sys.stdout`` is line-buffered when the third item says so (the parent's stdout is
    a terminal), as it would have been on the inherited fd; ``sys.stderr`` always is.
    The records socket and level are for :func:`forward_logging`, once fn is loaded.
    """
    out, err, line_buffered, _, _ = ends
    for fd, end in ((1, out), (2, err)):
        os.dup2(end.fileno(), fd)
        end.close()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        lines = line_buffered or fd == 2
        try:
            ours = stream.fileno() == fd
        except (AttributeError, OSError, ValueError):
            ours = False
        if ours and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=lines)
        else:
            # A fork child inherits whatever the parent had put there (pytest's capture,
            # an app's redirection), which would not reach the fd.
            mode = 1 if lines else -1
            text = open(fd, "w", buffering=mode, errors="backslashreplace", closefd=False)  # noqa: SIM115
            setattr(sys, name, text)


def forward_logging(sock: socket.socket, level: int) -> None:
    """Send this process's logging records to the parent (``aiomp._output.forwarder``).

    Only when ``logging`` is already imported (by fn's module; a child that never logs
    does not pay for it), and only as ``logging.lastResort``: the handler Python uses
    when the code configured none, so a function that configures logging itself keeps
    its own. Records below ``level`` (the parent's effective root level) stay here.
    """
    if "logging" not in sys.modules:
        sock.close()
        return
    import logging
    import pickle

    class ToParent(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                d = dict(record.__dict__)
                d["msg"], d["args"] = record.getMessage(), None
                if record.exc_info and not record.exc_text:
                    d["exc_text"] = logging.Formatter().formatException(record.exc_info)
                d["exc_info"] = None
                d.pop("message", None)
                try:
                    data = pickle.dumps(d)
                except Exception:  # noqa: BLE001 - an unpicklable `extra`: the basics go
                    data = pickle.dumps({k: d[k] for k in _RECORD_BASICS if k in d})
                sock.send(data)
            except Exception:  # noqa: BLE001 - as any handler: report, never raise
                self.handleError(record)

    logging.lastResort = ToParent()
    root = logging.getLogger()
    if not root.handlers:
        root.setLevel(level)


_RECORD_BASICS = (
    "name",
    "msg",
    "levelname",
    "levelno",
    "pathname",
    "filename",
    "module",
    "lineno",
    "funcName",
    "created",
    "msecs",
    "relativeCreated",
    "thread",
    "threadName",
    "processName",
    "process",
    "exc_text",
    "stack_info",
)
