#!/usr/bin/env python3
"""`make bench-compile-cache`: what --compile-cache saves a restart of `--backend onnxruntime`.

The XLM-R model of multilingual-e5-base's shape (bench_models.py builds it once), served with
`--backend onnxruntime --compile-cache` on an empty cache (the export runs and is stored), then
again on the same cache (a restarted container: the export is opened, not made). For each:
seconds from start to a warm /ready, the warmup and its export (or open) part, the slowest
answer of /ready while starting (the export holds the interpreter), resident memory at ready
and its peak. Results: bench/results/compile_cache.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_models import build, memory_of
from bench_server import REPO, machine
from loadgen import markdown_table

from warmgate_testkit.process import ServerProcess


def start(model: Path, cache: Path) -> dict[str, Any]:
    server = ServerProcess(
        ["--model", str(model), "--device", "cpu", "--backend", "onnxruntime",
         "--compile-cache", str(cache)]
    )  # fmt: skip
    started = time.monotonic()
    server.start()
    try:
        server.wait_for_port(300)
        slowest = 0.0
        while True:
            asked = time.monotonic()
            try:
                with urllib.request.urlopen(server.url + "/ready", timeout=300) as response:
                    report, status = json.loads(response.read()), response.status
            except urllib.error.HTTPError as error:
                report, status = json.loads(error.read()), error.code
            slowest = max(slowest, time.monotonic() - asked)
            if status == 200:
                break
            if report.get("phase") == "failed":
                raise RuntimeError(report.get("error"))
            time.sleep(0.2)
        onnx = report["forward"]["onnxruntime"]
        return {
            "ready_seconds": round(time.monotonic() - started, 1),
            "warmup_seconds": round(report["warmup_seconds"], 1),
            "export_or_open_seconds": onnx["export_seconds"],
            "cache": onnx["cache"],
            "slowest_ready_answer_seconds": round(slowest, 2),
            "memory_mib": memory_of(server.pid),
        }
    finally:
        server.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    model = build("e5-base")
    cache = Path(tempfile.mkdtemp(prefix="warmgate-bench-compile-"))
    try:
        runs = {"first start (exports, stores)": start(model, cache)}
        runs["restart (opens the stored export)"] = start(model, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_cache.json").write_text(json.dumps(result, indent=2))
    rows = [
        {"start": name, **{k: v for k, v in run.items() if k != "memory_mib"},
         "VmRSS MiB": run["memory_mib"].get("VmRSS"), "VmHWM MiB": run["memory_mib"].get("VmHWM")}
        for name, run in runs.items()
    ]  # fmt: skip
    print(markdown_table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
