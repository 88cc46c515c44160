"""`make bench-warm`: what warmup costs and what it buys, side by side in one run (issue 40).

For each model (MiniLM's real weights; XLM-R folders of multilingual-e5-base's and bge-m3's
shapes, bench_models.build), at the server's default plan (batch sizes 1, 8, 32 x buckets 32,
64, 128, 256 within 16,384 tokens: 12 shapes), three servers are started one after another from
this checkout's venv:

- `now`: this checkout's server, its warmup as it is;
- `before`: the same server at an earlier commit (`--baseline`, default 5a8f42c: each shape
  repeated until its latency settled, up to 12 runs or 8 s, on every worker, then alone),
  checked out with `git worktree` into a temporary folder, removed afterwards;
- `no-warmup`: this checkout's server with `--no-warmup`;
- `restart`: this checkout's server started a second time with the `--warm-state` folder its
  first start filled (the weights' digest and the linear kernels measured at load kept), as a
  restarted container or the next pod on a shared claim starts.

Each runs at its defaults but `--forward-timeout 600` (one pass of 32 x 256 of the e5-base
shape takes about 30 s on one core here, the default timeout). Each is timed from its start to
`/ready` 200 (`ready_s`; `warmup_s` is the server's own figure).
Then P1: right after `/ready`, the first request of every planned shape against the median of
its next `--steady-runs` (one pooled aiohttp client, TEI's `/embed` with token ids, so every
input has exactly the bucket's tokens), and the same at token counts no warmup ran (`unseen`:
each input 1 to 3 tokens shorter, the same bucket: what a padding-free pass meets). Infinity
with ONNX Runtime (`make bench-server-infinity-onnx`) is timed to `/health` on the same folder
where its venv exists.

    .venv/bin/python bench/server/bench_warm.py [--models minilm,e5-base,bge-m3] [--baseline REV]

Writes bench/results/bench_warm.json and prints a markdown table (copied into
docs/benchmarks.md with the machine). Targets on a CPU: `now` ready within 2x `no-warmup`'s
time, P1 <= 1.25 for every planned shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from bench_ab import head, worktree
from bench_server import REPO, machine, start_infinity_onnx

from warmgate_testkit.process import ServerProcess, minilm_path

RESULTS = REPO / "bench" / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="minilm,e5-base,bge-m3")
    parser.add_argument("--baseline", default="5a8f42c")
    parser.add_argument("--steady-runs", type=int, default=7)
    parser.add_argument("--variants", default="now,before,no-warmup")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--onnx-dir", default=None)
    return parser.parse_args()


def model_folder(name: str) -> Path:
    if name == "minilm":
        return minilm_path()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_models import build

    return build(name)


def special_ids(folder: Path) -> tuple[int, int, int]:
    """(first, last, filler): the model's own [CLS]/<s>, [SEP]/</s>, and a word's id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("warm")["input_ids"]
    return ids[0], ids[-1], ids[1]


def inputs_of(shape: dict[str, int], ids: tuple[int, int, int], unseen: bool) -> list[list[int]]:
    first, last, filler = ids
    lengths = [
        max(3, shape["seq_len"] - 1 - row % 3) if unseen else shape["seq_len"]
        for row in range(shape["batch_size"])
    ]
    return [[first, *[filler] * (length - 2), last] for length in lengths]


async def first_and_steady(
    url: str, shapes: list[dict[str, int]], ids: tuple[int, int, int], runs: int, unseen: bool
) -> list[dict[str, Any]]:
    """Each shape's first request (all shapes once, in plan order), then its steady median."""

    async def post(session: aiohttp.ClientSession, inputs: list[list[int]]) -> tuple[float, str]:
        started = time.perf_counter()
        async with session.post(url + "/embed", json={"inputs": inputs}) as response:
            await response.read()
            assert response.status == 200, await response.text()
            cold = response.headers.get("X-Warmgate-Cold", "")
        return (time.perf_counter() - started) * 1000.0, cold

    results = []
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/ready") as response:  # a pooled connection, as a client
            await response.read()
        firsts = [await post(session, inputs_of(shape, ids, unseen)) for shape in shapes]
        for shape, (first_ms, cold) in zip(shapes, firsts, strict=True):
            steady = statistics.median(
                [(await post(session, inputs_of(shape, ids, unseen)))[0] for _ in range(runs)]
            )
            results.append(
                {
                    "shape": f"{shape['batch_size']}x{shape['seq_len']}",
                    "first_ms": round(first_ms, 1),
                    "steady_ms": round(steady, 1),
                    "ratio": round(first_ms / steady, 3),
                    "cold_header": cold,
                }
            )
    return results


