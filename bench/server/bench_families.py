"""The packed pass against transformers' own forward pass, per family, at real sizes (`make bench-
families`): what a family gains when it moves from the padded path to the padding-free one
(DistilBERT and MPNet did, then Qwen3 and EmbeddingGemma).

No hub is reachable, so each model is made here at its popular checkpoint's real shape with
random fp32 weights and the zoo's tokenizer of that family (testkit/warmgate_testkit/zoo.py):
BERT as all-MiniLM-L6-v2 (6 layers, 384 wide), DistilBERT as msmarco-distilbert-base-v4 (6
layers, 768 wide), MPNet as all-mpnet-base-v2 (12 layers, 768 wide, relative position bias),
Qwen3 as Qwen3-Embedding-0.6B's layers (1024 wide, 16 query and 8 key/value heads, causal; 4 of
its 28 layers, so that a padded pass of 32 long inputs takes seconds, not half a minute: both
passes' times grow with the layer count), Gemma 3 as embeddinggemma-300m (24 layers, 768 wide, 3
query heads and 1 key/value head of 256, both ways, every sixth layer full and the others in a
512-token window). Both passes run in this process on one thread, as one of the server's two CPU
model workers does, at the shapes the server gives them: the padded pass at the planned (rows,
bucket) shape, the packed pass on the same inputs' real tokens. Each point alternates the two
passes and keeps the median of each; the pooled vectors of both are compared (cosine).

Points: one sentence (p50 of a lone request's forward pass), 8 sentences of mixed length in the
32 bucket, 32 in the 64 bucket, 32 in the 128 bucket (the texts repeated to fill it).

Writes bench/results/bench_families.json and the families section of docs/benchmarks.md. Not a
timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from bench_server import REPO, machine, write_doc

from warmgate_server.models import packed_pass
from warmgate_server.models.bert import PackedBert
from warmgate_server.models.decoder import PackedDecoder
from warmgate_testkit import zoo

BEGIN, END = "<!-- family-benchmarks:begin -->", "<!-- family-benchmarks:end -->"
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "bert (all-MiniLM-L6-v2)": (
        "bert-mean",
        {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 12,
         "intermediate_size": 1536, "max_position_embeddings": 512},
    ),
    "distilbert (msmarco-distilbert-base-v4)": (
        "distilbert",
        {"n_layers": 6, "dim": 768, "n_heads": 12, "hidden_dim": 3072,
         "max_position_embeddings": 512},
    ),
    "mpnet (all-mpnet-base-v2)": (
        "mpnet",
        {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
         "intermediate_size": 3072, "max_position_embeddings": 514, "layer_norm_eps": 1e-5},
    ),
    "qwen3 (Qwen3-Embedding-0.6B, 4 of its 28 layers)": (
        "qwen3",
        {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    "gemma3 (embeddinggemma-300m)": (
        "gemma3-dense",
        {"num_hidden_layers": 24, "hidden_size": 768, "num_attention_heads": 3,
         "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 1152,
         "max_position_embeddings": 2048, "sliding_window": 512, "query_pre_attn_scalar": 256,
         "use_bidirectional_attention": True, "rms_norm_eps": 1e-6},
    ),
}  # fmt: skip
SENTENCES = [
    "A man is eating food.",
    "How do readiness gates keep a pod out of a Service until it is warm?",
    "The first request of a cold process pays for lazy initialisation and kernel selection.",
    "Embeddings for search",
    "Kubernetes rolls a Deployment out one pod at a time when maxUnavailable is zero.",
    "What is the capital of France?",
    "A cat sits on the mat, looking at the birds outside the window.",
    "Dynamic batching groups requests by length so that padding stays small.",
]
# (label, inputs, bucket): the server pads the padded pass to (rows, bucket).
POINTS = [("1 sentence", 1, 32), ("8 mixed", 8, 32), ("32 mixed", 32, 64), ("32 long", 32, 128)]


def build(family: str, shape: dict[str, Any], root: Path) -> Path:
    """A transformers folder of `family`'s architecture at `shape`, random weights."""
    import transformers

    folder = root / family
    if (folder / "config.json").is_file():
        return folder
    spec = zoo.FAMILIES[family]
    tokenizer = spec.tokenizer()
    config = type(spec.config(tokenizer))(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **shape
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def inputs(tokenizer: Any, count: int, bucket: int) -> list[list[int]]:
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(count)]
    if bucket >= 128:
        texts = [" ".join([text] * 6) for text in texts]
    ids = tokenizer(texts)["input_ids"]
    return [row[:bucket] for row in ids]


