"""The base of every object that ``async with`` closes: :class:`AsyncResource`.

A resource defines one method, ``aclose``; the base makes it an async context manager whose
block ends with that ``aclose``, however the block ended. The transports, listeners and the
learner build on it, as anyio's streams build on ``anyio.abc.AsyncResource``.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


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
