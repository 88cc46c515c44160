"""Which pod gets the next request: the one with the fewest of this router's requests in flight,
taking turns among equals, never one already tried for this request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

from .view import Endpoint


class Balancer:
    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self._turn = 0

    def pick(self, endpoints: Sequence[Endpoint], tried: Collection[str] = ()) -> Endpoint | None:
        candidates = [e for e in endpoints if e.key not in tried]
        if not candidates:
            return None
        fewest = min(self.in_flight[e.key] for e in candidates)
        least = [e for e in candidates if self.in_flight[e.key] == fewest]
        self._turn += 1
        return least[self._turn % len(least)]

    @contextmanager
    def busy(self, endpoint: Endpoint) -> Iterator[None]:
        self.in_flight[endpoint.key] += 1
        try:
            yield
        finally:
            self.in_flight[endpoint.key] -= 1
            if self.in_flight[endpoint.key] <= 0:
                del self.in_flight[endpoint.key]
