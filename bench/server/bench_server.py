"""CPU benchmark of the warmgate server (`make bench-server`), beside its peers, in one run.

1. The machine: CPU model and cores, and its measured fp32 matmul GFLOP/s.
2. Cold versus warm: the server with and without warmup; right after /ready, the first request
   of each planned shape against that shape's steady median (target with warmup: <= 1.25).
3. Throughput and latency at concurrency 1, 8 and 32, single short sentences and batches of 32:
   warmgate, sentence-transformers encode in-process (the ceiling), and two peers when they can
   be started, each from its own venv, offline: Infinity's torch engine on the same local model
   folder (`make bench-server-infinity`) and Infinity's ONNX Runtime engine (`--engine optimum`,
   `make bench-server-infinity-onnx`) on that folder's ONNX export (bench/server/onnx_export.py,
   made or refreshed here, idempotent). Each load point runs on warmgate, then at once on each
   peer; `--rounds N` repeats the whole set of points N times, alternating the same way.
4. Served tokens/s against the matmul peak (about 22 MFLOP per token for all-MiniLM-L6-v2), and
   issue 27's targets against Infinity with ONNX Runtime.

Writes bench/results/bench_server.json and the server section of docs/benchmarks.md (`--out`,
`--doc`). Not a timed test: it takes several minutes, longer on a contended machine. A short
run, throughput points only: `--skip-cold --points 1x1,32x1,8x32 --rounds 2 --seconds 4`.
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
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import onnx_export
from loadgen import SHORT_SENTENCES, closed_loop, markdown_table, probe_shapes

from warmgate_server.config import ServerConfig
from warmgate_server.cpus import plan_threads, usable_cpus
from warmgate_testkit.process import ServerProcess, minilm_path

REPO = Path(__file__).resolve().parents[2]
MFLOP_PER_TOKEN = 22.0
INFINITY_VENV = Path(os.environ.get("INFINITY_VENV", "~/.cache/warmgate/infinity-venv"))
# $INFINITY_ONNX_VENV, else ~/.cache/warmgate/infinity-onnx-venv
INFINITY_ONNX_VENV = onnx_export.ONNX_VENV
# The peers, in the order each load point runs on them after warmgate: result key, label.
PEERS = (("infinity", "Infinity (torch engine)"),
         ("infinity_onnx", "Infinity (ONNX Runtime engine, `--engine optimum`)"),
         ("warmgate_onnxruntime", "warmgate, `--backend onnxruntime`"))  # fmt: skip
POINT_COLUMNS = ["round", "concurrency", "batch", "req_per_s", "inputs_per_s", "p50_ms",
                 "p90_ms", "p99_ms", "errors", "load_average"]  # fmt: skip
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
    parser.add_argument(
        "--points",
        default=None,
        help="load points as CONCURRENCYxBATCH, e.g. 1x1,32x1,8x32 (batch 1 or "
        "32); default: each --concurrency with batch 1, then with batch 32",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the whole set of load points this many times"
    )
    parser.add_argument(
        "--skip-cold",
        action="store_true",
        help="skip the cold-versus-warm section (throughput and latency only)",
    )
    parser.add_argument("--skip-infinity", action="store_true")
    parser.add_argument("--skip-infinity-onnx", action="store_true")
    parser.add_argument("--skip-warmgate-onnxruntime", action="store_true",
                        help="leave out warmgate's own ONNX Runtime backend as a peer")  # fmt: skip
    parser.add_argument("--onnx-dir", type=Path, default=None,
                        help="where the ONNX export lives (default: ~/.cache/warmgate/onnx/"
                        "<model folder name>)")  # fmt: skip
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    args.load_points = load_points(args)
    return args


def load_points(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(concurrency, batch) in run order: `--points`, else every `--concurrency` with single
    sentences and then with batches of 32."""
    if args.points is None:
        levels = [int(c) for c in args.concurrency.split(",")]
        return [(c, b) for b in (1, 32) for c in levels]
    points = []
    for item in args.points.split(","):
        concurrency, _, batch = item.strip().lower().partition("x")
        if int(batch) not in (1, 32) or int(concurrency) < 1:
            raise SystemExit(f"--points: {item!r} is not CONCURRENCYx1 or CONCURRENCYx32")
        points.append((int(concurrency), int(batch)))
    return points


