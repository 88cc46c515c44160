"""Draining without dropping a pooled client's request.

A client with a keep-alive pool (the OpenAI SDK, LangChain, requests.Session) keeps sending on
its open connections, and through a Service those stay pinned to this pod after it has left the
endpoints. When the process exits, a request written onto such a connection is lost. So, from
SIGTERM on:

- every response says `Connection: close` and its connection closes after it: the client
  opens its next connection through the Service, to a pod that stays (no race: the client
  learns it from the response it was waiting for);
- a connection idle for IDLE_CLOSE_S is closed by the server; a client that idle is not
  about to send (closing a connection while a request is on its way is the one race HTTP/1.1
  keep-alive has, so a just-used connection is left to the rule above);
- in-flight and queued requests finish;
- the process exits once nothing is in flight and no connection is open, or at the drain
  deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

CLOSE_AFTER = web.RequestKey("warmgate.close_after", bool)
"""A request key: its response closes the connection (say, a body that never fully came)."""

IDLE_CLOSE_S = 1.0
"""A keep-alive connection idle this long during a drain is closed by the server."""


class ConnectionActivity:
    """When each connection last finished a request, and how many it is serving now (keyed by
    the connection's transport)."""

    def __init__(self) -> None:
        self._busy: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._last: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()

    def started(self, connection: object) -> None:
        self._busy[connection] = self._busy.get(connection, 0) + 1

    def finished(self, connection: object) -> None:
        self._busy[connection] = self._busy.get(connection, 1) - 1
        self._last[connection] = time.monotonic()

    def idle_for(self, connection: object, now: float) -> float:
        """Seconds since the connection's last request ended (0 while it serves one); a
        connection seen for the first time counts from now."""
        if self._busy.get(connection, 0) > 0:
            return 0.0
        return now - self._last.setdefault(connection, now)


def middleware(
    activity: ConnectionActivity, draining: Callable[[], bool]
) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def track_and_close(request: web.Request, handler) -> web.StreamResponse:
        connection = request.transport
        if connection is not None:
            activity.started(connection)
        try:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                if draining():
                    exc.force_close()
                raise
            if (draining() or request.get(CLOSE_AFTER)) and not response.prepared:
                response.force_close()  # aiohttp then sends `Connection: close`
            return response
        finally:
            if connection is not None:
                activity.finished(connection)

    return track_and_close


async def close_connections(
    server: web.Server | None,
    activity: ConnectionActivity,
    idle: Callable[[], bool],
    deadline: float,
    stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Close idle connections as they become idle enough, until nothing is in flight and no
    connection is open (True), or the deadline or `stop()` (False)."""
    closed = 0
    while not stop():
        now = time.monotonic()
        connections = list(server.connections) if server is not None else []
        for connection in connections:
            transport = connection.transport
            if transport is None:  # closing already
                continue
            if activity.idle_for(transport, now) >= IDLE_CLOSE_S:
                connection.force_close()  # idle: nothing to finish on it
                closed += 1
        if idle() and not connections:
            log.info("drain: closed %d idle keep-alive connections", closed)
            return True
        if now >= deadline:
            log.warning(
                "drain time is up with %d connections open (%d idle ones closed)",
                len(connections),
                closed,
            )
            return False
        await asyncio.sleep(0.05)
    return False
