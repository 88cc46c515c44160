"""What the server tests share: a small warmup plan, a quick settle rule, a config builder, and
a ready app for fixtures that outlive one test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from warmgate_server.app import create_app
from warmgate_server.config import ServerConfig, parse_config
from warmgate_server.loading import LoadedModel
from warmgate_server.settle import SettleRule
from warmgate_testkit.process import wait_for_phase

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


async def until_ready(client: TestClient) -> None:
    report = await wait_for_phase(client, {"ready", "failed"})
    assert report["phase"] == "ready", report


@asynccontextmanager
async def serving(config: ServerConfig, preloaded: LoadedModel) -> AsyncIterator[TestClient]:
    """An app of `config` on the shared model, warmed and ready, on a test server of its own:
    for a fixture that a whole module shares (pytest-aiohttp's aiohttp_client lives for one
    test)."""
    app = create_app(config, preloaded=preloaded, settle_rule=QUICK_SETTLE)
    async with TestClient(TestServer(app)) as client:
        await until_ready(client)
        yield client


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


def padded_batch(token_lists, rows: int, seq_len: int, pad: int = 0, filler: int | None = None):
    """A (rows, seq_len) batch of token ids and its 0/1 attention mask, as the static pass
    takes it; rows past the inputs get one `filler` token each (padding rows) when given."""
    import torch

    ids = torch.full((rows, seq_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    if filler is not None:
        ids[len(token_lists) :, 0] = filler
        mask[len(token_lists) :, 0] = 1
    return ids, mask
