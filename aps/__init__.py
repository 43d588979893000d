"""aps: run Gymnasium environments on remote workers over asyncio; learning stays central."""

from __future__ import annotations

__version__ = "0.1.0"
