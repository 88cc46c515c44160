"""`python -m warmgate_server`: bind the port, then load, warm and serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .app import create_app, drain
from .config import ConfigError, ServerConfig, parse_config
from .context import RUNTIME

log = logging.getLogger("warmgate_server")


class MalformedRequests(logging.Filter):
    """aiohttp logs each request it cannot parse (two Content-Lengths, a bad chunk size, ...)
    at ERROR with a traceback of its own parser: the client's fault, already answered 400, and
    a client sending many would flood the log. This makes each one a WARNING line that says
    who sent it and what was wrong. What aiohttp logs lower (a first line that is not HTTP at
    all, at DEBUG) stays as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            record.levelno >= logging.ERROR
            and isinstance(error, HttpProcessingError)
            and error.code < 500
        ):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "malformed request from %s answered %d: %s"
            record.args = (remote, error.code, " ".join(str(error.message).split())[:200])
            record.exc_info = record.exc_text = None
        return True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _loopback_url(host: str, port: int) -> str:
    """A URL this process can reach itself at: loopback for a wildcard bind."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _write_termination_message(path: str, message: str) -> None:
    """Kubernetes shows this file's text as the container's termination message (kubectl
    describe, and the pod status the operator reads), so the reason outlives the process."""
    if os.path.exists(path):
        try:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(message[:4000])
        except OSError:
            pass


async def serve(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0) or a failed start (exit 1)."""
    # The port is bound before anything heavy, so liveness answers during load and warmup.
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    app[RUNTIME].http_server = runner.server
    await web.SockSite(runner, sock).start()
    log.info("listening on http://%s:%d", host, port)
    app[RUNTIME].self_url = _loopback_url(host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    lifecycle = app[RUNTIME].lifecycle
    stopping = asyncio.create_task(stop.wait())
    failing = asyncio.create_task(lifecycle.failed_event.wait())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    failing.cancel()

    code = 0
    if lifecycle.failed_event.is_set():
        log.error("exiting: %s", lifecycle.error)
        _write_termination_message(config.termination_log, str(lifecycle.error))
        code = 1
    else:
        started = time.monotonic()
        log.info("draining (up to %.1fs)", config.drain_seconds)
        drained = await drain(app, config.drain_seconds, runner.server)
        log.info(
            "drained %s in %.2fs", "cleanly" if drained else "partly", time.monotonic() - started
        )
    await runner.cleanup()
    return code


def run(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"warmgate-server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.server").addFilter(MalformedRequests())
    try:
        return asyncio.run(serve(config))
    except OSError as exc:
        print(
            f"warmgate-server: error: cannot listen on {config.host}:{config.port}: {exc}",
            file=sys.stderr,
        )
        return 1


def main(argv: list[str] | None = None) -> None:
    code = run(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # A model thread in the middle of loading or a forward pass cannot be interrupted, and the
    # interpreter would wait for it at exit; the work is over, so leave now.
    os._exit(code)


if __name__ == "__main__":
    main()
