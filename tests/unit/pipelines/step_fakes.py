"""A stand-in for a DataFuture in step-wiring tests: awaitable, joinable with ``|``, waitable (stage timing)."""

from __future__ import annotations

from typing import Any


class FakeFuture:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __or__(self, other: Any) -> FakeFuture:
        return FakeFuture(("union", self, other))

    def __ror__(self, other: Any) -> FakeFuture:
        return FakeFuture(("union", other, self))

    def __await__(self):
        async def get() -> Any:
            return self.value
        return get().__await__()

    async def wait(self) -> None:
        return None
