"""Memory: what the process may use, what it uses, its peak while a shape warms, and the peak a
shape will reach, predicted from the shapes warmed before it.

On a CPU the limit is the container's cgroup limit (v1 or v2) and the measure the process's
resident memory (VmRSS; its peak VmHWM, set back to the current size before each shape through
/proc/self/clear_refs): going past the limit is a kill by the kernel, which nothing can catch.
On a GPU the limit is the device's memory and the measure the CUDA caching allocator's reserved
memory; an allocation past it raises, and warming.py turns that into a refusal or a cut too.

Warmup (warming.py) warms the plan from the smallest shape up and starts no shape predicted to go
past the budget (the limit less contract.report.MEMORY_MARGIN): so a plan too big for its pod
stops, with numbers, before the shape that would have killed it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from warmgate_contract.shapes import Shape

log = logging.getLogger(__name__)

GROWTH_SAFETY = 1.25
"""How much more than the straight-line extrapolation a shape's growth is predicted at: peaks
grow less than linearly with the tokens of a batch on a CPU (measured for MiniLM: docs/server.md),
so the prediction errs high; this covers shapes of equal tokens whose batch makes them larger."""

_UNLIMITED = 1 << 60
"""cgroup v1 writes a huge number (about 2^63) for no limit."""


@dataclass(frozen=True)
class Limit:
    bytes: int | None
    source: str


class Probe(Protocol):
    device: str
    measure: str

    def limit(self) -> Limit: ...
    def current(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...
    def container(self) -> tuple[int | None, int | None]:
        """The container's own count now and at its peak (page cache included), where there
        is one."""
        ...

    def device_details(self) -> dict[str, int] | None:
        """A GPU's own figures: the allocator's allocated peak, the device's free and total
        memory."""
        ...


# ------------------------------------------------------------------------------ the CPU
def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v1 memory controller path, v2 unified path) of this process, from /proc/self/cgroup."""
    v1 = v2 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        number, controllers, path = [*line.split(":", 2), "", ""][:3]
        if number == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Cgroup:
    """The memory files of the cgroup this process is in. A container sees its own cgroup at
    the root of its mount; a process on a host, at its path under the root."""

    folder: Path
    version: int

    @classmethod
    def find(
        cls,
        root: Path = Path("/sys/fs/cgroup"),
        proc_cgroup: Path = Path("/proc/self/cgroup"),
    ) -> Cgroup | None:
        v1, v2 = _cgroup_paths(proc_cgroup)
        candidates: list[tuple[Path, int]] = []
        if v1 is not None:
            base = root / "memory"
            candidates += [(base / v1.lstrip("/"), 1), (base, 1)]
        if v2 is not None:
            candidates += [(root / v2.lstrip("/"), 2), (root, 2)]
        for folder, version in candidates:
            name = "memory.limit_in_bytes" if version == 1 else "memory.max"
            if (folder / name).is_file():
                return cls(folder, version)
        return None

    def _value(self, v1: str, v2: str) -> int | None:
        return _read_int(self.folder / (v1 if self.version == 1 else v2))

    def limit(self) -> Limit:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        value = self._value("memory.limit_in_bytes", "memory.max")
        if value is None or value >= _UNLIMITED:
            return Limit(None, f"cgroup v{self.version} {name}: no limit")
        return Limit(value, f"cgroup v{self.version} {name}")

    def usage(self) -> int | None:
        return self._value("memory.usage_in_bytes", "memory.current")

    def peak(self) -> int | None:
        return self._value("memory.max_usage_in_bytes", "memory.peak")


def _status(key: str, path: Path = Path("/proc/self/status")) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise LookupError(f"{key} not in {path}")


