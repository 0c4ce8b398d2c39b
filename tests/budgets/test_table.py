"""The budget table itself: every role names a function that exists, and a stale name
fails loudly."""

from __future__ import annotations

import pytest

from tests.budgets import budgets as B


def test_every_role_resolves_to_a_function_of_aiomp() -> None:
    for role, (filename, _, name) in B.KEYS.items():
        assert filename.startswith(B.PACKAGE), role
        assert B.ROLES[role].endswith(f".{name}"), role


@pytest.mark.parametrize(
    "stale", ["aiomp._pool.protocol.no_such_function", "aiomp._no_such_module.unpack"]
)
def test_a_stale_name_fails_loudly(stale: str) -> None:
    with pytest.raises((AttributeError, ModuleNotFoundError)):
        B.resolve(stale)
