"""The bases of every object a ``with`` block closes: :class:`AsyncResource`, :class:`Resource`.

A resource defines one method, ``aclose`` (``close``); the base makes it a context manager
whose block ends with that method, however the block ended. The transports, listeners and
the learner build on the async one, as anyio's streams build on
``anyio.abc.AsyncResource``; the figures' writers and endpoint on the other.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource", "Resource"]


class AsyncResource(abc.ABC):
    """Something to close with ``await resource.aclose()``, or by leaving ``async with``.

    ``async with resource:`` yields the resource itself and awaits :meth:`aclose` when the
    block ends, on an exception or a cancellation too; the exception, if any, goes on. A
    resource that must do something on entering (a learner binds its address) overrides
    ``__aenter__`` and returns ``self``.
    """

    __slots__ = ()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release what the resource holds; idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Resource(abc.ABC):
    """Something to close with ``resource.close()``, or by leaving ``with``.

    ``with resource:`` yields the resource itself and calls :meth:`close` when the block
    ends, on an exception too; the exception, if any, goes on.
    """

    __slots__ = ()

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the resource holds; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
