"""One batch through warmgate's packed encoder and through transformers' own model, in process,
on one torch thread, side by side (what docs/benchmarks.md's re-rank section found: the linear
kernel `--linear auto` picks for large passes).

    .venv/bin/python bench/server/packed_vs_transformers.py FOLDER [--rows 32] [--tokens 119]
        [--linear auto|onednn|mkl] [--repeats 3]

FOLDER: a BERT-family model folder (bench_rerank.build's re-rankers, zoo.shaped's XLM-Rs).
Every input has `--tokens` tokens (no padding), so the two passes do the same work.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=119)
    parser.add_argument("--linear", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    from warmgate_server.models import packed_pass

    torch.set_num_threads(1)
    config = json.loads((args.folder / "config.json").read_text())
    encoder = packed_pass(
        args.folder,
        torch.float32,
        "cpu",
        config["model_type"],
        args.linear,
        largest_rows=args.rows * args.tokens,  # as the server's plan would allow
    )
    print("linear kernels:", json.dumps(encoder.kernels.as_json()))
    model = AutoModel.from_pretrained(str(args.folder)).eval()
    first, last = (0, 2) if config["model_type"] != "bert" else (101, 102)
    batch = [
        [first, *[6 + (i * 7 + row) % 200 for i in range(args.tokens - 2)], last]
        for row in range(args.rows)
    ]
    ids = torch.tensor(batch)
    with torch.inference_mode():
        for _ in range(args.repeats):
            started = time.perf_counter()
            encoder.encode(batch, args.tokens, args.rows)
            packed = time.perf_counter() - started
            started = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            padded = time.perf_counter() - started
            print(
                f"{args.rows} x {args.tokens}, --linear {args.linear}: packed "
                f"{packed * 1000:.0f} ms, transformers {padded * 1000:.0f} ms"
            )


if __name__ == "__main__":
    main()
