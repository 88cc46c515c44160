"""A tiny HTTP server for the devcluster's tests. Standard library only: it runs in the base
image's Python, mounted into the pod from a ConfigMap. Every flag has an environment twin
TESTSERVER_<FLAG> (upper snake case).

GET /          JSON: pod name, pid, address, seconds since start, request count
GET /healthz   liveness: 200, or 500 once --fail-liveness-after seconds have passed
GET /ready     readiness: 503 until --ready-after seconds have passed, then 200
GET /env       the process environment as JSON
GET /file?path=P   the content of a file (to check mounted volumes)
SIGTERM        append "SIGTERM <pid>" to --term-marker (if given), wait --term-delay, exit 0
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ

    def twin(name: str, default):
        return env.get("TESTSERVER_" + name.upper().replace("-", "_"), default)

    parser = argparse.ArgumentParser(
        prog="testserver", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default=twin("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(twin("port", 8080)))
    parser.add_argument("--ready-after", type=float, default=float(twin("ready-after", 0)))
    parser.add_argument(
        "--fail-liveness-after",
        type=float,
        default=float(twin("fail-liveness-after", -1)),
        help="seconds after start when /healthz turns 500 (-1: never)",
    )
    parser.add_argument("--term-marker", default=twin("term-marker", ""))
    parser.add_argument("--term-delay", type=float, default=float(twin("term-delay", 0)))
    return parser.parse_args(argv)


def make_handler(args: argparse.Namespace, started: float, counter: list[int]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: dict | str) -> None:
            payload = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            counter[0] += 1
            uptime = time.monotonic() - started
            url = urlparse(self.path)
            if url.path == "/healthz":
                failing = 0 <= args.fail_liveness_after <= uptime
                self._send(500 if failing else 200, {"alive": not failing})
            elif url.path == "/ready":
                ready = uptime >= args.ready_after
                self._send(200 if ready else 503, {"ready": ready})
            elif url.path == "/env":
                self._send(200, dict(os.environ))
            elif url.path == "/file":
                path = parse_qs(url.query).get("path", [""])[0]
                try:
                    with open(path) as handle:
                        self._send(200, {"path": path, "content": handle.read()})
                except OSError as exc:
                    self._send(404, {"path": path, "error": str(exc)})
            else:
                self._send(
                    200,
                    {
                        "pod": os.environ.get("POD_NAME", ""),
                        "pid": os.getpid(),
                        "address": f"{args.host}:{args.port}",
                        "uptime": round(uptime, 3),
                        "requests": counter[0],
                    },
                )

        def log_message(self, format: str, *values) -> None:
            sys.stderr.write(f"{self.address_string()} {format % values}\n")

    return Handler


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args, started, [0]))
    server.daemon_threads = True

    def on_term(signum, _frame) -> None:
        if args.term_marker:
            with open(args.term_marker, "a") as marker:
                marker.write(f"SIGTERM {os.getpid()}\n")
        print(f"testserver {os.getpid()}: SIGTERM", flush=True)

        def finish() -> None:
            time.sleep(args.term_delay)
            server.shutdown()

        threading.Thread(target=finish, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    print(f"testserver {os.getpid()} on {args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.1)
    server.server_close()


if __name__ == "__main__":
    main()
