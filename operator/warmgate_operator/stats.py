"""Counters for benchmarks and debugging, written as one JSON file that is replaced atomically."""

from __future__ import annotations

import asyncio
import json
import os
import resource
from pathlib import Path
from typing import Any

from warmgate_kube.client import KubeClient

from .controller import Controller


def snapshot(client: KubeClient, controller: Controller) -> dict[str, Any]:
    return {
        "requests": dict(client.requests),
        "writes": client.writes,
        "reconciles": controller.reconciles,
        "embeddingServices": len(controller.keys),
        # ru_maxrss is in KiB on Linux.
        "peakRssMiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


async def write_forever(
    path: Path, client: KubeClient, controller: Controller, interval: float = 1.0
) -> None:
    while True:
        write(path, snapshot(client, controller))
        await asyncio.sleep(interval)
