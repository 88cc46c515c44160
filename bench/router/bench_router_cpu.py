#!/usr/bin/env python3
"""`make bench-router-cpu`: the router's own CPU per request on loopback, this checkout against
an earlier commit (`--baseline`; by default 1da52fc, the last with aiohttp's web server on the
clients' side), alternating, one run.

No cluster: each side's router runs as its own process (its View given one EmbeddingService
whose endpoint is 127.0.0.1), in front of a trivial keep-alive upstream that answers every
request at once with one 384-float embedding (so the router's cost is all there is to see),
and one pooled aiohttp client sends one sentence per request on the OpenAI route at
concurrency 1 and 8. The router's CPU is read from /proc (user + system) around each round.
The baseline is checked out with `git worktree` into a temporary folder and removed after.

Results: bench/results/router_cpu.json and a table on stdout (copied into docs/benchmarks.md by
hand, with the machine it ran on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Warm caches make fast servers."
ANSWER = orjson.dumps(
    {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0123456789] * 384}],
        "model": "m",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
)

# Run as `bench_router_cpu.py --upstream PORT`: the trivial upstream.
# Run as `bench_router_cpu.py --router PORT UPSTREAM`: a router (from PYTHONPATH's checkout).
ROUTER = """
import asyncio, signal, sys
from warmgate_router.config import RouterConfig
from warmgate_router.metrics import Metrics
import warmgate_router.proxy as proxy
from warmgate_router.view import ALIASES, SERVICES, SLICES, View

async def main(port, upstream):
    view = View()
    router = proxy.Router(RouterConfig(), view, None, Metrics())
    router.synced.set()
    meta = {"namespace": "bench", "name": "q", "creationTimestamp": "2026-01-01T00:00:00Z"}
    view.on_listing(SERVICES, "bench", [{"kind": "EmbeddingService", "metadata": meta,
        "spec": {"model": {"id": "m"}, "replicas": 1}}])
    view.on_listing(ALIASES, "bench", [])
    view.on_listing(SLICES, "bench", [{
        "metadata": {"namespace": "bench", "name": "q-a",
                     "labels": {"kubernetes.io/service-name": "q"}},
        "ports": [{"name": "http", "port": upstream}],
        "endpoints": [{"addresses": ["127.0.0.1"],
                       "conditions": {"ready": True, "serving": True, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": "q-pod"}}]}])
    if hasattr(proxy, "build_server"):
        await proxy.build_server(router).start("127.0.0.1", port)
    else:  # before httpd.py: aiohttp's web server
        from aiohttp import web
        runner = web.AppRunner(proxy.build_app(router), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("listening", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


class Upstream(asyncio.Protocol):
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Warmgate-Revision: r1\r\n"
        b"X-Warmgate-Cold: 0\r\nContent-Length: %d\r\n\r\n" % len(ANSWER)
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in self.buffer[:end].lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(self.head + ANSWER)  # type: ignore[attr-defined]


async def upstream(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port)
    await server.serve_forever()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, pid: int, requests: int, concurrency: int) -> dict[str, float]:
    body = {"model": "q", "input": TEXT}
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # warm: connections, the router's pool
            async with session.post(url, json=body) as response:
                await response.read()
        latencies: list[float] = []

        async def client(count: int) -> None:
            for _ in range(count):
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                latencies.append(time.perf_counter() - started)

        cpu, started = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(client(requests // concurrency) for _ in range(concurrency)))
        elapsed, used = time.perf_counter() - started, cpu_seconds(pid) - cpu
    return {
        "cpu_us_per_request": round(used / len(latencies) * 1e6, 1),
        "requests_per_second": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
    }


def start_router(source: Path, port: int, upstream_port: int) -> subprocess.Popen[str]:
    paths = [source / "router", source / "contract"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    process = subprocess.Popen(
        [sys.executable, "-c", ROUTER, str(port), str(upstream_port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "listening":
        process.kill()
        raise SystemExit(f"the router from {source} did not start")
    return process


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="1da52fc", help="commit to compare with")
    parser.add_argument("--requests", type=int, default=4000, help="per round and point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        asyncio.run(upstream(args.upstream))
        return
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    up_port = free_port()
    up = subprocess.Popen([sys.executable, __file__, "--upstream", str(up_port)])
    folder = Path(tempfile.mkdtemp(prefix="warmgate-baseline-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision],
        check=True,
        capture_output=True,
    )
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        time.sleep(0.5)
        for round_ in range(args.rounds):
            for side, source in ((f"baseline {revision}", folder), ("this checkout", ROOT)):
                port = free_port()
                router = start_router(source, port, up_port)
                try:
                    url = f"http://127.0.0.1:{port}/v1/embeddings"
                    for concurrency in (1, 8):
                        run = asyncio.run(load(url, router.pid, args.requests, concurrency))
                        runs.setdefault(f"{side}, c={concurrency}", []).append(run)
                        print(round_, side, f"c={concurrency}", json.dumps(run), flush=True)
                finally:
                    router.send_signal(signal.SIGTERM)
                    router.wait(10)
    finally:
        up.terminate()
        up.wait(10)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=False
        )
    print("\n| side, concurrency | router CPU per request (us), rounds | p50 (ms) | req/s |")
    print("|---|---|---|---|")
    for name, rounds in runs.items():
        cpu = ", ".join(f"{r['cpu_us_per_request']:.0f}" for r in rounds)
        p50 = statistics.median(r["p50_ms"] for r in rounds)
        rate = statistics.median(r["requests_per_second"] for r in rounds)
        print(f"| {name} | {cpu} | {p50:.3f} | {rate:.0f} |")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    result = {"machine": machine, "baseline": revision, "runs": runs}
    (out / "router_cpu.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
