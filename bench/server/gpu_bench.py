"""The server on a GPU against in-process sentence-transformers, in one run (issue 16's figures).

For each dtype, one server per forward-pass variant, same model and plan:
  graphs  the planned shapes as CUDA graphs (--cuda-graphs on)
  packed  no graphs, warmgate's padding-free pass with variable-length attention
  eager   no graphs, the model's own padded pass (--packing off)
  graphs-1tok  graphs with one tokenizer thread (what the tokenizer pool buys)
and sentence-transformers' encode in this process. Per server: warmup seconds, the graphs'
and the process's GPU memory, the first request of every planned shape right after /ready
against its steady median, vectors against sentence-transformers, inputs/s for batches of 32
at concurrency 32 and p50 of one input at concurrency 1. Writes gpu_bench.json and gpu_bench.md
to $OUT (or --out), with the issue's targets checked.

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

from warmgate_testkit.process import ServerProcess


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL_DIR"))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu; never guessed")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument(
        "--variants",
        default="graphs,packed,eager,graphs-1tok",
        help="server variants to run, in order (see the module docstring)",
    )
    parser.add_argument("--buckets", default="32,64,128,256")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--concurrency", default="1,32")
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


VARIANTS: dict[str, list[str]] = {
    "graphs": ["--cuda-graphs", "on"],
    "packed": ["--cuda-graphs", "off", "--packing", "on"],
    "eager": ["--cuda-graphs", "off", "--packing", "off"],
    "graphs-1tok": ["--cuda-graphs", "on", "--tokenization-workers", "1"],
}


def server_args(args: argparse.Namespace, dtype: str, variant: str) -> list[str]:
    extra = VARIANTS[variant]
    if args.device == "cpu":  # a smoke test: graphs need CUDA
        extra = ["auto" if item == "on" else item for item in extra]
    return [
        "--model", args.model, "--device", args.device, "--dtype", dtype,
        "--sequence-buckets", args.buckets, "--warmup-batch-sizes", args.batch_sizes,
        "--max-batch-size", args.batch_sizes.split(",")[-1],
        "--warmup", "--drain-seconds", "5", *extra,
    ]  # fmt: skip


def gpu_memory_mib(pid: int) -> float | None:
    """The process's GPU memory as nvidia-smi sees it (None without nvidia-smi)."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return float(fields[1].split()[0])
    return None


async def served_vectors(url: str, texts: list[str]) -> list[list[float]]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/embeddings", json={"input": texts}) as response,
    ):
        body = await response.json()
    if response.status != 200:
        raise RuntimeError(f"/v1/embeddings answered {response.status}: {body}")
    return [item["embedding"] for item in body["data"]]


def min_cosine(a: list[list[float]], b: Any) -> float:
    import numpy as np

    left, right = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    left /= np.linalg.norm(left, axis=1, keepdims=True)
    right /= np.linalg.norm(right, axis=1, keepdims=True)
    return round(float((left * right).sum(axis=1).min()), 6)


def run_server(
    args: argparse.Namespace,
    dtype: str,
    variant: str,
    logs: list[str],
    reference: Any,
) -> dict[str, Any]:
    label = f"{dtype} {variant}"
    result: dict[str, Any] = {"dtype": dtype, "variant": variant}
    started = time.monotonic()
    server = ServerProcess(server_args(args, dtype, variant), python=sys.executable)
    try:
        server.start()
        report = server.wait_ready(timeout=240)
        result["seconds_to_ready"] = round(time.monotonic() - started, 2)
        result["warmup_seconds"] = report["warmup_seconds"]
        result["device"], result["served_dtype"] = report["device"], report["dtype"]
        forward = report.get("forward") or {}
        graphs = forward.get("cuda_graphs") or {}
        result["forward"] = f"{forward.get('pass')}, attention {forward.get('attention')}"
        result["graphs"] = graphs.get("captured", 0) if graphs.get("mode") == "on" else 0
        result["graphs_off_reason"] = graphs.get("reason") or ""
        result["graph_memory_mib"] = round(graphs.get("memory_bytes", 0) / 2**20, 1)
        result["graph_capture_s"] = graphs.get("capture_seconds")
        result["gpu_memory_mib"] = gpu_memory_mib(server.pid)
        shapes = report["planned_shapes"]
        result["shapes"] = asyncio.run(
            asyncio.wait_for(probe_shapes(server.url, shapes, args.steady_runs), 180)
        )
        result["worst_first_over_steady"] = max(shape["ratio"] for shape in result["shapes"])
        result["cold_first_requests"] = sum(
            shape["first_cold_header"] == "1" for shape in result["shapes"]
        )
        if reference is not None:
            served = asyncio.run(served_vectors(server.url, vector_texts(args)))
            result["min_cosine_vs_st"] = min_cosine(served, reference)
        result["load"] = []
        largest = int(args.batch_sizes.split(",")[-1])
        big = (SHORT_SENTENCES * 8)[:largest]
        concurrencies = [int(value) for value in args.concurrency.split(",")]
        points = [(SHORT_SENTENCES[:1], concurrencies[0]), (big, concurrencies[-1])]
        for batch, concurrency in points:
            measured = asyncio.run(
                asyncio.wait_for(
                    closed_loop(server.url, concurrency, batch, args.load_seconds),
                    args.load_seconds + 60,
                )
            )
            result["load"].append(measured)
        result["single_p50_ms"] = result["load"][0]["p50_ms"]
        result["batched_inputs_per_s"] = result["load"][1]["inputs_per_s"]
        result["gpu_memory_mib_after_load"] = gpu_memory_mib(server.pid)
        server.terminate()
        result["exit_code"] = server.wait(timeout=30)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        server.kill()
        logs.append(f"===== {label} =====\n{server.log()[-20000:]}")
    return result


