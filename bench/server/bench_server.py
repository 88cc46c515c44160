"""CPU benchmark of the warmgate server (`make bench-server`), beside its peers, in one run.

1. The machine: CPU model and cores, and its measured fp32 matmul GFLOP/s.
2. Cold versus warm: the server with and without warmup; right after /ready, the first request
   of each planned shape against that shape's steady median (target with warmup: <= 1.25).
3. Throughput and latency at concurrency 1, 8 and 32, single short sentences and batches of 32:
   warmgate, sentence-transformers encode in-process (the ceiling), and Infinity (its own venv,
   the same local model folder, offline) when it can be installed and started.
4. Served tokens/s against the matmul peak (about 22 MFLOP per token for all-MiniLM-L6-v2).

Writes bench/results/bench_server.json and the server section of docs/benchmarks.md.
Not a timed test: it takes several minutes, longer on a contended machine.
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
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadgen import SHORT_SENTENCES, closed_loop, markdown_table, probe_shapes

from warmgate_server.config import ServerConfig
from warmgate_server.cpus import plan_threads, usable_cpus
from warmgate_server.testing import ServerProcess, minilm_path

REPO = Path(__file__).resolve().parents[2]
MFLOP_PER_TOKEN = 22.0
INFINITY_VENV = Path(os.environ.get("INFINITY_VENV", "~/.cache/warmgate/infinity-venv"))
COLUMNS = ["batch_size", "seq_len", "first_ms", "steady_ms", "ratio", "worst_ratio",
           "first_cold_header"]  # fmt: skip
UNSEEN_COLUMNS = ["batch_size", "seq_len", "tokens", "first_ms", "steady_ms", "ratio",
                  "worst_ratio", "first_cold_header"]  # fmt: skip
BEGIN, END = "<!-- server-benchmarks:begin -->", "<!-- server-benchmarks:end -->"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model folder (default: local MiniLM)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per load point")
    parser.add_argument("--steady-runs", type=int, default=5)
    parser.add_argument("--cold-repeats", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--probe-buckets", default="32,64,128")
    parser.add_argument("--probe-batch-sizes", default="1,8,32")
    parser.add_argument("--probe-max-batch-tokens", default="4096")
    parser.add_argument("--serve-buckets", default="12,16,24,32,64,128,256")
    parser.add_argument("--skip-infinity", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    return parser.parse_args()


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "load_average": os.getloadavg()}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket"):
            info[key.strip()] = value.strip()
    info["usable_cpus"] = usable_cpus()
    plan = plan_threads(ServerConfig(model="-"), "cpu")  # the server's defaults here
    info["server_torch_threads"], info["server_workers"] = plan.threads, plan.workers
    return info


def matmul_gflops(threads: int, size: int = 1024, seconds: float = 3.0) -> float:
    """Measured fp32 matmul throughput with `threads` torch threads."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(3):
            a @ b
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
        return 2 * size**3 * count / (time.perf_counter() - started) / 1e9
    finally:
        torch.set_num_threads(saved)


