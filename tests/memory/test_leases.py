"""Shared memory: leases of blocks (hold, release, dup, handoff, a SIGKILLed holder)
and the sharing strategies.
"""

from __future__ import annotations

import os
import signal

import pytest

import aiomp
from aiomp._memory import lease as _lease
from tests.memory._shm import segment_of, shm_names


def test_lease_hold_release(memfd: int) -> None:
    other = _lease.reopen(memfd)
    try:
        assert not _lease.is_held(memfd, 0, 4096)
        _lease.hold(other, 0, 4096)
        assert _lease.is_held(memfd, 0, 4096)
        assert _lease.is_held(memfd, 4000, 200), "overlapping ranges are held"
        assert not _lease.is_held(memfd, 4096, 4096), "neighbouring ranges are not"
        assert not _lease.is_held(other, 0, 4096), "a description never sees its own leases"
        _lease.hold(other, 0, 4096)  # holding twice is one lease
        _lease.release(other, 0, 4096)
        assert not _lease.is_held(memfd, 0, 4096)
        assert _lease.is_held(memfd, 0, 0) is False  # length 0: to the end of the file
        _lease.hold(other, 8192, 100)
        assert _lease.is_held(memfd, 0, 0)
    finally:
        os.close(other)
    assert not _lease.is_held(memfd, 0, 0), "closing the description drops its leases"


def test_lease_identity(memfd: int) -> None:
    other = _lease.reopen(memfd)
    dup = os.dup(memfd)
    try:
        assert _lease.identity(other) == _lease.identity(memfd) == _lease.identity(dup)
        fd2 = os.memfd_create("x", os.MFD_CLOEXEC)
        assert _lease.identity(fd2) != _lease.identity(memfd)
        os.close(fd2)
    finally:
        os.close(other)
        os.close(dup)


def test_lease_dup_shares_the_description(memfd: int) -> None:
    # Why a message carries a *fresh* description: a dup (or an SCM_RIGHTS copy) shares
    # its locks with the original, so the owner could not see them.
    dup = os.dup(memfd)
    try:
        _lease.hold(dup, 0, 100)
        assert not _lease.is_held(memfd, 0, 100)
    finally:
        _lease.release(dup, 0, 100)
        os.close(dup)


def test_handoff_holds_until_every_copy_is_closed(memfd: int) -> None:
    fd = _lease.handoff_fd(memfd, [(0, 100), (4096, 100)])
    assert _lease.is_held(memfd, 50, 10) and _lease.is_held(memfd, 4096, 1)
    assert not _lease.is_held(memfd, 200, 100)
    in_flight = os.dup(fd)  # the copy a message carries
    os.close(fd)
    assert _lease.is_held(memfd, 0, 100), "the message's copy keeps the lease"
    os.close(in_flight)
    assert not _lease.is_held(memfd, 0, 0)


def _hold_in_child(memfd: int, ranges: list[tuple[int, int]], inherited: int) -> int:
    """Fork a child that takes leases through a description of its own (and keeps the
    ``inherited`` one), tells us, and waits to be killed. Returns its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            own = _lease.reopen(memfd)
            for start, length in ranges:
                _lease.hold(own, start, length)
            os.write(w, b"x")
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x", "the child died before it held its leases"
    finally:
        os.close(r)
    return pid


def test_leases_of_a_sigkilled_process_are_dropped(memfd: int) -> None:
    handoff = _lease.handoff_fd(memfd, [(0, 4096)])
    pid = _hold_in_child(memfd, [(8192, 4096)], handoff)
    os.close(handoff)  # now only the child holds the handoff description
    try:
        assert _lease.is_held(memfd, 8192, 4096), "the child's own lease"
        assert _lease.is_held(memfd, 0, 4096), "the handoff lease, inherited by the child"
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not _lease.is_held(memfd, 0, 0), "the kernel dropped every lease with the process"


# -- strategies ----------------------------------------------------------------------------


def test_sharing_strategies() -> None:
    assert aiomp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert aiomp.get_sharing_strategy() == "file_descriptor", "the default on Linux"
    all_ = aiomp.get_all_sharing_strategies()
    all_.clear()  # a copy: the caller cannot change the library's set
    assert aiomp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}


@pytest.mark.parametrize("name", ["", "File_System", "file-system", "cuda", None])
def test_unknown_strategy(name: object) -> None:
    with pytest.raises(ValueError, match="sharing strategy"):
        aiomp.set_sharing_strategy(name)  # type: ignore[arg-type]
    assert aiomp.get_sharing_strategy() == "file_descriptor"


def test_set_strategy(strategy: str) -> None:
    assert aiomp.get_sharing_strategy() == strategy
    arr = aiomp.zeros(10)
    name = segment_of(arr).name
    if strategy == "file_system":
        assert name is not None and name.startswith(f"aiomp-{os.getpid()}-")
        assert name in shm_names()
        # R3: collision-proof names: pid plus 64 random bits
        assert len(name.split("-")[2]) == 16
    else:
        assert name is None
        assert os.readlink(f"/proc/self/fd/{segment_of(arr).fd}").startswith("/memfd:aiomp")


def _names_after_switching() -> tuple[bool, bool, bool]:
    aiomp.set_sharing_strategy("file_descriptor")
    old = aiomp.zeros(10)
    aiomp.set_sharing_strategy("file_system")
    new = aiomp.zeros(10)
    return segment_of(old).name is None, segment_of(new).name is not None, aiomp.is_shared(old)


def test_switching_strategy_applies_to_new_arrays(file_system: None) -> None:
    old_unnamed, new_named, old_shared = _names_after_switching()
    assert old_unnamed and old_shared, "arrays already shared keep their segment"
    assert new_named, "arrays made after the switch live in named segments"
