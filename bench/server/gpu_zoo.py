"""Every zoo family on a GPU: the forward pass it takes, whether its planned shapes became CUDA
graphs (or why not), and its vectors against sentence-transformers (docs/models.md's GPU
column; issue 22).

For each family (testkit/warmgate_testkit/zoo.py, the layout sentence-transformers writes today) and
dtype, one `python -m warmgate_server --device cuda --cuda-graphs auto` process on a small
plan: /ready's forward report, then the zoo's texts (English, Korean, Japanese, emoji, mixed,
long) on /embed, compared with `SentenceTransformer(folder).encode` on the CPU at float32.
Writes gpu_zoo.json and gpu_zoo.md to --out. Bounded: no new server after --budget-seconds.

    OUT=/tmp/out bash bench/server/gpu_zoo.sh
    python3 bench/server/gpu_zoo.py --device cpu --dtypes float32 --families bert-mean  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from warmgate_server.loading import NO_FLOAT16
from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

# The families most users run first: a budget cut leaves out the rarest.
ORDER = ["xlm-roberta-cls", "xlm-roberta-mean", "bert-mean", "bert-cls-prompt", "qwen3",
         "gemma3-dense", "roberta-bpe", "roberta-wordpiece", "camembert", "mpnet", "modernbert",
         "distilbert", "bert-no-prompt-pooling"]  # fmt: skip
# Half precision rounds every activation: the vectors agree to this, not to fp32's 0.9999.
MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "bfloat16": 0.99}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--families", default=",".join(ORDER))
    parser.add_argument("--budget-seconds", type=float, default=420.0)
    parser.add_argument("--zoo", default=None, help="where the zoo is built (a temporary folder)")
    return parser.parse_args()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def embed(url: str, texts: list[str]) -> np.ndarray:
    body = json.dumps({"inputs": texts}).encode()
    request = urllib.request.Request(
        url + "/embed", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return np.array(json.loads(response.read()), dtype=np.float32)


def check(folder: Path, expected: np.ndarray, device: str, dtype: str) -> dict[str, Any]:
    args = ["--model", str(folder), "--device", device, "--dtype", dtype, "--cuda-graphs", "auto",
            "--sequence-buckets", "16,32,64", "--warmup-batch-sizes", "1,8", "--auto-truncate",
            "--drain-seconds", "1"]  # fmt: skip
    started = time.monotonic()
    with ServerProcess(args) as server:
        try:
            ready = server.wait_ready(180)
        except (RuntimeError, TimeoutError) as exc:
            return {"error": str(exc)[-600:]}
        served = embed(server.url, zoo.TEXTS)
    forward = ready.get("forward", {})
    graphs = forward.get("cuda_graphs", {})
    return {
        "pass": forward.get("pass"),
        "cuda_graphs": graphs.get("mode"),
        "cuda_graphs_reason": graphs.get("reason"),
        "graphs_captured": graphs.get("captured", 0),
        "warmup_s": ready.get("warmup_seconds"),
        "ready_s": round(time.monotonic() - started, 1),
        "min_cosine": float(cosine(served, expected).min()),
        "passes": bool(cosine(served, expected).min() >= MIN_COSINE[dtype]),
    }


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.zoo or tempfile.mkdtemp(prefix="warmgate-zoo-"))
    from sentence_transformers import SentenceTransformer

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for name in args.families.split(","):
        folder = zoo.build(name, "current", root)
        reference = SentenceTransformer(str(folder), device="cpu").encode(zoo.TEXTS)
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        for dtype in args.dtypes.split(","):
            if dtype == "float16" and model_type in NO_FLOAT16:
                dtype = "bfloat16"  # the server refuses float16 for Gemma (it overflows)
            if time.monotonic() - started > args.budget_seconds:
                rows.append({"family": name, "dtype": dtype, "error": "skipped: budget spent"})
                continue
            row = {"family": name, "dtype": dtype, **check(folder, reference, args.device, dtype)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "gpu_zoo.json").write_text(json.dumps(rows, indent=2))
    columns = ["family", "dtype", "pass", "cuda_graphs", "graphs_captured", "cuda_graphs_reason",
               "min_cosine", "passes", "warmup_s", "error"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    (out / "gpu_zoo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
