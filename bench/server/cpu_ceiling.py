"""What this CPU can do at fp32 for an encoder of multilingual-e5-base's shape: the linear
layers' matrix multiplications (almost all of the work) at their real sizes, one thread per
core, through torch's default (MKL) and through oneDNN on reordered weights (warmgate's packed
pass on the CPU), and the inputs/s those rates allow for the bench's sentences.

`python bench/server/cpu_ceiling.py` (about 30 s once bench_models.py has built its model). A
server cannot serve faster than the ceiling it prints; bench_models.py's figures are read
against it in docs/benchmarks.md.

`--lone 34,42,64` adds what bounds one input served alone (the p50 at one client): the twelve
layers' linear layers, each layer its own weights (340 MB, streamed as a real pass streams
them), through oneDNN on reordered weights on both threads, for one input of each token count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INNER, LAYERS = 768, 3072, 12
# (in, out) of a layer's linear layers: fused query/key/value, attention output, two dense.
LINEARS = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, INNER), (INNER, HIDDEN)]


def best_seconds(function, runs: int = 7) -> float:
    function()
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def bench_tokens() -> list[int]:
    """The token counts of bench_models.py's sentences with its model's tokenizer."""
    from bench_models import SENTENCES, build

    from warmgate_server.tokenizer import load_fast

    return [len(ids) for ids in load_fast(build("e5-base"))(SENTENCES)["input_ids"]]


def ceiling(lengths: list[int]) -> dict[str, object]:
    """GFLOP/s and the inputs/s they allow, per backend and thread count, for inputs of these
    token counts (the batch: 32 of them, in turn)."""
    tokens_per_input = sum(lengths) / len(lengths)
    batch_tokens = sum(lengths[index % len(lengths)] for index in range(32))
    flop_per_token = sum(2 * k * n for k, n in LINEARS) * LAYERS
    result: dict[str, object] = {
        "mflop_per_token": round(flop_per_token / 1e6, 1),
        "tokens_per_input": round(tokens_per_input, 1),
    }
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for backend in ("mkl", "onednn"):
            seconds = 0.0
            for k, n in LINEARS:
                x, w, b = torch.randn(batch_tokens, k), torch.randn(n, k), torch.randn(n)
                if backend == "mkl":
                    seconds += best_seconds(lambda x=x, w=w, b=b: F.linear(x, w, b))
                else:
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                    seconds += best_seconds(
                        lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(
                            x, p, b, "none", [], ""
                        )
                    )
            gflops = batch_tokens * flop_per_token / LAYERS / seconds / 1e9
            inputs = gflops * 1e9 / (flop_per_token * tokens_per_input)
            result[f"{backend}_{threads}_threads"] = {
                "gflop_per_s": round(gflops, 1),
                "inputs_per_s_ceiling": round(inputs, 1),
            }
    torch.set_num_threads(1)
    return result


def lone(token_counts: list[int], threads: int = 2, runs: int = 9) -> dict[str, object]:
    """ms (a median, the token counts interleaved run by run) of one input's linear layers
    through all the layers, and the GFLOP/s that is."""
    torch.set_num_threads(threads)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    call = torch.ops.mkldnn._linear_pointwise
    layers = [
        [(reorder(torch.randn(n, k) * 0.02, None), torch.zeros(n)) for k, n in LINEARS]
        for _ in range(LAYERS)
    ]

    def one_pass(tokens: int) -> None:
        x = torch.randn(tokens, HIDDEN)
        for (qkv, qkv_b), (out, out_b), (inner, inner_b), (output, output_b) in layers:
            attended = call(x, qkv, qkv_b, "none", [], "")[:, :HIDDEN].contiguous()
            projected = call(attended, out, out_b, "none", [], "")
            hidden = call(projected, inner, inner_b, "gelu", [], "none")
            x = call(hidden, output, output_b, "none", [], "")

    samples: dict[int, list[float]] = {tokens: [] for tokens in token_counts}
    with torch.inference_mode():
        for tokens in token_counts:
            one_pass(tokens)
        for _ in range(runs):
            for tokens in token_counts:
                started = time.perf_counter()
                one_pass(tokens)
                samples[tokens].append(time.perf_counter() - started)
    flop_per_token = sum(2 * k * n for k, n in LINEARS) * LAYERS
    torch.set_num_threads(1)
    result: dict[str, object] = {}
    for tokens, seconds in samples.items():
        median = statistics.median(seconds)
        result[f"{tokens}_tokens"] = {
            "ms": round(median * 1000, 2),
            "gflop_per_s": round(tokens * flop_per_token / median / 1e9, 1),
        }
    return {f"lone_input_onednn_{threads}_threads": result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lone",
        default="",
        help="token counts (comma-separated) of one input served alone: its linear layers' time",
    )
    args = parser.parse_args()
    report = ceiling(bench_tokens())
    if args.lone:
        report.update(lone([int(count) for count in args.lone.split(",")]))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
