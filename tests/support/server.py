"""What the server tests share: a small warmup plan, a quick settle rule, a config builder."""

from __future__ import annotations

from pathlib import Path

from warmgate_server.config import ServerConfig, parse_config
from warmgate_server.warmup import SettleRule

# A small plan keeps warmup short on a slow CI machine while still covering two buckets and
# batch-size padding.
SMALL_PLAN = ["--sequence-buckets", "16,32,64", "--warmup-batch-sizes", "1,4"]
# Warmup in tests only needs every shape to have run; settling is tested on its own.
QUICK_SETTLE = SettleRule(window=2, tolerance=1.0, max_runs=3, max_seconds=2.0)


def make_config(model_dir: Path, *args: str) -> ServerConfig:
    return parse_config(
        ["--model", str(model_dir), "--served-model-name", "all-MiniLM-L6-v2", *SMALL_PLAN, *args],
        environ={},
    )


def pooled(packed, batch, seq_len: int, rows: int, pooling: str):
    """The padding-free pass's vectors of `batch`, pooled with `pooling` ("none": every real
    token's state): what the runner computes with head.py."""
    from warmgate_server.head import Head

    states, starts, lengths = packed.encode(batch, seq_len, rows)
    if pooling == "none":
        return states.float()
    return Head((pooling,), (), packed.hidden, packed.device).packed(states, starts, lengths)


def dense_pooled(packed, ids, mask, pooling: str):
    """The static (graph) pass's vectors of a padded batch, pooled with `pooling`."""
    from warmgate_server.head import Head

    head = Head((pooling,), (), packed.hidden, packed.device)
    return head.padded(packed.dense(ids, mask), mask)
