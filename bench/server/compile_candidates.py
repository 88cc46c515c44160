"""Forward passes side by side on the CPU (issue 27): warmgate's padding-free pass against what
compiling the warmed shapes could give, and against ONNX Runtime on the optimum export.

Per model, torch thread count and (rows x seq_len) shape, the same batch through:

- `packed`: `PackedBert.encode`, the padding-free pass warmgate serves (oneDNN linear layers
  on reordered weights, unless --linear mkl);
- `dense`: `PackedBert.dense`, its padded static form, eager (same instance);
- `dense-mkl`: the same, eager, on the plain instance the compiled candidates start from
  (F.linear, that is MKL), so that compiling and the matmul library are told apart;
- `compile`, `compile-autotune`, `compile-freezing`: `PackedBert.dense` of a plain instance
  (F.linear, the weights as parameters) under `torch.compile(dynamic=False, fullgraph=True)`,
  inductor on the CPU, `mode=None`, `mode="max-autotune-no-cudagraphs"`, and `mode=None` with
  `torch._inductor.config.freezing=True` under `torch.no_grad()` (weights folded as constants;
  inductor then packs fp32 linear weights for MKL, `mkl._mkl_linear`);
  `compile-freezing-autotune`: both (on a CPU, max-autotune pits inductor's C++ GEMM template
  against the ATen/MKL kernel only for frozen weights; without freezing it has ATen alone, so
  `compile-autotune` is not in the default list);
  `compile-onednn-freezing` (not in the default list): the oneDNN instance, whose
  pre-reordered weights inductor 2.15 does not lower ("expected packed_weight_node.target to be
  mkldnn._reorder_linear_weight"; without freezing, "weight must be a graph constant").
  Compiled once per shape and thread count (inductor's CPU kernels fix their thread count when
  compiled), the first call's seconds reported as compile time;
- `ort`, `ort-infinity`: ONNX Runtime sessions (CPUExecutionProvider, intra-op threads = the
  torch thread count, inter-op 1, graph optimization level ALL) on `model.onnx`, the optimum
  export, and on `model_optimized.onnx`, what Infinity's optimum engine serves (see
  onnx_export.py, which makes both in the Infinity onnx venv).

Times are wall ms per pass; each round runs every candidate in turn (the order rotating from
round to round) for `--seconds`, and the median is over all passes of all rounds. `cosine` is
each candidate's last hidden states of the real tokens against `packed`'s (flattened), with the
largest absolute difference. Inputs: random in-vocabulary token ids between the tokenizer's
CLS and SEP, every row `seq_len` tokens long (`--fill 0.5`: rows of uniformly random length
filling half the shape on average, the first full, so the shape is still the bucket).

`python bench/server/compile_candidates.py` (project venv, onnxruntime installed in it; the
onnx venv from `make bench-server-infinity-onnx` for the export). Writes
bench/results/compile_candidates.json. Compiling dominates the run: shapes x thread counts x
compiled candidates compilations (30 by default, 5 to 50 s each on a 2-core machine, the
autotuned ones the longest); `--candidates`, `--shapes` and `--threads` cut it.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
if str(REPO / "server") not in sys.path:
    sys.path.insert(1, str(REPO / "server"))

# A fresh inductor cache per run, and per compiled candidate an empty one with inductor's
# in-memory caches cleared (unless --keep-cache): compile times are a cold pod's, not helped
# by kernels an earlier candidate built. Inductor's one-time start (imports, compiler checks)
# is paid before, by a throwaway compilation (`inductor_start_s`).
if "--keep-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="warmgate-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from warmgate_server.models.bert import PackedBert  # noqa: E402
from warmgate_testkit.process import minilm_path  # noqa: E402

SHAPES = "1x16,1x32,8x32,32x32,32x128"
CANDIDATES = ["packed", "dense", "dense-mkl", "compile", "compile-freezing",
              "compile-freezing-autotune", "ort", "ort-infinity"]  # fmt: skip
COMPILED = {
    # name: (torch.compile mode, inductor freezing, warmgate's oneDNN linear layers)
    "compile": (None, False, False),
    "compile-autotune": ("max-autotune-no-cudagraphs", False, False),
    "compile-freezing": (None, True, False),
    "compile-freezing-autotune": ("max-autotune-no-cudagraphs", True, False),
    "compile-onednn-freezing": (None, True, True),
}
ALL_CANDIDATES = [*CANDIDATES, "compile-autotune", "compile-onednn-freezing"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="minilm", help="minilm,e5-base (XLM-R of its shape)")
    parser.add_argument(
        "--minilm", type=Path, default=None, help="default: the test model (minilm_path())"
    )
    parser.add_argument("--shapes", default=SHAPES, help="rows x seq_len, comma-separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"of {','.join(ALL_CANDIDATES)}")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=0.3, help="per candidate per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-passes", type=int, default=3, help="per candidate per round")
    parser.add_argument("--fill", type=float, default=1.0, help="1: full rows; <1: mixed")
    parser.add_argument("--onnx-root", type=Path, default=None,
                        help="exports in <root>/<model folder> (onnx_export.py)")  # fmt: skip
    parser.add_argument("--keep-cache", action="store_true", help="reuse inductor's disk cache")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/compile_candidates.json")
    args = parser.parse_args()
    unknown = set(args.candidates.split(",")) - set(ALL_CANDIDATES)
    if unknown:
        parser.error(f"unknown candidates {sorted(unknown)}; known: {ALL_CANDIDATES}")
    return args


def model_folder(name: str, args: argparse.Namespace) -> Path:
    if name == "minilm":
        return (args.minilm or minilm_path()).expanduser()
    if name == "e5-base":
        from bench_models import build  # builds the XLM-R of e5-base's shape once, cached

        return build("e5-base")
    raise SystemExit(f"unknown model {name!r}: minilm or e5-base")


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, seq_len = text.lower().partition("x")
    return int(rows), int(seq_len)


def make_batch(
    folder: Path, rows: int, seq_len: int, fill: float, seed: int = 0
) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    special = set(tokenizer.all_special_ids)
    generator = np.random.default_rng(seed)
    vocabulary = np.array([i for i in range(1000, tokenizer.vocab_size) if i not in special])
    batch = []
    for row in range(rows):
        length = seq_len
        if fill < 1.0 and row > 0:
            low = max(3, int(seq_len * max(0.0, 2 * fill - 1)))
            length = int(generator.integers(low, seq_len + 1))
        middle = generator.choice(vocabulary, size=length - 2).tolist()
        batch.append([cls, *middle, sep])
    return batch


def padded(batch: list[list[int]], seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(batch), seq_len), pad, dtype=np.int64)
    mask = np.zeros((len(batch), seq_len), dtype=np.int64)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    return ids, mask


def with_parameters(folder: Path, onednn: bool = False) -> PackedBert:
    """PackedBert with every weight an nn.Parameter, so that inductor's freezing folds them as
    constants; F.linear (inductor chooses the kernels), or with `onednn` warmgate's oneDNN
    linear layers on reordered weights (inductor lowers those only for constant weights)."""
    model = PackedBert.from_folder(
        folder, torch.float32, linear_kernel="onednn" if onednn else "mkl"
    )

    def parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)

    model.word = parameter(model.word)
    model.position = parameter(model.position)
    model.token_type = parameter(model.token_type)
    model.embedding_norm = tuple(map(parameter, model.embedding_norm))
    model.layers = [
        dataclasses.replace(
            layer,
            **{
                field.name: (
                    tuple(map(parameter, value))
                    if isinstance(value := getattr(layer, field.name), tuple)
                    else parameter(value)
                )
                for field in dataclasses.fields(layer)
            },
        )
        for layer in model.layers
    ]
    return model


def cosine(reference: np.ndarray, other: np.ndarray) -> dict[str, float]:
    a, b = reference.astype(np.float64).ravel(), other.astype(np.float64).ravel()
    return {
        "cosine": round(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))), 7),
        "max_abs": float(np.abs(a - b).max()),
    }


def ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def candidates_for(
    names: list[str],
    folder: Path,
    onnx_folder: Path | None,
    batch: list[list[int]],
    seq_len: int,
    threads: int,
    pad: int,
    shared: dict[str, Any],
) -> tuple[dict[str, Callable[[], Any]], dict[str, dict[str, Any]], np.ndarray]:
    """name -> a pass to time; name -> facts (compile seconds, cosine to packed); and the
    mask of real tokens."""
    rows = len(batch)
    ids_np, mask_np = padded(batch, seq_len, pad)
    real = mask_np.astype(bool)
    ids, mask = torch.from_numpy(ids_np), torch.from_numpy(mask_np)
    passes: dict[str, Callable[[], Any]] = {}
    facts: dict[str, dict[str, Any]] = {}
    model = shared.setdefault("packed", PackedBert.from_folder(folder, torch.float32))

    def packed() -> torch.Tensor:
        with torch.inference_mode():
            return model.encode(batch, seq_len, rows)[0]

    reference = packed().numpy()
    if "packed" in names:
        passes["packed"] = packed
        facts["packed"] = {"onednn": model.onednn}
    if "dense" in names:

        def dense() -> torch.Tensor:
            with torch.no_grad():
                return model.dense(ids, mask)

        passes["dense"] = dense
        facts["dense"] = cosine(reference, dense().numpy()[real])
    if "dense-mkl" in names:
        if "plain-parameters" not in shared:
            shared["plain-parameters"] = with_parameters(folder, onednn=False)
        plain = shared["plain-parameters"]

        def dense_mkl() -> torch.Tensor:
            with torch.no_grad():
                return plain.dense(ids, mask)

        passes["dense-mkl"] = dense_mkl
        facts["dense-mkl"] = cosine(reference, dense_mkl().numpy()[real])
    for name in [n for n in names if n in COMPILED]:
        mode, freezing, onednn = COMPILED[name]
        key = "onednn-parameters" if onednn else "plain-parameters"
        if key not in shared:
            shared[key] = with_parameters(folder, onednn)
        torch._dynamo.reset()
        compiled = torch.compile(shared[key].dense, mode=mode, dynamic=False, fullgraph=True)
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch._inductor.config.patch(freezing=freezing))
            if not shared.get("keep_cache"):
                stack.enter_context(torch._inductor.utils.fresh_cache())
            started = time.perf_counter()
            try:
                first = compiled(ids, mask)
            except Exception as exc:  # a candidate that does not compile is a finding
                facts[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                continue
            compile_s = time.perf_counter() - started
            again = time.perf_counter()
            compiled(ids, mask)
            second_s = time.perf_counter() - again

        def run(compiled: Callable[..., torch.Tensor] = compiled) -> torch.Tensor:
            with torch.no_grad():
                return compiled(ids, mask)

        passes[name] = run
        facts[name] = {"compile_s": round(compile_s, 2), "second_call_ms": round(second_s * 1e3, 2),
                       **cosine(reference, first.numpy()[real])}  # fmt: skip
    for name, file in (("ort", "model.onnx"), ("ort-infinity", "model_optimized.onnx")):
        if name not in names:
            continue
        if onnx_folder is None or not (onnx_folder / file).is_file():
            facts[name] = {"error": f"no {file} (onnx_export.py failed or was skipped)"}
            continue
        started = time.perf_counter()
        session = ort_session(onnx_folder / file, threads)
        wanted = {item.name for item in session.get_inputs()}
        feed = {"input_ids": ids_np, "attention_mask": mask_np,
                "token_type_ids": np.zeros_like(ids_np)}  # fmt: skip
        feed = {key: value for key, value in feed.items() if key in wanted}
        output = session.run(["last_hidden_state"], feed)[0]
        load_s = time.perf_counter() - started

        def run_ort(session: Any = session, feed: dict[str, np.ndarray] = feed) -> Any:
            return session.run(["last_hidden_state"], feed)[0]

        passes[name] = run_ort
        facts[name] = {"session_s": round(load_s, 2), **cosine(reference, output[real])}
    return passes, facts, real


def measure(
    passes: dict[str, Callable[[], Any]], seconds: float, rounds: int, min_passes: int
) -> dict[str, dict[str, Any]]:
    """Alternating rounds: each round runs every candidate for `seconds` (at least
    `min_passes`), the order rotating; two untimed passes first each time."""
    names = list(passes)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run = passes[name]
            run()
            run()
            deadline = time.perf_counter() + seconds
            count = 0
            while count < min_passes or time.perf_counter() < deadline:
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
                count += 1
    return {
        name: {
            "median_ms": round(statistics.median(values), 3),
            "min_ms": round(min(values), 3),
            "passes": len(values),
        }
        for name, values in times.items()
    }


def onnx_folder_for(folder: Path, args: argparse.Namespace, names: list[str]) -> Path | None:
    if not any(name.startswith("ort") for name in names):
        return None
    import onnx_export

    out = (args.onnx_root or onnx_export.OUT_ROOT).expanduser() / folder.name
    try:
        return onnx_export.export(folder, out)
    except (OSError, RuntimeError) as exc:
        print(f"no ONNX export for {folder}: {exc}", file=sys.stderr)
        return None


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "loadavg_at_start": load, **versions}


def main() -> int:
    args = parse_args()
    names = args.candidates.split(",")
    shapes = [parse_shape(shape) for shape in args.shapes.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    result: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {key: str(value) for key, value in vars(args).items()},
        "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "rows": [],
    }
    print(json.dumps(result["machine"]), flush=True)
    if any(name in COMPILED for name in names):
        started = time.perf_counter()
        torch.compile(lambda x: torch.nn.functional.gelu(x) + 1, dynamic=False)(torch.ones(8))
        result["inductor_start_s"] = round(time.perf_counter() - started, 2)
        print(f"inductor's one-time start: {result['inductor_start_s']} s", flush=True)
    header = f"{'model':8} {'thr':>3} {'shape':>7} {'candidate':26} {'median ms':>10} " \
             f"{'min ms':>8} {'compile s':>9} {'cosine':>10}"  # fmt: skip
    for model_name in args.models.split(","):
        folder = model_folder(model_name, args)
        onnx_folder = onnx_folder_for(folder, args, names)
        pad = int(json.loads((folder / "config.json").read_text()).get("pad_token_id", 0) or 0)
        print(header, flush=True)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            shared: dict[str, Any] = {"keep_cache": args.keep_cache}
            for rows, seq_len in shapes:
                batch = make_batch(folder, rows, seq_len, args.fill)
                passes, facts, real = candidates_for(
                    names, folder, onnx_folder, batch, seq_len, threads, pad, shared
                )
                timed = measure(passes, args.seconds, args.rounds, args.min_passes)
                for name in names:
                    row = {"model": model_name, "threads": threads, "shape": f"{rows}x{seq_len}",
                           "tokens": int(real.sum()), "candidate": name,
                           **facts.get(name, {}), **timed.get(name, {})}  # fmt: skip
                    result["rows"].append(row)
                    median = row.get("median_ms", row.get("error", "")[:40])
                    print(f"{model_name:8} {threads:>3} {row['shape']:>7} {name:26} "
                          f"{median!s:>10} {row.get('min_ms', ''):>8} "
                          f"{row.get('compile_s', ''):>9} {row.get('cosine', ''):>10}",
                          flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
