"""Cold-versus-warm and throughput of the real server on a GPU (or CPU when told), in one run.

For each dtype: a server with warmup and one without; the first request of every planned shape
right after /ready against that shape's steady median; then closed-loop throughput at a few
concurrencies. Writes gpu_bench.json and gpu_bench.md to $OUT (or --out).

    MODEL_DIR=/path/to/all-MiniLM-L6-v2 OUT=/tmp/out python3 bench/server/gpu_bench.py
    python3 bench/server/gpu_bench.py --device cpu --dtypes float32 --quick   # smoke test
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
import time
from pathlib import Path
from typing import Any

from loadgen import SHORT_SENTENCES, closed_loop, markdown_table, probe_shapes

from warmgate_server.testing import ServerProcess


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL_DIR"))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu; never guessed")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--buckets", default="32,64,128,256")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--load-seconds", type=float, default=6.0)
    parser.add_argument("--steady-runs", type=int, default=10)
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=420.0,
        help="stop starting new phases after this long",
    )
    parser.add_argument("--quick", action="store_true", help="tiny plan and short loads")
    args = parser.parse_args()
    if not args.model:
        parser.error("pass --model or set MODEL_DIR to the model folder")
    if args.quick:
        args.buckets, args.batch_sizes, args.concurrency = "16,32", "1,4", "1,4"
        args.load_seconds, args.steady_runs = 2.0, 3
    return args


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # the report says why instead of failing the run
        info["torch_error"] = repr(exc)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as exc:
        info["transformers_error"] = repr(exc)
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith(("Model name", "CPU(s):")):
                key, value = line.split(":", 1)
                info[key.strip()] = value.strip()
    except Exception:
        pass
    return info


def server_args(args: argparse.Namespace, dtype: str, warmup: bool) -> list[str]:
    return [
        "--model", args.model, "--device", args.device, "--dtype", dtype,
        "--sequence-buckets", args.buckets, "--warmup-batch-sizes", args.batch_sizes,
        "--max-batch-size", args.batch_sizes.split(",")[-1],
        "--warmup" if warmup else "--no-warmup", "--drain-seconds", "5",
    ]  # fmt: skip


def run_server(
    args: argparse.Namespace, dtype: str, warmup: bool, logs: list[str], load: bool
) -> dict[str, Any]:
    label = f"{dtype} {'warmup' if warmup else 'no-warmup'}"
    result: dict[str, Any] = {"dtype": dtype, "warmup": warmup}
    started = time.monotonic()
    server = ServerProcess(server_args(args, dtype, warmup), python=sys.executable)
    try:
        server.start()
        report = server.wait_ready(timeout=240)
        result["seconds_to_ready"] = round(time.monotonic() - started, 2)
        result["warmup_seconds"] = report["warmup_seconds"]
        result["device"], result["served_dtype"] = report["device"], report["dtype"]
        result["server_steady_ms"] = {
            f"{s['batch_size']}x{s['seq_len']}": s["steady_ms"] for s in report["warmed_shapes"]
        }
        shapes = report["planned_shapes"]
        result["shapes"] = asyncio.run(
            asyncio.wait_for(probe_shapes(server.url, shapes, args.steady_runs), 180)
        )
        if load:
            result["load"] = []
            largest = int(args.batch_sizes.split(",")[-1])
            big = (SHORT_SENTENCES * 8)[:largest]
            concurrencies = [int(value) for value in args.concurrency.split(",")]
            points = [(SHORT_SENTENCES[:1], c, None) for c in concurrencies]
            points += [(big, c, None) for c in concurrencies]
            # The same batches as base64: the server's rate when float JSON is not the cost.
            points += [(big, c, "base64") for c in concurrencies[1:]]
            for batch, concurrency, encoding in points:
                measured = asyncio.run(
                    asyncio.wait_for(
                        closed_loop(
                            server.url,
                            concurrency,
                            batch,
                            args.load_seconds,
                            encoding_format=encoding,
                        ),
                        args.load_seconds + 60,
                    )
                )
                result["load"].append(measured)
        server.terminate()
        result["exit_code"] = server.wait(timeout=30)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        server.kill()
        logs.append(f"===== {label} =====\n{server.log()[-20000:]}")
    return result


def st_baseline(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """sentence-transformers encode in this process: one sentence, and batches, same dtype."""
    result: dict[str, Any] = {"dtype": dtype}
    try:
        import torch
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(
            args.model, device=args.device, model_kwargs={"torch_dtype": getattr(torch, dtype)}
        )
        largest = int(args.batch_sizes.split(",")[-1])
        batch = (SHORT_SENTENCES * 8)[:largest]
        for _ in range(3):
            model.encode(batch, batch_size=largest)
            model.encode(SHORT_SENTENCES[:1])
        single = []
        for _ in range(30):
            started = time.perf_counter()
            model.encode(SHORT_SENTENCES[:1])
            single.append((time.perf_counter() - started) * 1000.0)
        result["single_p50_ms"] = round(statistics.median(single), 2)
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < args.load_seconds:
            model.encode(batch, batch_size=largest)
            count += len(batch)
        result["batched_inputs_per_s"] = round(count / (time.perf_counter() - started), 1)
        del model
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return result


def summarise(
    results: list[dict[str, Any]], info: dict[str, Any], baselines: list[dict[str, Any]]
) -> str:
    lines = ["# warmgate server benchmark", "", f"Machine: `{json.dumps(info)}`", ""]
    if baselines:
        lines += ["## sentence-transformers in-process encode (the ceiling)", ""]
        lines += [
            markdown_table(baselines, ["dtype", "single_p50_ms", "batched_inputs_per_s", "error"]),
            "",
        ]
    for result in results:
        title = f"## {result['dtype']}, {'warmup' if result['warmup'] else 'no warmup'}"
        lines += [title, ""]
        if "error" in result:
            lines += [f"Error: `{result['error']}`", ""]
        lines.append(
            f"seconds to /ready: {result.get('seconds_to_ready')}, "
            f"warmup seconds: {result.get('warmup_seconds')}, device {result.get('device')}"
        )
        lines.append("")
        if result.get("shapes"):
            worst = max(shape["ratio"] for shape in result["shapes"])
            lines.append(f"worst first/steady ratio: **{worst}**")
            lines.append("")
            lines.append(
                markdown_table(
                    result["shapes"],
                    [
                        "batch_size",
                        "seq_len",
                        "first_ms",
                        "steady_ms",
                        "ratio",
                        "first_cold_header",
                    ],
                )
            )
            lines.append("")
        if result.get("load"):
            lines.append(
                markdown_table(
                    result["load"],
                    [
                        "concurrency",
                        "batch",
                        "encoding",
                        "req_per_s",
                        "inputs_per_s",
                        "p50_ms",
                        "p99_ms",
                        "errors",
                    ],
                )
            )
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.monotonic()
    info = machine(args.device)
    results: list[dict[str, Any]] = []
    logs: list[str] = []
    baselines: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        for warmup in (True, False):
            if time.monotonic() - begun > args.budget_seconds:
                results.append({"dtype": dtype, "warmup": warmup, "error": "skipped: budget"})
                continue
            results.append(run_server(args, dtype, warmup, logs, load=warmup))
            print(json.dumps(results[-1])[:3000], flush=True)
        if time.monotonic() - begun < args.budget_seconds:
            baselines.append(st_baseline(args, dtype))
            print(json.dumps(baselines[-1]), flush=True)
    document = {"machine": info, "args": vars(args), "results": results, "baselines": baselines,
                "seconds": round(time.monotonic() - begun, 1)}  # fmt: skip
    (out / "gpu_bench.json").write_text(json.dumps(document, indent=2))
    (out / "gpu_bench.md").write_text(summarise(results, info, baselines))
    (out / "gpu_bench_server_logs.txt").write_text("\n".join(logs))
    print(summarise(results, info, baselines))
    return 0 if all("error" not in result for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
