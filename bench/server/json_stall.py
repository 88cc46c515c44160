"""How long writing a large answer holds the event loop: /embed_multi's ColBERT vectors for a
batch of bge-m3's shape (1,024 wide; 8 and 32 inputs of 128 tokens, random values), written by
`schemas.dumps` (orjson in one call) and by `schemas.json_pieces` (array by array, large
arrays in blocks of rows, the loop given a turn between), while a task beside it wakes every
millisecond as a health check or a small request would. Reports each writer's time and the
longest the other task waited for a turn, the median and the worst of five rounds, in process.

    .venv/bin/python bench/server/json_stall.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from warmgate_server.schemas import dumps, json_pieces


async def stall(write, body) -> tuple[float, float]:
    """(ms the write took, longest ms the ticking task waited for a turn meanwhile)."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beside = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    result = write(body)
    if asyncio.iscoroutine(result):
        result = await result
    took = time.perf_counter() - started
    done = True
    await beside
    return took * 1000, max(gaps) * 1000


async def main() -> None:
    rng = np.random.default_rng(0)
    header = "| inputs x tokens | JSON | writer | write ms (median) | longest wait beside it, ms "
    print(header + "(median / worst of 5) |")
    print("|---|---|---|---|---|")
    for inputs in (8, 32):
        body = {"colbert_vecs": [rng.standard_normal((128, 1024), dtype=np.float32)
                                 for _ in range(inputs)]}  # fmt: skip
        size = len(dumps(body)) / 2**20
        for name, write in (("dumps (one call)", dumps), ("json_pieces", json_pieces)):
            rounds = [await stall(write, body) for _ in range(5)]
            took = statistics.median(r[0] for r in rounds)
            waits = [r[1] for r in rounds]
            print(
                f"| {inputs} x 128 | {size:.0f} MiB | {name} | {took:.0f} | "
                f"{statistics.median(waits):.1f} / {max(waits):.1f} |"
            )


if __name__ == "__main__":
    asyncio.run(main())