def batch_of(size: int) -> list[str]:
    return SHORT_SENTENCES[:1] if size == 1 else (SHORT_SENTENCES * 4)[:32]


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


def write_results(
    path: Path, result: dict[str, Any], columns: Sequence[str], rows: Sequence[dict[str, Any]]
) -> None:
    """`result` as JSON at `path`, then the machine and `rows` as a markdown table of
    `columns` on stdout (copied into docs/benchmarks.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"machine: {result['machine']}")
    print(markdown_table(list(rows), list(columns)))


def matmul_gflops(threads: int, size: int = 1024, seconds: float = 3.0) -> float:
    """Measured fp32 matmul throughput with `threads` torch threads: the faster of MKL (`a @ b`)
    and oneDNN on a reordered weight (what the packed pass's linear layers call), each for
    half of `seconds`. On AMD EPYC MKL is the slower one, by up to 2x on small matrices, so a
    peak measured with MKL alone reads below what the served model reaches."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        passes = {"mkl": lambda: a @ b}
        ops = torch.ops.mkldnn
        if torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise"):
            weight = ops._reorder_linear_weight(b, None)
            passes["onednn"] = lambda: ops._linear_pointwise(a, weight, None, "none", [], "")
        best = 0.0
        for run in passes.values():
            for _ in range(3):
                run()
            count, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds / 2:
                run()
                count += 1
            best = max(best, 2 * size**3 * count / (time.perf_counter() - started) / 1e9)
        return best
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
    return _serve_until_healthy(command, env, port, log_path, timeout_s)


def start_infinity_onnx(
    args: argparse.Namespace,
    model: str,
    served_name: str = "minilm",
    timeout_s: float = 600,
    extra: tuple[str, ...] = (),
    task: str = "feature-extraction",
) -> tuple[Any, str, dict[str, Any]]:
    """Infinity's ONNX Runtime engine (`--engine optimum --device cpu --pooling-method mean`,
    onnx_export.infinity_command, with `extra` flags) from its own venv, offline, on the model
    folder's ONNX export (made or refreshed by onnx_export.export first: idempotent, a no-op
    when up to date; `task`: onnx_export.TASKS, a re-ranker's text-classification)."""
    venv = INFINITY_ONNX_VENV.expanduser()
    binary = venv / "bin" / "infinity_emb"
    if not binary.exists():
        error = (f"{binary} not found: install with `make bench-server-infinity-onnx` "
                 f"(python -m venv {venv} && {venv}/bin/pip install "
                 "'infinity-emb[server,optimum]==0.0.78' and the Makefile's pins)")  # fmt: skip
        return None, "", {"error": error}
    source = Path(model).expanduser().resolve()
    out = args.onnx_dir
    if out is None:  # the PyPI package's folder is called `model`: name it by its package
        out = onnx_export.OUT_ROOT / (source.parent.name if source.name == "model" else source.name)
    started = time.monotonic()
    try:
        folder = onnx_export.export(source, out, venv=venv, log=print, task=task)
    except (OSError, RuntimeError, ValueError) as error:
        return None, "", {"error": f"ONNX export of {source} failed: {error}"}
    export_seconds = round(time.monotonic() - started, 1)
    port = onnx_export.free_port()
    log_path = Path(args.out) / "infinity-onnx.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = onnx_export.offline_env()
    env.pop("OMP_NUM_THREADS", None)
    command = onnx_export.infinity_command(folder, port, venv, served_name, extra)
    process, url, found = _serve_until_healthy(command, env, port, log_path, timeout_s)
    found.update(onnx_folder=str(folder), export_seconds=export_seconds)
    if process is not None:
        log_text = log_path.read_text(errors="replace")
        found["loaded_optimized_file"] = "Optimized model found at" in log_text
    return process, url, found


def _serve_until_healthy(
    command: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float
) -> tuple[Any, str, dict[str, Any]]:
    """Starts `command` (logging to `log_path`) and waits for /health 200 on `port`."""
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
                    found = {"command": " ".join(command), "points": [], "ready_seconds": ready,
                             "pid": process.pid}  # fmt: skip
                    return process, url, found
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            process.wait(30)
            return None, url, {"error": f"infinity was not healthy within {timeout_s:g} s"}
        time.sleep(0.5)


def side_by_side(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """warmgate and its peers all up; each load point runs on warmgate, then at once on each
    peer, and the in-process ceiling is measured before each batch size's points, so all see
    the same machine. `--rounds` repeats the whole sequence."""
    server_args = [
        "--model", model, "--device", "cpu", "--sequence-buckets", args.serve_buckets,
        "--warmup-batch-sizes", "1,8,32", "--max-batch-tokens", "4096",
    ]  # fmt: skip
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(model, device="cpu")
    result: dict[str, Any] = {"warmgate": {"points": []}, "ceiling": []}

    def start_warmgate_onnxruntime(args: argparse.Namespace, model: str) -> tuple:
        started = time.monotonic()
        peer = ServerProcess([*server_args, "--backend", "onnxruntime"])
        peer.start()
        try:
            ready = peer.wait_ready(timeout=900)
        except (RuntimeError, TimeoutError) as error:
            peer.kill()
            return None, "", {"error": str(error)[-1500:]}
        return peer.process, peer.url, {
            "command": " ".join(["warmgate-server", *server_args, "--backend", "onnxruntime"]),
            "points": [], "ready_seconds": round(time.monotonic() - started, 1),
            "warmup_seconds": ready["warmup_seconds"], "pid": peer.pid,
            "export_seconds": ready["forward"]["onnxruntime"]["export_seconds"],
        }  # fmt: skip

    starters = {"infinity": start_infinity, "infinity_onnx": start_infinity_onnx,
                "warmgate_onnxruntime": start_warmgate_onnxruntime}  # fmt: skip
    skipped = {"infinity": args.skip_infinity, "infinity_onnx": args.skip_infinity_onnx,
               "warmgate_onnxruntime": args.skip_warmgate_onnxruntime}  # fmt: skip
    paths = {"warmgate_onnxruntime": ("/v1/embeddings", None)}
    running: dict[str, tuple[Any, str]] = {}
    with ServerProcess(server_args) as server:
        report = server.wait_ready(timeout=900)
        result["warmgate"]["warmup_seconds"] = report["warmup_seconds"]
        try:
            for key, _ in PEERS:
                flag = "--skip-" + key.replace("_", "-")
                if skipped[key]:
                    result[key] = {"error": f"skipped ({flag})"}
                    continue
                process, url, result[key] = starters[key](args, model)
                print(key, json.dumps(result[key])[:2000], flush=True)
                if process is not None:
                    running[key] = (process, url)
            for round_number in range(1, args.rounds + 1):
                previous_batch = None
                for concurrency, size in args.load_points:
                    batch = batch_of(size)
                    if size != previous_batch:
                        ceiling = sentence_transformers_ceiling(args, encoder)
                        ceiling["load_average"] = os.getloadavg()[0]
                        ceiling["round"] = round_number
                        result["ceiling"].append(ceiling)
                        print(json.dumps(ceiling), flush=True)
                        previous_batch = size
                    point = asyncio.run(closed_loop(server.url, concurrency, batch, args.seconds))
                    point.update(round=round_number, load_average=round(os.getloadavg()[0], 1))
                    result["warmgate"]["points"].append(point)
                    print("warmgate", json.dumps(point), flush=True)
                    for key, (_, url) in running.items():
                        path, name = paths.get(key, ("/embeddings", "minilm"))
                        point = asyncio.run(
                            closed_loop(url, concurrency, batch, args.seconds, path, name)
                        )
                        point.update(round=round_number, load_average=round(os.getloadavg()[0], 1))
                        result[key]["points"].append(point)
                        print(key, json.dumps(point), flush=True)
        finally:
            for process, _ in running.values():
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
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
        "Measured fp32 matmul (1024x1024, the faster of MKL and oneDNN): "
        f"{peak['server_threads']:.1f} GFLOP/s with one "
        f"model worker's {info['server_torch_threads']} torch thread(s), "
        f"{peak['all_threads']:.1f} GFLOP/s with all CPUs at the start and "
        f"{result['matmul_gflops_after']:.1f} at the end.",
        "warmgate ran at its defaults on this machine: "
        f"{info.get('server_workers', '?')} model workers x {info['server_torch_threads']} torch "
        "thread(s), the padding-free (packed) forward pass; Infinity at its defaults too "
        "(torch engine; ONNX Runtime engine with `--engine optimum --device cpu "
        "--pooling-method mean` on the model folder's ONNX export, bench/server/onnx_export.py).",
        f"Load average at the end: {', '.join(f'{v:.1f}' for v in result['load_average_at_end'])}.",
        "",
        "### Cold versus warm (first request of each planned shape right after /ready)",
        "",
    ]
    if not result["cold_versus_warm"]:
        lines += ["Not measured in this run (`--skip-cold`).", ""]
    else:
        lines += [
            "Each case ran in several fresh server processes; per shape, `first_ms`, `steady_ms` "
            "and `ratio` are medians over the processes, `worst_ratio` the worst single process, "
            "and `first_cold_header` has one `X-Warmgate-Cold` value per process.",
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
        f"Each load point ran for {result['seconds']:g} s on warmgate, then at once on each "
        "peer (all servers up, the idle ones cost nothing), "
        f"{result['rounds']} round(s) of the whole set (`round`); sentence-transformers' "
        "in-process encode, the ceiling, was measured just before each batch size's points (the "
        "best measurement is used below). `load_average` is the machine's 1-minute load when the "
        "point ended: other engineers' builds and tests shared these CPUs.",
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
    lines += [
        f"warmgate (ready after {result['warmgate'].get('warmup_seconds')} s of warmup):",
        "",
        markdown_table(result["warmgate"]["points"], POINT_COLUMNS),
        "",
    ]
    for key, label in PEERS:
        peer = result.get(key, {"error": "not run"})
        if "error" in peer:
            lines += [f"{label}: not measured: `{peer['error'][:800]}`", ""]
        else:
            lines += [
                f"{label}, healthy {peer['ready_seconds']} s after start (`{peer['command']}`):",
                "",
                markdown_table(peer["points"], POINT_COLUMNS),
                "",
            ]
    lines += ["### Against the targets and the matmul peak", ""]
    lines += [f"- {line}" for line in result["verdicts"]]
    return "\n".join(lines)


def by_point(points: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """(concurrency, batch) -> the median over rounds of p50_ms and inputs_per_s."""
    grouped: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for point in points:
        grouped.setdefault((point["concurrency"], point["batch"]), []).append(point)
    return {
        key: {
            "concurrency": key[0],
            "batch": key[1],
            "rounds": len(rows),
            "p50_ms": round(statistics.median(row["p50_ms"] for row in rows), 2),
            "inputs_per_s": round(statistics.median(row["inputs_per_s"] for row in rows), 1),
        }
        for key, rows in grouped.items()
    }


def against_onnx(result: dict[str, Any]) -> list[str]:
    """Issue 27's targets against Infinity with ONNX Runtime (medians over the rounds): p50 of
    one sentence at concurrency 1 <= 0.8x its; inputs/s of batches of 32 at concurrency 8 and
    of single sentences at concurrency 32 >= 1.3x its."""
    peer = result.get("infinity_onnx", {})
    if "points" not in peer:
        return [f"issue 27's targets against Infinity+ONNX Runtime: not measured "
                f"({peer.get('error', 'not run')[:200]})"]  # fmt: skip
    ours, theirs = by_point(result["warmgate"]["points"]), by_point(peer["points"])
    out = []
    targets = (((1, 1), "p50_ms", "p50 of one sentence at concurrency 1", "<=", 0.8),
               ((8, 32), "inputs_per_s", "inputs/s, batches of 32 at concurrency 8", ">=", 1.3),
               ((32, 1), "inputs_per_s", "inputs/s, single sentences at concurrency 32", ">=",
                1.3))  # fmt: skip
    for key, field, what, sense, target in targets:
        mine, other = ours.get(key), theirs.get(key)
        if not mine or not other or not other[field]:
            out.append(f"against Infinity+ONNX Runtime, {what}: not measured (point not run)")
            continue
        ratio = mine[field] / other[field]
        met = ratio <= target if sense == "<=" else ratio >= target
        unit = " ms" if field == "p50_ms" else ""
        out.append(
            f"against Infinity+ONNX Runtime, {what}: {mine[field]}{unit} vs {other[field]}{unit} "
            f"= **{ratio:.2f}x** (issue 27's target {sense} {target}x: "
            f"{'met' if met else 'not met'}; medians of {mine['rounds']} round(s))"
        )
    return out


def backend_choice(result: dict[str, Any]) -> list[str]:
    """runtime.backend's default: warmgate's torch pass against its ONNX Runtime backend at
    every load point (medians over the rounds), and their times to /ready."""
    peer = result.get("warmgate_onnxruntime", {})
    if "points" not in peer:
        return [f"runtime.backend: onnxruntime not measured ({peer.get('error', 'not run')[:200]})"]
    ours, theirs = by_point(result["warmgate"]["points"]), by_point(peer["points"])
    out = []
    for key in sorted(ours):
        mine, other = ours[key], theirs.get(key)
        if not other or not other["inputs_per_s"] or not other["p50_ms"]:
            continue
        out.append(
            f"runtime.backend torch / onnxruntime at concurrency {key[0]}, batches of {key[1]}: "
            f"inputs/s {mine['inputs_per_s']} / {other['inputs_per_s']} = "
            f"**{mine['inputs_per_s'] / other['inputs_per_s']:.2f}x**, p50 {mine['p50_ms']} / "
            f"{other['p50_ms']} ms = {mine['p50_ms'] / other['p50_ms']:.2f}x"
        )
    out.append(
        f"warmup: torch {result['warmgate'].get('warmup_seconds')} s, onnxruntime "
        f"{peer['warmup_seconds']} s (of which {peer['export_seconds']} s exporting the model "
        "and opening its sessions)"
    )
    return out


def verdicts(result: dict[str, Any]) -> list[str]:
    out = []
    ceiling = result["sentence_transformers"]
    points = by_point(result["warmgate"]["points"])
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
            peer = by_point(infinity["points"]).get((32, 32))
            if peer and peer["inputs_per_s"]:
                out.append(
                    f"against Infinity at concurrency 32 (batches of 32): "
                    f"{c32['inputs_per_s'] / peer['inputs_per_s']:.2f}x (target >= 1.2x)"
                )
    out += against_onnx(result)
    out += backend_choice(result)
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
    result["load_points"] = [list(point) for point in args.load_points]
    result["rounds"], result["seconds"] = args.rounds, args.seconds
    result["cold_versus_warm"] = [] if args.skip_cold else cold_versus_warm(args, model)
    side = side_by_side(args, model)
    result["warmgate"] = side["warmgate"]
    for key, _ in PEERS:
        result[key] = side[key]
    result["ceilings"] = side["ceiling"]
    result["sentence_transformers"] = {
        "torch_threads": side["ceiling"][0]["torch_threads"],
        "single_p50_ms": min(c["single_p50_ms"] for c in side["ceiling"]),
        "batched_inputs_per_s": max(c["batched_inputs_per_s"] for c in side["ceiling"]),
        "mean_tokens_per_input": side["ceiling"][0]["mean_tokens_per_input"],
    }
    result["matmul_gflops_after"] = matmul_gflops(usable_cpus())
    result["load_average_at_end"] = os.getloadavg()
    result["verdicts"] = verdicts(result)
    (out / "bench_server.json").write_text(json.dumps(result, indent=2))
    write_doc(Path(args.doc), render(result))
    print("\n".join(result["verdicts"]))
    return 0


if __name__ == "__main__":
    if shutil.which("lscpu") is None:
        print("lscpu not found", file=sys.stderr)
    sys.exit(main())
