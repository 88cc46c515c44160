"""Shared load generation for the server benchmarks (CPU and GPU): shape probes and closed-loop
load at a fixed concurrency. Standard library + aiohttp only, so it runs on a bare GPU box."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import aiohttp

# Common English words that are one WordPiece token each, so "n words" is n + 2 tokens.
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "and",
    "cat",
    "run",
    "fast",
    "slow",
    "day",
    "night",
    "time",
    "year",
    "good",
    "new",
    "old",
    "big",
    "small",
    "high",
    "low",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "right",
    "left",
]

SHORT_SENTENCES = [
    "A man is eating food.",
    "The weather is lovely today.",
    "Kubernetes schedules pods onto nodes.",
    "She plays the piano every evening.",
    "Embeddings map text to vectors.",
    "The train leaves at noon.",
    "Warm caches make fast servers.",
    "He reads a book in the park.",
]


def text_of_tokens(tokens: int, variant: int = 0) -> str:
    """A text that tokenizes to exactly `tokens` tokens with [CLS] and [SEP] (BERT vocab)."""
    words = max(tokens - 2, 1)
    return " ".join(WORDS[(variant + i) % len(WORDS)] for i in range(words))


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


async def post_embeddings(
    session: aiohttp.ClientSession, url: str, texts: list[str], path: str = "/v1/embeddings"
) -> tuple[float, int, str]:
    """One OpenAI-style request: (latency ms, status, X-Warmgate-Cold or '')."""
    started = time.perf_counter()
    async with session.post(url + path, json={"input": texts}) as response:
        await response.read()
        return (
            (time.perf_counter() - started) * 1000.0,
            response.status,
            response.headers.get("X-Warmgate-Cold", ""),
        )


def probe_lengths(shape: dict[str, int], unseen: bool) -> list[int]:
    """Token counts of the texts of one probe request for `shape`.

    Exact: `batch_size` texts of exactly `seq_len` tokens, the token count warmup ran. Unseen:
    1 to 3 tokens shorter each, still in the same bucket, so the batch runs as the same padded
    shape but carries a total token count no warmup ran (what a padding-free pass sees).
    """
    if not unseen:
        return [shape["seq_len"]] * shape["batch_size"]
    return [max(3, shape["seq_len"] - 1 - i % 3) for i in range(shape["batch_size"])]


async def probe_shapes(
    url: str, shapes: list[dict[str, int]], steady_runs: int = 10, unseen: bool = False
) -> list[dict[str, Any]]:
    """First request of each shape (all shapes once, in plan order), then its steady median.

    Each request carries `batch_size` texts (see `probe_lengths`) that fit `seq_len`, so with
    batch padding it runs as one batch of exactly that shape.
    """
    results = []
    async with aiohttp.ClientSession() as session:
        # The client that just saw /ready 200 holds an open connection: so does this one.
        async with session.get(url + "/ready") as response:
            await response.read()
        firsts = []
        for shape in shapes:
            lengths = probe_lengths(shape, unseen)
            texts = [text_of_tokens(length, i) for i, length in enumerate(lengths)]
            firsts.append(await post_embeddings(session, url, texts))
        for shape, (first_ms, status, cold) in zip(shapes, firsts, strict=True):
            steady = []
            lengths = probe_lengths(shape, unseen)
            for run in range(steady_runs):
                texts = [text_of_tokens(length, run + i + 1) for i, length in enumerate(lengths)]
                steady.append((await post_embeddings(session, url, texts))[0])
            steady_ms = statistics.median(steady)
            results.append(
                {
                    **shape,
                    "tokens": sum(lengths),
                    "first_ms": round(first_ms, 2),
                    "steady_ms": round(steady_ms, 2),
                    "ratio": round(first_ms / steady_ms, 3),
                    "first_status": status,
                    "first_cold_header": cold,
                }
            )
    return results


async def closed_loop(
    url: str,
    concurrency: int,
    batch: list[str],
    duration_s: float,
    path: str = "/v1/embeddings",
    model: str | None = None,
    encoding_format: str | None = None,
) -> dict[str, Any]:
    """`concurrency` clients, each sending the next request when the last one answers."""
    latencies: list[float] = []
    errors: dict[int, int] = {}
    deadline = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency)
    payload: dict[str, Any] = {"input": batch}
    if model:
        payload["model"] = model
    if encoding_format:
        payload["encoding_format"] = encoding_format

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            async with session.post(url + path, json=payload) as response:
                await response.read()
                if response.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000.0)
                else:
                    errors[response.status] = errors.get(response.status, 0) + 1

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "batch": len(batch),
        "encoding": encoding_format or "float",
        "requests": len(latencies),
        "errors": errors,
        "req_per_s": round(len(latencies) / elapsed, 2),
        "inputs_per_s": round(len(latencies) * len(batch) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.5), 2),
        "p90_ms": round(percentile(latencies, 0.9), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
    }


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)
