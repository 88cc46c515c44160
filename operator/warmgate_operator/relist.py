"""What a watch restart means for objects remembered in memory.

A watch that restarts (a 410 relist, a reconnect) sends no DELETED for what went meanwhile. So
after one, each remembered object must be seen again, by its listing event or a GET, before it
is acted on; one that is gone is forgotten (the controller and the gatekeeper both use this).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any

log = logging.getLogger("warmgate.relist")

Exists = Callable[[Mapping[str, Any]], Awaitable[bool]]
"""async (object) -> whether it still exists with the same uid (a GET)."""


class Confirmations:
    def __init__(self, exists: Exists | None) -> None:
        self._exists = exists
        self._unconfirmed: set[Hashable] = set()

    def relisted(self, keys: Iterable[Hashable]) -> None:
        """A watch restarted: every one of `keys` must be seen again."""
        self._unconfirmed = set(keys)

    def seen(self, key: Hashable) -> None:
        """An event for `key` arrived: it exists as the event says."""
        self._unconfirmed.discard(key)

    async def still_there(self, key: Hashable, obj: Mapping[str, Any]) -> bool | None:
        """True when `key` needs no check or the API has it; False when it is gone; None when
        the API could not say (look again later)."""
        if key not in self._unconfirmed or self._exists is None:
            return True
        try:
            alive = await self._exists(obj)
        except Exception as error:  # the API is away
            log.warning("checking %s after a relist: %s", key, error)
            return None
        if key not in self._unconfirmed:  # an event came meanwhile: it is as the event says
            return True
        self._unconfirmed.discard(key)
        return alive
