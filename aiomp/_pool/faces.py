"""The typed faces of the Pool's calls: Protocols whose overloads tell a type checker what
``apply``, ``map``, ``starmap`` and ``imap`` return for a sync and for an ``async def``
``fn``. Types only: the bodies are :mod:`aiomp._pool.calls`' and ``pool``'s."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeAlias, TypeVar, overload

from .iterators import ResultIterator

S = TypeVar("S")
T = TypeVar("T")
#: What map and imap take: items, from a sync or an async iterable.
Inputs: TypeAlias = Iterable[S] | AsyncIterable[S]
#: ``on_progress(done, total)``, called as results come in.
Progress: TypeAlias = Callable[[int, int], object] | None


class Apply(Protocol):
    """The typed face of :meth:`Pool.apply`, bound."""

    @overload
    async def __call__(
        self,
        fn: Callable[..., Awaitable[T]],
        args: Iterable[object] = (),
        kwds: dict[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> T: ...

    @overload
    async def __call__(
        self,
        fn: Callable[..., T],
        args: Iterable[object] = (),
        kwds: dict[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> T: ...


class Map(Protocol):
    """The typed face of :meth:`Pool.map`, bound."""

    @overload
    async def __call__(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Inputs[S],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...

    @overload
    async def __call__(
        self,
        fn: Callable[[S], T],
        iterable: Inputs[S],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...


class Starmap(Protocol):
    """The typed face of :meth:`Pool.starmap`, bound."""

    @overload
    async def __call__(
        self,
        fn: Callable[..., Awaitable[T]],
        iterable: Inputs[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...

    @overload
    async def __call__(
        self,
        fn: Callable[..., T],
        iterable: Inputs[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...


class Imap(Protocol):
    """The typed face of :meth:`Pool.imap` and :meth:`Pool.imap_unordered`, bound."""

    @overload
    def __call__(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...

    @overload
    def __call__(
        self,
        fn: Callable[[S], T],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...
