"""What this CPU can do at fp32 for an encoder of multilingual-e5-base's shape: the linear
layers' matrix multiplications (almost all of the work) at their real sizes, one thread per
core, through torch's default (MKL) and through oneDNN on reordered weights (warmgate's packed
pass on the CPU), and the inputs/s those rates allow for the bench's sentences.

`python bench/server/cpu_ceiling.py` (about 30 s once bench_models.py has built its model). A
server cannot serve faster than the ceiling it prints; bench_models.py's figures are read
against it in docs/benchmarks.md.
"""

from __future__ import annotations

import json
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


def main() -> int:
    print(json.dumps(ceiling(bench_tokens()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