class ProcessProbe:
    """This process's resident memory against its container's limit."""

    device = "cpu"
    measure = "process resident memory (VmRSS; peaks from VmHWM)"

    def __init__(self, cgroup: Cgroup | None = None) -> None:
        self.cgroup = cgroup if cgroup is not None else Cgroup.find()
        self._resettable = True

    def limit(self) -> Limit:
        if self.cgroup is None:
            return Limit(None, "no memory cgroup found")
        return self.cgroup.limit()

    def current(self) -> int:
        return _status("VmRSS:")

    def reset_peak(self) -> None:
        """Set VmHWM back to the current size (Linux's clear_refs 5), so the next peak read is
        the next shape's; where that is refused, peaks are the process's so far."""
        if not self._resettable:
            return
        try:
            with open(f"/proc/{os.getpid()}/clear_refs", "w") as handle:
                handle.write("5")
        except OSError as error:
            self._resettable = False
            log.info("peaks are the process's so far: clear_refs refused (%s)", error)

    def peak(self) -> int:
        return _status("VmHWM:")

    def container(self) -> tuple[int | None, int | None]:
        if self.cgroup is None:
            return None, None
        return self.cgroup.usage(), self.cgroup.peak()

    def device_details(self) -> dict[str, int] | None:
        return None


# ------------------------------------------------------------------------------ a GPU
class CudaProbe:
    """The CUDA caching allocator's reserved memory against the device's memory."""

    measure = "CUDA caching allocator reserved memory"

    def __init__(self, device: object) -> None:
        import torch

        self._torch = torch
        self._device = device
        self.device = str(device)

    def limit(self) -> Limit:
        _, total = self._torch.cuda.mem_get_info(self._device)
        return Limit(int(total), "the device's memory (cudaMemGetInfo)")

    def current(self) -> int:
        return int(self._torch.cuda.memory_reserved(self._device))

    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self._device)

    def peak(self) -> int:
        return int(self._torch.cuda.max_memory_reserved(self._device))

    def container(self) -> tuple[int | None, int | None]:
        return None, None

    def device_details(self) -> dict[str, int] | None:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return {
            "allocated_peak_bytes": int(self._torch.cuda.max_memory_allocated(self._device)),
            "free_bytes": int(free),
            "total_bytes": int(total),
        }


def probe_for(device: object) -> Probe:
    kind = getattr(device, "type", str(device))
    return CudaProbe(device) if kind == "cuda" else ProcessProbe()


# ------------------------------------------------------------------------------ prediction
def warm_order(plan: Sequence[Shape]) -> list[Shape]:
    """Smallest first (by tokens; of equal tokens, the bigger batch first, which measured
    larger): each shape is then predicted from smaller ones, and the first that would not fit
    stops the warmup before it runs."""
    return sorted(plan, key=lambda shape: (shape.tokens, -shape.batch_size))


def predict(measured: Sequence[tuple[Shape, int]], shape: Shape) -> int | None:
    """The peak `shape` will reach, from the (shape, peak) pairs measured so far: the straight
    line through the largest peaks of the two largest token counts, its growth times
    GROWTH_SAFETY, never below the largest peak seen. None before two token counts are known
    (the first shapes are the plan's smallest)."""
    by_tokens: dict[int, int] = {}
    for done, peak in measured:
        by_tokens[done.tokens] = max(peak, by_tokens.get(done.tokens, 0))
    if len(by_tokens) < 2:
        return None
    (low, low_peak), (high, high_peak) = sorted(by_tokens.items())[-2:]
    slope = max(0.0, (high_peak - low_peak) / (high - low))
    grown = slope * max(0, shape.tokens - high) * GROWTH_SAFETY
    return int(max(max(by_tokens.values()), high_peak + grown))


# ------------------------------------------------------------------------------ before loading
RUNTIME_FILE = Path(os.environ.get("WARMGATE_RUNTIME_MEMORY", "/opt/warmgate/runtime-memory.json"))
"""Written when the image is built (server/Dockerfile): what importing this image's torch and
the server takes, measured there; read at start, before loading, so that a limit below what
loading needs is told at once instead of being an OOM kill in a loop."""


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


if __name__ == "__main__":  # python -m warmgate_server.memory FILE (the image's build)
    print(record_runtime(Path(sys.argv[1])))