def padded(batch: list[list[int]], bucket: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(batch), bucket), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), bucket), dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return ids, mask


def mean_pool(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(states.dtype)
    return (states * weights).sum(1) / weights.sum(1)


def time_point(
    model: Any,
    packed: PackedBert | PackedDecoder,
    batch: list[list[int]],
    bucket: int,
    pad: int,
    rounds: int,
    seconds: float,
    token_types: bool,
) -> dict[str, Any]:
    """Both passes on `batch`, alternating: their median milliseconds and the pooled vectors'
    smallest cosine."""
    ids, mask = padded(batch, bucket, pad)
    extra = {"token_type_ids": torch.zeros_like(ids)} if token_types else {}

    def run_padded() -> torch.Tensor:
        states = model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
        return mean_pool(states, mask)

    def run_packed() -> torch.Tensor:
        states, starts, lengths = packed.encode(batch, bucket, len(batch))
        rows = zip(starts, lengths, strict=True)
        return torch.stack([states[start : start + n].mean(0) for start, n in rows])

    times: dict[str, list[float]] = {"padded": [], "packed": []}
    with torch.inference_mode():
        cosine = torch.nn.functional.cosine_similarity(run_padded(), run_packed()).min()
        for _ in range(3):  # warm both
            run_padded()
            run_packed()
        for _round in range(rounds):
            for name, run in (("padded", run_padded), ("packed", run_packed)):
                deadline = time.perf_counter() + seconds / 2
                while time.perf_counter() < deadline:
                    started = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - started) * 1000)
    padded_ms, packed_ms = (statistics.median(times[k]) for k in ("padded", "packed"))
    return {
        "inputs": len(batch),
        "bucket": bucket,
        "real_tokens": sum(map(len, batch)),
        "padded_ms": round(padded_ms, 2),
        "packed_ms": round(packed_ms, 2),
        "speedup": round(padded_ms / packed_ms, 2),
        "runs": {k: len(v) for k, v in times.items()},
        "min_cosine": round(float(cosine), 7),
    }


def measure(folder: Path, family: str, rounds: int, seconds: float) -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    packed = packed_pass(folder, torch.float32, "cpu", model_type)
    token_types = "token_type_ids" in tokenizer.model_input_names
    result: dict[str, Any] = {}
    for label, count, bucket in POINTS:
        batch = inputs(tokenizer, count, bucket)
        result[label] = time_point(
            model, packed, batch, bucket, tokenizer.pad_token_id, rounds, seconds, token_types
        )
        print(family, label, result[label], flush=True)
    return result


def render(result: dict[str, Any]) -> str:
    info = result["machine"]
    load = ", ".join(f"{value:.1f}" for value in info["load_average"])
    lines = [
        "## Families: the packed pass against transformers' (CPU)",
        "",
        f"Run {result['when']} with `make bench-families` (bench/server/bench_families.py) on "
        f"{info.get('Model name')}, {info.get('CPU(s)')} CPUs, torch {info['torch']}, load "
        f"average at start {load}: the packed pass against transformers' padded forward pass "
        "in one process on one thread (one CPU model worker's), random fp32 weights at each "
        "family's real shape, the padded pass at the planned (rows, bucket) shape, medians of "
        "alternating runs.",
        "",
        "| family | point | real tokens / padded | transformers ms | packed ms | speed-up |"
        " min cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, points in result["families"].items():
        for label, point in points.items():
            lines.append(
                f"| {name} | {label} | {point['real_tokens']} / "
                f"{point['inputs'] * point['bucket']} | {point['padded_ms']} | "
                f"{point['packed_ms']} | {point['speedup']}x | {point['min_cosine']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="per pass per round")
    parser.add_argument("--only", default="", help="comma-separated zoo family names")
    parser.add_argument(
        "--models", type=Path, default=Path("~/.cache/warmgate/bench-families").expanduser()
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wanted = {name for name in args.only.split(",") if name}
    result: dict[str, Any] = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "families": {},
    }
    for name, (family, shape) in SHAPES.items():
        if wanted and family not in wanted:
            continue
        folder = build(family, shape, args.models)
        result["families"][name] = measure(folder, family, args.rounds, args.seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_families.json").write_text(json.dumps(result, indent=2))
    text = render(result)
    print(text)
    if not args.no_doc:
        write_doc(Path(args.doc), text, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
