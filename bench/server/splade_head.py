"""SPLADE's head (server/warmgate_server/splade.py) alone, in process, on one torch thread: an
MLM head of BERT-base's size (768 wide, 30,522 ids, random weights) on random token states of a
few batch shapes; the fastest of five timed calls after one uncounted.

    .venv/bin/python bench/server/splade_head.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from warmgate_server.model_folder import SpladeSettings
from warmgate_server.splade import MlmHead, SpladeHead


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden, vocabulary = 768, 30522
    head = MlmHead(
        (torch.randn(hidden, hidden) * 0.02, torch.zeros(hidden)),
        F.gelu,
        (torch.ones(hidden), torch.zeros(hidden)),
        1e-12,
        torch.randn(vocabulary, hidden) * 0.02,
        torch.randn(vocabulary) - 3.0,
    )
    splade = SpladeHead(head, SpladeSettings("max", "relu"), torch.device("cpu"))
    rng = np.random.default_rng(0)
    for inputs, tokens in ((32, 24), (8, 128), (1, 16)):
        states = [rng.standard_normal((tokens, hidden), dtype=np.float32) for _ in range(inputs)]
        batch = [[0] * tokens] * inputs
        times = []
        for run in range(6):
            started = time.perf_counter()
            splade(states, batch)
            if run:
                times.append(time.perf_counter() - started)
        print(f"{inputs} x {tokens}: {min(times) * 1000:.0f}-{max(times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
