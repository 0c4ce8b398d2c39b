"""The one error report a child sends (``aiomp._child.report``), for spawn and the Pool:
its text always arrives, the exception itself when the parent can rebuild it."""

from __future__ import annotations

import threading
from typing import Any

from aiomp._child import report
from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction


def _received(exc: BaseException, **kwargs: Any) -> Any:
    ours, theirs = _transport.socketpair(large=False)
    try:
        report.report_error(theirs, exc, **kwargs)
        got = _transport.recv_sync(ours)
        assert got is not None
        _, body, fds = _transport.decode(*got)
        return _reduction.loads(body, fds)
    finally:
        ours.close()
        theirs.close()


def test_spawn_reports_an_error_payload_the_parent_rebuilds() -> None:
    kind, payload = _received(ValueError("bad"), context="rank 0")
    assert kind == "err" and isinstance(payload, report.ErrorPayload)
    assert payload.text.startswith("rank 0:\n") and "ValueError: bad" in payload.text
    exc, why = payload.rebuild()
    assert isinstance(exc, ValueError) and why == ""


def test_an_exception_that_cannot_travel_still_sends_its_text() -> None:
    lock = threading.Lock()
    _, payload = _received(RuntimeError(lock), traceback=False)
    assert payload.text.startswith("RuntimeError: <unlocked _thread.lock")
    assert payload.data is None and "TypeError" in payload.why
    assert payload.rebuild() == (None, payload.why)