def run_server(
    folder: Path, checkout: Path, warmup: bool, extra: tuple[str, ...] = ()
) -> tuple[ServerProcess, dict]:
    env = {"PYTHONPATH": f"{checkout / 'server'}{os.pathsep}{checkout / 'contract'}"}
    args = ["--model", str(folder), "--device", "cpu", "--warmup" if warmup else "--no-warmup",
            "--forward-timeout", "600", *extra]  # fmt: skip
    server = ServerProcess(args, env=env)
    started = time.monotonic()
    server.start()
    report = server.wait_ready(3600)
    return server, {"ready_s": round(time.monotonic() - started, 1), "report": report}


def measure(name: str, variant: str, folder: Path, checkout: Path, args) -> dict[str, Any]:
    extra: tuple[str, ...] = ()
    if variant == "restart":  # a first start fills the warm state, the second is timed
        state = tempfile.mkdtemp(prefix="warmgate-warm-state-")
        extra = ("--warm-state", state)
        primer, _ = run_server(folder, checkout, True, extra)
        primer.kill()
    server, found = run_server(folder, checkout, variant != "no-warmup", extra)
    try:
        report = found.pop("report")
        ids = special_ids(folder)
        shapes = report["planned_shapes"]
        runs = args.steady_runs
        found.update(
            warmup_s=report.get("warmup_seconds"),
            shapes=len(shapes),
            exact=asyncio.run(first_and_steady(server.url, shapes, ids, runs, False)),
            unseen=asyncio.run(first_and_steady(server.url, shapes, ids, runs, True)),
            memory_need_mib=round((report.get("memory") or {}).get("peak_bytes", 0) / 2**20),
            predictor_error=predictor_error(report),
        )
    finally:
        server.kill()
        if extra:
            shutil.rmtree(extra[1], ignore_errors=True)
    found["p1_exact"] = max(item["ratio"] for item in found["exact"])
    found["p1_unseen"] = max(item["ratio"] for item in found["unseen"])
    print(json.dumps({"model": name, "variant": variant, **found}), flush=True)
    return found


def predictor_error(report: dict[str, Any]) -> dict[str, float] | None:
    """The memory guard's prediction against each shape's measured need: the lowest and
    highest (predicted - need) / need over the shapes it predicted."""
    errors = [
        (item["predicted_bytes"] - item["peak_bytes"]) / item["peak_bytes"]
        for item in (report.get("memory") or {}).get("shapes") or []
        if item.get("predicted_bytes")
    ]
    if not errors:
        return None
    return {"lowest": round(min(errors), 3), "highest": round(max(errors), 3)}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| model | variant | to /ready (s) | warmup (s) | P1 planned shapes | P1 unseen token "
        "counts | worst shape | memory prediction error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, variants in results.items():
        for variant, found in variants.items():
            if "error" in found:
                lines.append(f"| {name} | {variant} | {found['error']} | | | | | |")
                continue
            worst = max(found.get("exact", []) + found.get("unseen", []), key=lambda x: x["ratio"])
            error = found.get("predictor_error")
            lines.append(
                f"| {name} | {variant} | {found['ready_s']} | {found.get('warmup_s') or 0:.1f} | "
                f"{found['p1_exact']:.2f} | {found['p1_unseen']:.2f} | {worst['shape']} "
                f"({worst['first_ms']:.0f} vs {worst['steady_ms']:.0f} ms) | "
                + (f"{error['lowest']:+.0%} to {error['highest']:+.0%} |" if error else "|")
            )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    variants = args.variants.split(",")
    baseline = worktree(args.baseline) if "before" in variants else None
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for name in args.models.split(","):
            folder = model_folder(name)
            results[name] = {}
            for variant in variants:
                checkout = baseline if variant == "before" else REPO
                assert checkout is not None
                results[name][variant] = measure(name, variant, folder, checkout, args)
            args.onnx_dir = None
            process, _, found = start_infinity_onnx(args, str(folder), name, timeout_s=900)
            if process is not None:
                process.kill()
                process.wait(30)
                results[name]["Infinity + ONNX Runtime"] = {
                    "ready_s": found["ready_seconds"],
                    "note": "to /health, after its export",
                }
    finally:
        if baseline is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": head(),
        "baseline": args.baseline,
        "machine": machine(),
        "results": results,
    }
    (out / "bench_warm.json").write_text(json.dumps(document, indent=2) + "\n")
    print(table({k: {v: f for v, f in d.items() if "exact" in f or "error" in f}
                 for k, d in results.items()}))  # fmt: skip
    for name, variants_found in results.items():
        peer = variants_found.get("Infinity + ONNX Runtime")
        if peer:
            print(f"{name}: Infinity + ONNX Runtime ready in {peer['ready_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
