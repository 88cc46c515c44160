"""Before loading: whether the container's memory limit holds loading at all (the image's
measured runtime and the weights), told at once, before torch is imported, where it would
otherwise be an OOM kill in a loop.

`python -m warmgate_server.preflight FILE` is the image's build step that measures the runtime
(server/Dockerfile).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from warmgate_contract.flags import DEFAULTS

from .errors import MemoryExceeded
from .memory import Limit

RUNTIME_FILE = Path(DEFAULTS["runtime_memory"])
"""Written when the image is built (server/Dockerfile): what importing this image's torch and
the server takes, measured there; read at start (--runtime-memory names it), before loading,
so that a limit below what loading needs is told at once instead of being an OOM kill in a
loop."""


def _status(key: str, path: Path = Path("/proc/self/status")) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise LookupError(f"{key} not in {path}")


def record_runtime(path: Path) -> dict[str, int | str]:
    """Import what loading imports, and write the resident memory that took."""
    import tokenizers  # noqa: F401
    import torch

    from . import engine  # noqa: F401  (the server's own modules, numpy, safetensors)

    measured: dict[str, int | str] = {
        "resident_bytes": _status("VmRSS:"),
        "torch": torch.__version__,
    }
    path.write_text(json.dumps(measured, indent=2) + "\n")
    return measured


def loading_need(weights: int, runtime_file: Path = RUNTIME_FILE) -> tuple[int, str] | None:
    """(bytes, how it was reckoned) loading will take: the image's measured runtime plus the
    weights; None without a measurement (a server run outside its image)."""
    try:
        runtime = int(json.loads(runtime_file.read_text())["resident_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    explained = (
        f"importing the image's torch and server took {runtime / 2**30:.2f} GiB when it was "
        f"built, and the weights are {weights / 2**30:.2f} GiB"
    )
    return runtime + weights, explained


def check_loading_fits(limit: Limit, weights: int, runtime_file: Path = RUNTIME_FILE) -> None:
    """MemoryExceeded when the container's limit is below what loading takes (the image's
    measured runtime and the weights): said at once, before torch is imported, where it
    would otherwise be killed, restarted and killed again."""
    need = loading_need(weights, runtime_file)
    if need is None or limit.bytes is None or need[0] <= limit.bytes:
        return
    size, how = need
    raise MemoryExceeded(
        f"loading needs about {size / 2**30:.2f} GiB ({how}), above the limit of "
        f"{limit.bytes / 2**30:.2f} GiB ({limit.source}). To change it: raise "
        f"resources.limits.memory (to at least {size / 2**30 * 1.5:.2f} GiB, to warm a plan too)"
    )


if __name__ == "__main__":  # python -m warmgate_server.preflight FILE (the image's build)
    print(record_runtime(Path(sys.argv[1])))
