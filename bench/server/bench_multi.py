"""`make bench-multi`: what bge-m3's sparse and ColBERT outputs cost beside its dense vector
(issue 43's target: dense + sparse + ColBERT in at most 1.1x the time of dense alone).

Two servers of this checkout, both up at once, on the same encoder: an XLM-R of bge-m3's size
(zoo.shaped("bge-m3"): 24 layers, 1024 wide, random weights), once as it is (`plain`: the
pooled pass, CLS), once with FlagEmbedding's heads beside it (`heads`: `sparse_linear.pt` and
`colbert_linear.pt`, seeded, hard links to the same weights otherwise), so every batch of the
second runs the token-state pass and both heads. One pooled aiohttp client sends the same
token-id inputs, alternating, round after round:

- `plain /embed`: the dense vector of a model without heads (the baseline);
- `heads /embed`: the dense vector of the model with heads (what a dense user pays for them);
- `heads /embed_multi`: all three outputs (dense, lexical weights, ColBERT vectors), the
  answer read whole (ColBERT's vectors are most of it: 1,024 floats a token).

    .venv/bin/python bench/server/bench_multi.py [--rounds 12] [--loads 1x64,8x128]

Writes bench/results/bench_multi.json and prints a markdown table (copied into
docs/benchmarks.md with the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from bench_server import REPO, machine, write_results

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

RESULTS = REPO / "bench" / "results"


def with_heads(plain: Path) -> Path:
    """`plain`'s files hard-linked beside seeded bge-m3 heads (made once)."""
    folder = plain.with_name(plain.name + "-heads")
    if (folder / "colbert_linear.pt").is_file():
        return folder
    scratch = folder.with_name("." + folder.name)
    for path in plain.rglob("*"):
        target = scratch / path.relative_to(plain)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    zoo.write_m3_heads(scratch)
    scratch.rename(folder)
    return folder


def server(folder: Path) -> ServerProcess:
    args = ["--model", str(folder), "--device", "cpu", "--forward-timeout", "600",
            "--sequence-buckets", "64,128", "--warmup-batch-sizes", "1,8"]  # fmt: skip
    return ServerProcess(args)


def ready(running: ServerProcess) -> None:
    report = running.wait_ready(1800)
    assert report["phase"] == "ready", report


async def measure(
    plain: str, heads: str, loads: list[tuple[int, int]], rounds: int
) -> list[dict[str, Any]]:
    cases = [("plain /embed", plain, "/embed", {}), ("heads /embed", heads, "/embed", {}),
             ("heads /embed_multi", heads, "/embed_multi",
              {"return_sparse": True, "return_colbert_vecs": True})]  # fmt: skip
    rows = []
    async with aiohttp.ClientSession() as session:
        for batch, tokens in loads:
            inputs = [[0, *[6 + (i * 7 + row) % 200 for i in range(tokens - 2)], 2]
                      for row in range(batch)]  # fmt: skip
            times: dict[str, list[float]] = {name: [] for name, *_ in cases}
            sizes: dict[str, int] = {}
            for round_ in range(rounds + 1):  # the first round is not counted
                for name, url, path, extra in cases:
                    started = time.perf_counter()
                    async with session.post(url + path, json={"inputs": inputs, **extra}) as r:
                        body = await r.read()
                        assert r.status == 200, body[:300]
                        assert r.headers["X-Warmgate-Cold"] == "0", name
                    if round_:
                        times[name].append((time.perf_counter() - started) * 1000.0)
                    sizes[name] = len(body)
            base = statistics.median(times["plain /embed"])
            for name, *_ in cases:
                p50 = statistics.median(times[name])
                rows.append({"load": f"{batch}x{tokens}", "case": name,
                             "p50_ms": round(p50, 1), "vs_plain": round(p50 / base, 3),
                             "answer_bytes": sizes[name]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--loads", default="1x64,8x128")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    loads = [tuple(int(x) for x in load.split("x")) for load in args.loads.split(",")]
    plain_folder = zoo.shaped("bge-m3")
    heads_folder = with_heads(plain_folder)
    with server(plain_folder) as plain:  # each stopped by its pid on the way out
        ready(plain)
        with server(heads_folder) as heads:
            ready(heads)
            rows = asyncio.run(measure(plain.url, heads.url, loads, args.rounds))
    result = {"when": datetime.now(UTC).isoformat(), "machine": machine(), "rows": rows}
    columns = ("load", "case", "p50_ms", "vs_plain", "answer_bytes")
    write_results(Path(args.out) / "bench_multi.json", result, columns, rows)


if __name__ == "__main__":
    main()
