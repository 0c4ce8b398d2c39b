"""The message object (``aiomp._wire.pickling.Message``) and the reducers' scratchpad.

Pure: everything runs in this process. A message owns what it holds until it has been
sent: framing, ``sent_again``/``close``/``discard`` accounting, the memfd of a large body.
"""

from __future__ import annotations

import gc
import os
import pickle

import pytest

from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction
from aiomp._wire import stream as _stream
from aiomp._wire.pickling import Message
from tests._fds import devnulls, is_open


def calls() -> tuple[list[str], object]:
    log: list[str] = []
    return log, log.append


def test_small_body_frames_inline_with_its_fds() -> None:
    msg = Message(b"abc", [7, 8])
    assert msg.datagram() == (b"\x00abc", [7, 8])
    frame, fds = msg.framed()
    assert fds == [7, 8]
    assert frame == _stream.FRAME.pack(4, 2) + b"\x00abc"
    kind, body, rest = _transport.decode(frame[_stream.FRAME_SIZE :], [7, 8])
    assert (kind, bytes(body), rest) == (_transport.KIND_DATA, b"abc", [7, 8])
    msg.close()


def test_body_at_the_inline_limit_needs_no_memfd() -> None:
    body = bytes(_transport.MAX_INLINE)
    with Message(body) as msg:
        datagram, fds = msg.datagram()
        assert (len(datagram), fds) == (_transport.MAX_INLINE + 1, [])


def test_large_body_travels_in_a_memfd_the_message_owns() -> None:
    body = os.urandom(_transport.MAX_INLINE + 1)
    mine = devnulls(1)
    try:
        msg = Message(body, list(mine))
        datagram, fds = msg.datagram()
        assert datagram == _transport.large_header(len(body))
        assert fds[:-1] == mine, "the memfd travels after the message's own fds"
        memfd = fds[-1]
        assert msg.datagram() == (datagram, fds), "made once"
        assert msg.framed()[1] == fds
        received = os.dup(memfd)  # what SCM_RIGHTS would deliver
        kind, got, rest = _transport.decode(datagram, [*mine, received])
        assert kind == _transport.KIND_DATA
        assert (bytes(got), rest) == (body, mine)
        msg.close()
        assert not is_open(memfd), "close() closes the memfd"
        assert all(is_open(fd) for fd in mine), "the objects' fds are not the message's"
        msg.close()  # idempotent
    finally:
        _transport.close_fds(mine)


def test_discarded_large_message_closes_its_memfd() -> None:
    msg = Message(bytes(_transport.MAX_INLINE + 1))
    memfd = msg.datagram()[1][-1]
    msg.discard()
    assert not is_open(memfd)


def test_dropped_message_closes_its_memfd() -> None:
    msg = Message(bytes(_transport.MAX_INLINE + 1))
    memfd = msg.datagram()[1][-1]
    del msg
    gc.collect()
    assert not is_open(memfd)


def test_close_runs_cleanups_once_in_reverse() -> None:
    log, add = calls()
    msg = Message(b"x", [], [lambda: add("a"), lambda: add("b")], [lambda: add("unsent")])
    msg.close()
    msg.close()
    msg.discard()  # after close: nothing left to undo
    assert log == ["b", "a"]


def test_discard_undoes_then_closes() -> None:
    log, add = calls()
    msg = Message(b"x", [], [lambda: add("cleanup")], [lambda: add("u1"), lambda: add("u2")])
    msg.discard()
    msg.discard()
    assert log == ["u2", "u1", "cleanup"]


def test_sent_again_counts_each_extra_send() -> None:
    log, add = calls()
    msg = Message(b"x", [], [], [], [lambda: add("again")])
    msg.sent_again()
    msg.sent_again()
    assert log == ["again", "again"]
    msg.close()
    msg.sent_again()  # a closed message promises nothing more
    assert log == ["again", "again"]


def test_with_closes_on_success_and_discards_on_error() -> None:
    log, add = calls()
    with Message(b"x", [], [lambda: add("closed")], [lambda: add("undone")]):
        pass
    assert log == ["closed"]
    log.clear()
    with (
        pytest.raises(KeyError),
        Message(b"x", [], [lambda: add("closed")], [lambda: add("undone")]),
    ):
        raise KeyError
    assert log == ["undone", "closed"]


def test_dumps_counts_sends_of_objects_that_count_them() -> None:
    log, add = calls()

    class Counted:
        def __reduce__(self) -> tuple[object, ...]:
            add("pickled")
            _reduction.on_copy(lambda: add("again"))
            _reduction.on_unsent(lambda: add("undone"))
            _reduction.on_sent(lambda: add("released"))
            return int, (5,)

    msg = _reduction.dumps([Counted()])
    msg.sent_again()
    msg.discard()
    assert log == ["pickled", "again", "undone", "released"]


def test_dumps_prefix_comes_before_the_pickle() -> None:
    for obj in (b"plain", [b"reduced"]):
        with _reduction.dumps(obj, b"HEAD") as msg:
            assert msg.body.startswith(b"HEAD")
            assert pickle.loads(msg.body[4:]) == obj


def test_plain_items_skip_the_reducing_pickler() -> None:
    msg = _reduction.dumps((1, "two", b"three", None))
    assert msg.body == pickle.dumps((1, "two", b"three", None), 5)
    assert (msg.fds, msg._hooks) == ([], None)


# -- the scratchpad ------------------------------------------------------------------------


def test_scratchpad_once_makes_one_object_per_key() -> None:
    pad = _reduction.Scratchpad()
    made: list[int] = []

    def make() -> list[int]:
        made.append(1)
        return []

    first = pad.once(make, make)
    assert pad.once(make, make) is first and made == [1]
    assert pad.once(int, dict) == {} and pad.get(int) == {}
    assert pad.get(str) is None


def test_scratchpad_is_per_message_and_keeps_objects_alive() -> None:
    seen: list[object] = []

    class Noted:
        def __reduce__(self) -> tuple[object, ...]:
            pad = _reduction.current()
            box = pad.once(Noted, list)
            box.append(1)
            pad.keep_alive(object())
            seen.append(len(box))
            return int, (0,)

    _reduction.dumps([Noted(), Noted()]).close()
    _reduction.dumps([Noted()]).close()
    assert seen == [1, 2, 1], "one entry per message, shared by its objects"


def test_scratchpad_outside_a_message_is_an_error() -> None:
    with pytest.raises(pickle.PicklingError, match="only travel inside aiomp"):
        _reduction.current()