def cold_versus_warm(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """Each case in `args.cold_repeats` fresh server processes: a first request is one sample,
    and on a shared machine one sample can land on someone else's burst. Per shape the table
    gives the median over the processes (and the worst single process beside it)."""
    results = []
    for warmup in (True, False):
        server_args = [
            "--model", model, "--device", "cpu",
            "--sequence-buckets", args.probe_buckets,
            "--warmup-batch-sizes", args.probe_batch_sizes,
            "--max-batch-tokens", args.probe_max_batch_tokens,
            "--warmup" if warmup else "--no-warmup",
        ]  # fmt: skip
        repeats: list[dict[str, Any]] = []
        for _ in range(args.cold_repeats):
            with ServerProcess(server_args) as server:
                report = server.wait_ready(timeout=900)
                planned = report["planned_shapes"]
                run = {
                    "warmup_seconds": report["warmup_seconds"],
                    "shapes": asyncio.run(probe_shapes(server.url, planned, args.steady_runs)),
                }
                if warmup:  # the same shapes at token counts warmup never ran (packed pass)
                    run["unseen_token_counts"] = asyncio.run(
                        probe_shapes(server.url, planned, args.steady_runs, True)
                    )
                server.terminate()
                server.wait(60)
            repeats.append(run)
            print(json.dumps({"warmup": warmup, **run}), flush=True)
        result: dict[str, Any] = {
            "warmup": warmup,
            "processes": len(repeats),
            "warmup_seconds": repeats[0]["warmup_seconds"],
            "shapes": _median_over_processes([run["shapes"] for run in repeats]),
            "repeats": repeats,
        }
        if warmup:
            result["unseen_token_counts"] = _median_over_processes(
                [run["unseen_token_counts"] for run in repeats]
            )
        results.append(result)
    return results


def _median_over_processes(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged = []
    for per_process in zip(*runs, strict=True):
        ratios = [shape["ratio"] for shape in per_process]
        merged.append(
            {
                **{key: per_process[0][key] for key in ("batch_size", "seq_len", "tokens")},
                "first_ms": round(statistics.median(s["first_ms"] for s in per_process), 2),
                "steady_ms": round(statistics.median(s["steady_ms"] for s in per_process), 2),
                "ratio": round(statistics.median(ratios), 3),
                "worst_ratio": max(ratios),
                "first_cold_header": "".join(s["first_cold_header"] for s in per_process),
            }
        )
    return merged


def start_infinity(
    args: argparse.Namespace, model: str, served_name: str = "minilm", timeout_s: float = 600
) -> tuple[Any, str, dict[str, Any]]:
    """Infinity in its own venv on the same model folder, offline, at its defaults (torch on
    all CPUs), as a user would run it; warmgate runs at its defaults too. Its dict says how
    long it took to answer /health (`ready_seconds`)."""
    venv = INFINITY_VENV.expanduser()
    binary = venv / "bin" / "infinity_emb"
    if not binary.exists():
        error = (f"{binary} not found: install with `python -m venv {venv} && "
                 f"{venv}/bin/pip install 'infinity-emb[server,torch]'`")  # fmt: skip
        return None, "", {"error": error}
    port = 7997 + os.getpid() % 1000
    log_path = Path(args.out) / "infinity.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
    }  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)
    command = [
        str(binary), "v2", "--model-id", model, "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--engine", "torch",
        "--batch-size", "32",
    ]  # fmt: skip
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = started + timeout_s
    while True:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:]
            return None, url, {"error": f"infinity exited ({process.returncode}): {tail}"}
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    ready = round(time.monotonic() - started, 1)
                    found = {"command": " ".join(command), "points": [], "ready_seconds": ready}
                    return process, url, found
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            return None, url, {"error": f"infinity was not healthy within {timeout_s:g} s"}
        time.sleep(0.5)


