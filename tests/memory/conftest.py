"""Fixtures shared by the shared-memory tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("aiomp-test-lease", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 16)
    yield fd
    os.close(fd)