def vector_texts(args: argparse.Namespace) -> list[str]:
    """The texts whose vectors are compared: the long one only where a bucket holds it."""
    largest_bucket = int(args.buckets.split(",")[-1])
    return VECTOR_TEXTS if largest_bucket >= 128 else VECTOR_TEXTS[:-1]


VECTOR_TEXTS = [
    "hi",
    *SHORT_SENTENCES[:6],
    "Kubernetes readiness gates keep a pod out of the endpoints until a custom condition "
    "turns true, which lets an operator verify that every shape of the model is warm. " * 2,
]


def st_baseline(args: argparse.Namespace, dtype: str) -> tuple[dict[str, Any], Any]:
    """sentence-transformers encode in this process, same dtype: one sentence's p50, batches'
    inputs/s, and the reference vectors the servers are compared with."""
    result: dict[str, Any] = {"dtype": dtype}
    reference = None
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
        for _ in range(50):
            started = time.perf_counter()
            model.encode(SHORT_SENTENCES[:1])
            single.append((time.perf_counter() - started) * 1000.0)
        result["single_p50_ms"] = round(statistics.median(single), 2)
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < args.load_seconds:
            model.encode(batch, batch_size=largest)
            count += len(batch)
        result["batched_inputs_per_s"] = round(count / (time.perf_counter() - started), 1)
        reference = model.encode(vector_texts(args), convert_to_numpy=True)
        if args.device.startswith("cuda"):
            result["gpu_memory_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return result, reference


TARGETS = (
    "batched inputs/s >= 1.0x in-process; single p50 <= 1.1x in-process; "
    "first request per planned shape <= 1.25x steady"
)


def against_targets(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    if "error" in result or "error" in baseline or not baseline:
        return {}
    throughput = result["batched_inputs_per_s"] / baseline["batched_inputs_per_s"]
    latency = result["single_p50_ms"] / baseline["single_p50_ms"]
    return {
        "throughput_vs_st": round(throughput, 2),
        "p50_vs_st": round(latency, 2),
        "meets": {
            "throughput": throughput >= 1.0,
            "p50": latency <= 1.1,
            "first_request": result["worst_first_over_steady"] <= 1.25,
        },
    }


SHAPE_COLUMNS = ["batch_size", "seq_len", "first_ms", "steady_ms", "ratio", "first_cold_header"]
LOAD_COLUMNS = ["concurrency", "batch", "req_per_s", "inputs_per_s", "p50_ms", "p99_ms", "errors"]


def summarise(
    results: list[dict[str, Any]], info: dict[str, Any], baselines: list[dict[str, Any]]
) -> str:
    lines = ["# warmgate server on a GPU", "", f"Machine: `{json.dumps(info)}`", ""]
    lines += [f"Targets (issue 16): {TARGETS}.", ""]
    lines += ["## sentence-transformers in-process encode", ""]
    lines += [
        markdown_table(
            baselines,
            ["dtype", "single_p50_ms", "batched_inputs_per_s", "gpu_memory_mib", "error"],
        ),
        "",
        "## Servers",
        "",
        markdown_table(
            [{**result, **result.get("targets", {})} for result in results],
            [
                "dtype",
                "variant",
                "forward",
                "graphs",
                "warmup_seconds",
                "graph_capture_s",
                "graph_memory_mib",
                "gpu_memory_mib_after_load",
                "batched_inputs_per_s",
                "throughput_vs_st",
                "single_p50_ms",
                "p50_vs_st",
                "worst_first_over_steady",
                "cold_first_requests",
                "min_cosine_vs_st",
                "error",
            ],
        ),
        "",
    ]
    for result in results:
        lines += [f"### {result['dtype']}, {result['variant']}", ""]
        if result.get("graphs_off_reason"):
            lines += [f"graphs off: {result['graphs_off_reason']}", ""]
        if result.get("shapes"):
            lines.append(
                markdown_table(
                    result["shapes"],
                    SHAPE_COLUMNS,
                )
            )
            lines.append("")
        if result.get("load"):
            lines.append(
                markdown_table(
                    result["load"],
                    LOAD_COLUMNS,
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
        if time.monotonic() - begun > args.budget_seconds:
            results.append({"dtype": dtype, "variant": "all", "error": "skipped: budget"})
            continue
        baseline, reference = st_baseline(args, dtype)
        baselines.append(baseline)
        print(json.dumps(baseline), flush=True)
        for variant in args.variants.split(","):
            if time.monotonic() - begun > args.budget_seconds:
                results.append({"dtype": dtype, "variant": variant, "error": "skipped: budget"})
                continue
            result = run_server(args, dtype, variant, logs, reference)
            result["targets"] = against_targets(result, baseline)
            results.append(result)
            print(json.dumps(result)[:3000], flush=True)
        # Write as we go: a run cut short by the device's time limit still leaves its figures.
        write(out, info, args, results, baselines, begun)
    write(out, info, args, results, baselines, begun)
    (out / "gpu_bench_server_logs.txt").write_text("\n".join(logs))
    print(summarise(results, info, baselines))
    return 0 if all("error" not in result for result in results) else 1


def write(
    out: Path,
    info: dict[str, Any],
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    baselines: list[dict[str, Any]],
    begun: float,
) -> None:
    document = {"machine": info, "args": vars(args), "results": results, "baselines": baselines,
                "seconds": round(time.monotonic() - begun, 1)}  # fmt: skip
    (out / "gpu_bench.json").write_text(json.dumps(document, indent=2))
    (out / "gpu_bench.md").write_text(summarise(results, info, baselines))


if __name__ == "__main__":
    sys.exit(main())
