#!/usr/bin/env python3
"""`make bench-server-ab`: the server of this checkout against an earlier commit's, on the same
model, both at their defaults, alternating, one run: what a change of the server did to its
throughput and latency, with the machine's noise spread over both sides.

The earlier commit (`--baseline`, default 87949c1: before the linear kernel measured at load,
the scheduler's fair share and the unpadded attention of inputs of one length) is checked out
with `git worktree` into a temporary folder, removed afterwards. Both servers run from this
checkout's venv (`python -m warmgate_server`, each with its own checkout on PYTHONPATH), warm
up, then every load point runs on one, then at once on the other, `--rounds` times, the order
swapped each round. One pooled aiohttp client, the OpenAI route, float JSON: one sentence at
concurrency 1 (p50) and 32, batches of 32 sentences at concurrency 8 (MiniLM: bench_server.py's
sentences; an XLM-R folder from bench_models.py: its multilingual ones).

    .venv/bin/python bench/server/bench_ab.py [--model FOLDER] [--baseline REV] [--rounds 3]

Results: bench/results/bench_ab.json and a table on stdout (copied into docs/benchmarks.md by
hand, with the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadgen import SHORT_SENTENCES, closed_loop

from warmgate_testkit.process import SERVER_ROOT, ServerProcess, minilm_path

ROOT = Path(__file__).resolve().parents[2]
POINTS = {"1x1": (1, 1), "32x1": (32, 1), "8x32": (8, 32)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model folder (default: local MiniLM)")
    parser.add_argument("--baseline", default="87949c1", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per point and server")
    parser.add_argument("--points", default="1x1,32x1,8x32")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return parser.parse_args()


def sentences(model: Path) -> list[str]:
    """The bench's sentences for this model: bench_models.py's multilingual ones for its
    XLM-R folders, else bench_server.py's."""
    if "xlm-roberta" in model.name:
        from bench_models import SENTENCES

        return list(SENTENCES)
    return list(SHORT_SENTENCES)


def worktree(revision: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="warmgate-ab-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision],
        check=True,
        capture_output=True,
    )
    return folder


def start(checkout: Path, model: Path) -> ServerProcess:
    """The checkout's server on `model`, at its defaults, ready."""
    server_root = checkout / "server"
    env = {"PYTHONPATH": f"{server_root}{os.pathsep}{checkout / 'contract'}"}
    server = ServerProcess(["--model", str(model), "--device", "cpu"], env=env)
    server.start()
    server.wait_ready(1800)
    return server


async def point(url: str, concurrency: int, batch: list[str], seconds: float) -> dict:
    return await closed_loop(url, concurrency, batch, seconds)


def main() -> int:
    args = parse_args()
    model = Path(args.model).expanduser() if args.model else minilm_path()
    texts = sentences(model)
    folder = worktree(args.baseline)
    servers: dict[str, ServerProcess] = {}
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        started = {}
        for name, checkout in (("baseline", folder), ("this", SERVER_ROOT.parent)):
            began = time.monotonic()
            servers[name] = start(checkout, model)
            started[name] = round(time.monotonic() - began, 1)
            print(name, "ready in", started[name], "s", flush=True)
        points = [item.strip() for item in args.points.split(",") if item.strip()]
        for round_index in range(args.rounds):
            order = ["baseline", "this"] if round_index % 2 == 0 else ["this", "baseline"]
            for key in points:
                concurrency, size = POINTS[key]
                batch = texts[:1] if size == 1 else (texts * 32)[:size]
                for name in order:
                    found = asyncio.run(point(servers[name].url, concurrency, batch, args.seconds))
                    found["load"] = round(os.getloadavg()[0], 1)
                    results.setdefault(key, {}).setdefault(name, []).append(found)
                    print(name, key, json.dumps(found), flush=True)
    finally:
        for server in servers.values():
            server.kill()
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=False
        )
    summary = summarize(results)
    report = {
        "model": str(model),
        "baseline": args.baseline,
        "this": head(),
        "ready_seconds": started,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "summary": summary,
        "points": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_ab.json").write_text(json.dumps(report, indent=2))
    print(table(summary))
    return 0


def head() -> str:
    command = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per point and side: the rounds' inputs/s and p50, their medians, and this / baseline."""
    summary = {}
    for key, sides in results.items():
        entry: dict = {}
        for name, rounds in sides.items():
            entry[name] = {
                "inputs_per_s": [r["inputs_per_s"] for r in rounds],
                "p50_ms": [r["p50_ms"] for r in rounds],
                "median_inputs_per_s": statistics.median(r["inputs_per_s"] for r in rounds),
                "median_p50_ms": statistics.median(r["p50_ms"] for r in rounds),
            }
        if {"this", "baseline"} <= set(entry):
            entry["throughput_ratio"] = round(
                entry["this"]["median_inputs_per_s"] / entry["baseline"]["median_inputs_per_s"], 3
            )
            entry["p50_ratio"] = round(
                entry["this"]["median_p50_ms"] / entry["baseline"]["median_p50_ms"], 3
            )
        summary[key] = entry
    return summary


def table(summary: dict[str, dict]) -> str:
    lines = [
        "| point | baseline inputs/s (rounds) | this inputs/s (rounds) | this / baseline | "
        "baseline p50 ms | this p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for key, entry in summary.items():
        base, this = entry.get("baseline", {}), entry.get("this", {})
        lines.append(
            f"| {key} | {base.get('inputs_per_s')} | {this.get('inputs_per_s')} | "
            f"{entry.get('throughput_ratio')}x | {base.get('p50_ms')} | {this.get('p50_ms')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
