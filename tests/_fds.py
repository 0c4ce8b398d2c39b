"""File-descriptor helpers shared by the transport and reduction tests."""

from __future__ import annotations

import os


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def devnulls(n: int) -> list[int]:
    """``n`` fresh fds (close-on-exec) to send around."""
    return [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(n)]


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