def side_by_side(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """warmgate and Infinity both up; each load point runs on one, then at once on the other,
    and the in-process ceiling is measured between them, so all three see the same machine."""
    server_args = [
        "--model", model, "--device", "cpu", "--sequence-buckets", args.serve_buckets,
        "--warmup-batch-sizes", "1,8,32", "--max-batch-tokens", "4096",
    ]  # fmt: skip
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(model, device="cpu")
    result: dict[str, Any] = {"warmgate": {"points": []}, "ceiling": []}
    infinity_process = None
    with ServerProcess(server_args) as server:
        report = server.wait_ready(timeout=900)
        result["warmgate"]["warmup_seconds"] = report["warmup_seconds"]
        if args.skip_infinity:
            infinity = {"error": "skipped (--skip-infinity)"}
        else:
            infinity_process, infinity_url, infinity = start_infinity(args, model)
        result["infinity"] = infinity
        try:
            for batch in (SHORT_SENTENCES[:1], (SHORT_SENTENCES * 4)[:32]):
                ceiling = sentence_transformers_ceiling(args, encoder)
                ceiling["load_average"] = os.getloadavg()[0]
                result["ceiling"].append(ceiling)
                print(json.dumps(ceiling), flush=True)
                for concurrency in map(int, args.concurrency.split(",")):
                    point = asyncio.run(closed_loop(server.url, concurrency, batch, args.seconds))
                    point["load_average"] = round(os.getloadavg()[0], 1)
                    result["warmgate"]["points"].append(point)
                    print("warmgate", json.dumps(point), flush=True)
                    if infinity_process is not None:
                        point = asyncio.run(
                            closed_loop(
                                infinity_url,
                                concurrency,
                                batch,
                                args.seconds,
                                "/embeddings",
                                "minilm",
                            )
                        )
                        point["load_average"] = round(os.getloadavg()[0], 1)
                        infinity["points"].append(point)
                        print("infinity", json.dumps(point), flush=True)
        finally:
            if infinity_process is not None and infinity_process.poll() is None:
                infinity_process.kill()
                infinity_process.wait(30)
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        server.terminate()
        server.wait(60)
    result["warmgate"]["padding"] = [
        line for line in metrics.splitlines() if line.startswith("warmgate_padding_ratio_")
    ]
    return result


def sentence_transformers_ceiling(args: argparse.Namespace, encoder: Any) -> dict[str, Any]:
    """In-process encode on all usable CPUs (torch's default): one sentence, batches of 32."""
    import torch

    torch.set_num_threads(usable_cpus())
    batch = (SHORT_SENTENCES * 4)[:32]
    for _ in range(3):
        encoder.encode(batch, batch_size=32)
    single = []
    for _ in range(50):
        started = time.perf_counter()
        encoder.encode(SHORT_SENTENCES[:1])
        single.append((time.perf_counter() - started) * 1000.0)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        encoder.encode(batch, batch_size=32)
        count += len(batch)
    tokens = [len(ids) for ids in encoder.tokenizer(batch)["input_ids"]]
    return {
        "torch_threads": torch.get_num_threads(),
        "single_p50_ms": round(statistics.median(single), 2),
        "batched_inputs_per_s": round(count / (time.perf_counter() - started), 1),
        "mean_tokens_per_input": round(statistics.mean(tokens), 1),
        "padded_tokens_per_input": max(tokens),
    }


def write_doc(doc: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put `section` between `begin` and `end` in `doc` (appended when they are absent)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def render(result: dict[str, Any]) -> str:
    info, peak = result["machine"], result["matmul_gflops"]
    lines = [
        "## Server (CPU)",
        "",
        f"Run {result['date']} with `make bench-server` (bench/server/bench_server.py).",
        f"Machine: {info.get('Model name')}, {info.get('CPU(s)')} CPUs "
        f"({info['usable_cpus']} usable), torch {info['torch']}; load average at start "
        f"{', '.join(f'{v:.1f}' for v in info['load_average'])}"
        + (
            " (other work shared the CPUs: the numbers are noisy and lower than idle)."
            if info["load_average"][0] >= 1.0
            else " (the machine was otherwise idle)."
        ),
        f"Measured fp32 matmul (1024x1024): {peak['server_threads']:.1f} GFLOP/s with one "
        f"model worker's {info['server_torch_threads']} torch thread(s), "
        f"{peak['all_threads']:.1f} GFLOP/s with all CPUs at the start and "
        f"{result['matmul_gflops_after']:.1f} at the end.",
        "warmgate ran at its defaults on this machine: "
        f"{info.get('server_workers', '?')} model workers x {info['server_torch_threads']} torch "
        "thread(s), the padding-free (packed) forward pass; Infinity at its defaults too.",
        "",
        "### Cold versus warm (first request of each planned shape right after /ready)",
        "",
        "Each case ran in several fresh server processes; per shape, `first_ms`, `steady_ms` and "
        "`ratio` are medians over the processes, `worst_ratio` the worst single process, and "
        "`first_cold_header` has one `X-Warmgate-Cold` value per process.",
        "",
    ]
    for run in result["cold_versus_warm"]:
        worst = max(shape["ratio"] for shape in run["shapes"])
        label = "with warmup" if run["warmup"] else "without warmup"
        lines += [
            f"**{label}** ({run['processes']} processes): worst per-shape median first/steady "
            f"= **{worst}**, worst single process {max(s['worst_ratio'] for s in run['shapes'])} "
            f"(warmup took {run['warmup_seconds']} s)",
            "",
            markdown_table(run["shapes"], COLUMNS),
            "",
        ]
        if run.get("unseen_token_counts"):
            unseen = run["unseen_token_counts"]
            lines += [
                "**with warmup, token counts warmup never ran** (the same shapes, each text 1-3 "
                "tokens short of its bucket: the packed linear layers see a row count for the "
                f"first time): worst first/steady = **{max(s['ratio'] for s in unseen)}**",
                "",
                markdown_table(unseen, UNSEEN_COLUMNS),
                "",
            ]
    ceiling = result["sentence_transformers"]
    lines += [
        "### Throughput and latency (closed loop, OpenAI route)",
        "",
        "Each load point ran on warmgate, then at once on Infinity (both servers up, the idle "
        "one costs nothing); sentence-transformers' in-process encode, the ceiling, was measured "
        "just before the single-sentence points and again before the batch points (the better "
        "of the two is used below). `load_average` is the machine's 1-minute load when the "
        "point ended: other engineers' builds and tests shared these 2 CPUs.",
        "",
        f"sentence-transformers in-process ({ceiling['torch_threads']} thread(s)): one "
        f"sentence p50 **{ceiling['single_p50_ms']} ms**; batches of 32: "
        f"**{ceiling['batched_inputs_per_s']} inputs/s** (measurements: "
        + "; ".join(
            f"{c['single_p50_ms']} ms / {c['batched_inputs_per_s']} inputs/s at load "
            f"{c['load_average']:.1f}"
            for c in result["ceilings"]
        )
        + ").",
        "",
    ]
    columns = ["concurrency", "batch", "req_per_s", "inputs_per_s", "p50_ms", "p90_ms", "p99_ms",
               "errors", "load_average"]  # fmt: skip
    lines += ["warmgate:", "", markdown_table(result["warmgate"]["points"], columns), ""]
    infinity = result["infinity"]
    if "error" in infinity:
        lines += [f"Infinity: not measured: `{infinity['error'][:800]}`", ""]
    else:
        lines += ["Infinity:", "", markdown_table(infinity["points"], columns), ""]
    lines += ["### Against the targets and the matmul peak", ""]
    lines += [f"- {line}" for line in result["verdicts"]]
    return "\n".join(lines)


def verdicts(result: dict[str, Any]) -> list[str]:
    out = []
    ceiling = result["sentence_transformers"]
    points = {(p["concurrency"], p["batch"]): p for p in result["warmgate"]["points"]}
    single = points.get((1, 1))
    if single:
        ratio = single["p50_ms"] / ceiling["single_p50_ms"]
        out.append(
            f"p50 at concurrency 1: {single['p50_ms']} ms = {ratio:.2f}x in-process encode of "
            f"one sentence (target <= 1.3x)"
        )
    best = max(result["warmgate"]["points"], key=lambda p: p["inputs_per_s"])
    c32 = points.get((32, 32))
    if c32:
        share = c32["inputs_per_s"] / ceiling["batched_inputs_per_s"]
        out.append(
            f"throughput at concurrency 32 (batches of 32): {c32['inputs_per_s']} inputs/s = "
            f"{share:.2f}x in-process batched encode (target >= 0.8x)"
        )
        infinity = result["infinity"]
        if "points" in infinity:
            peer = {(p["concurrency"], p["batch"]): p for p in infinity["points"]}.get((32, 32))
            if peer and peer["inputs_per_s"]:
                out.append(
                    f"against Infinity at concurrency 32 (batches of 32): "
                    f"{c32['inputs_per_s'] / peer['inputs_per_s']:.2f}x (target >= 1.2x)"
                )
    for run in result["cold_versus_warm"]:
        worst = max(shape["ratio"] for shape in run["shapes"])
        single = max(shape["worst_ratio"] for shape in run["shapes"])
        label = "with" if run["warmup"] else "without"
        out.append(
            f"worst first/steady {label} warmup: {worst} as the median of "
            f"{run['processes']} processes, {single} in the worst single process "
            "(target with warmup <= 1.25)"
        )
        if run.get("unseen_token_counts"):
            worst = max(shape["ratio"] for shape in run["unseen_token_counts"])
            out.append(f"worst first/steady with warmup at unseen token counts: {worst} (median)")
    tokens = ceiling["mean_tokens_per_input"]
    served_tokens = best["inputs_per_s"] * tokens
    gflops = served_tokens * MFLOP_PER_TOKEN / 1000.0
    peak = max(result["matmul_gflops"]["all_threads"], result["matmul_gflops_after"])
    out.append(
        f"best served rate {best['inputs_per_s']} inputs/s x {tokens} real tokens = "
        f"{served_tokens:.0f} tokens/s = {gflops:.1f} GFLOP/s of model work, "
        f"{100 * gflops / peak:.0f}% of the measured matmul peak on all CPUs "
        f"({peak:.1f} GFLOP/s); the rest is attention, GELU and layer norms, the small "
        "(384-wide) matrices, and tokenizing, JSON and HTTP on the same CPUs"
    )
    return out


def main() -> int:
    args = parse_args()
    model = args.model or str(minilm_path())
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    result["machine"] = machine()
    result["matmul_gflops"] = {
        "server_threads": matmul_gflops(result["machine"]["server_torch_threads"]),
        "all_threads": matmul_gflops(usable_cpus()),
    }
    print(json.dumps(result), flush=True)
    result["cold_versus_warm"] = cold_versus_warm(args, model)
    side = side_by_side(args, model)
    result["warmgate"], result["infinity"] = side["warmgate"], side["infinity"]
    result["ceilings"] = side["ceiling"]
    result["sentence_transformers"] = {
        "torch_threads": side["ceiling"][0]["torch_threads"],
        "single_p50_ms": min(c["single_p50_ms"] for c in side["ceiling"]),
        "batched_inputs_per_s": max(c["batched_inputs_per_s"] for c in side["ceiling"]),
        "mean_tokens_per_input": side["ceiling"][0]["mean_tokens_per_input"],
    }
    result["matmul_gflops_after"] = matmul_gflops(usable_cpus())
    result["verdicts"] = verdicts(result)
    (out / "bench_server.json").write_text(json.dumps(result, indent=2))
    write_doc(Path(args.doc), render(result))
    print("\n".join(result["verdicts"]))
    return 0


if __name__ == "__main__":
    if shutil.which("lscpu") is None:
        print("lscpu not found", file=sys.stderr)
    sys.exit(main())
