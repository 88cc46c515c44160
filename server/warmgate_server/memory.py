"""Memory: what the process may use, what it uses, its need while a shape warms, and the need a
shape will have, predicted from a model of the pass calibrated on the shapes warmed before it.

On a CPU the limit is the container's cgroup limit (v1 or v2). Going past it is a kill by the
kernel, which nothing can catch, but only for memory the kernel cannot reclaim: the process's
anonymous memory (there is no swap in a pod) and the file pages it keeps touching. The other
file-backed pages it maps (the CUDA libraries a CUDA build of torch maps at import and a CPU
never runs: about 350 of the 500 MiB of file pages a MiniLM server maps here) are dropped by the
kernel as the container nears its limit. So a shape's need is the anonymous memory at its peak
(resident less shared, /proc/self/statm, sampled while the shape runs) plus the model's own
mapped files and CODE_PAGES for the libraries' code. Counting resident memory instead (VmRSS)
refused plans that fit: examples/minilm.yaml's own, at 0.90 GiB "needed" of a 1 GiB limit,
where 0.5 GiB was cold file pages.
On a GPU the limit is the device's memory and the measure the CUDA caching allocator's reserved
memory; an allocation past it raises, and warming.py turns that into a refusal or a cut too.

Warmup (warming.py) warms the plan from the smallest shape up and starts no shape predicted to go
past the budget (the limit less contract.report.MEMORY_MARGIN): so a plan too big for its pod
stops, with numbers, before the shape that would have killed it. The prediction starts from the
largest need measured so far (weights, runtime, allocator and threads: measured, not modelled)
and adds what the pass model (PassModel, from config.json) says the shape's activations grow
past those of the largest shape measured, times ACTIVATION_FACTOR, plus ACTIVATION_SLACK for
the allocator's steps; it never fits a line through the measured peaks, whose differences are the
allocator's noise at small shapes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from warmgate_contract.shapes import Shape

log = logging.getLogger(__name__)

ACTIVATION_FACTOR = 2.5
"""How much a shape's need grows per byte of activations the pass model counts, past the
largest shape measured: freed activations stay in the allocator (glibc's per-thread arenas, the
CUDA caching allocator's blocks), kernels take scratch space, and the workers' peaks need not
coincide. Measured on a 2-core EPYC (MiniLM, the 15-shape plan, docs/benchmarks.md): the need
grew 1.8x the modelled activations from 32x128 to 32x256, 2.2x from 32x64 to 32x128, and 0.2x
from 32x256 to 32x512 (activations past glibc's mmap threshold go back to the system at once).
The growth per byte falls as shapes grow, so the largest shape measured is the anchor that
errs least: predicting every shape from the smallest one's need (as before, with 3.0) refused
the operator's own default plan for MiniLM at its default 1536Mi limit (32x256 "about 1.37 GiB"
of a 1.35 GiB budget; it needs 1.1)."""

ACTIVATION_SLACK = 32 * 2**20
"""Added to every prediction: at small shapes the need moves in the allocator's steps, not with
the activations (MiniLM: 51 MiB from 8x64 to 8x128, 3.4x their 15 MiB of activations)."""

_UNLIMITED = 1 << 60
"""cgroup v1 writes a huge number (about 2^63) for no limit."""


@dataclass(frozen=True)
class Limit:
    bytes: int | None
    source: str


class Probe(Protocol):
    device: str
    measure: str
    working_file: int
    """On a CPU, the file pages the passes touch (counted in current() and peak()); else 0."""

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


CODE_PAGES = 128 * 2**20
"""File pages of the libraries' code a CPU pass keeps touching, counted in every need: measured
while a warm MiniLM server answered requests here (smaps' Referenced after clear_refs), 110 MiB:
libtorch_cpu 87, libtorch_python 11, tokenizers 6, numpy 5, libpython 1."""

SAMPLE_SECONDS = 0.001
"""How often the anonymous memory is read while a shape warms (/proc/self/statm, a few
microseconds a read)."""

_PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    """Resident memory that no file backs (resident less shared, /proc/self/statm)."""
    fields = statm.read_text().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def model_files(folder: Path) -> frozenset[str]:
    """The real paths of the files in a model folder: a hub cache's snapshot holds links to its
    blobs, and /proc/self/smaps names the blobs."""
    found = set()
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                found.add(str(path.resolve()))
        except OSError:
            continue
    return frozenset(found)


def mapped_bytes(files: frozenset[str], smaps: Path = Path("/proc/self/smaps")) -> int:
    """Resident bytes of `files` (model_files) that this process maps (a checkpoint read
    through mmap: its pages are the model's, not reclaimable slack)."""
    total = 0
    inside = False
    with open(smaps) as lines:
        for line in lines:
            first, _, rest = line.partition(" ")
            if not first.endswith(":"):  # a mapping's header: range perms offset dev inode path
                fields = rest.split(maxsplit=4)
                inside = len(fields) == 5 and fields[4].rstrip("\n") in files
            elif inside and first == "Rss:":
                total += int(rest.split()[0]) * 1024
    return total


class _Sampler:
    """The highest anonymous memory seen from start() to stop(), read every SAMPLE_SECONDS on
    a thread of its own (the passes release the GIL)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.highest = 0

    def start(self) -> None:
        self.stop()
        self._stop = threading.Event()
        self.highest = anonymous_bytes()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stop = self._stop
        while not stop.wait(SAMPLE_SECONDS):
            self.highest = max(self.highest, anonymous_bytes())

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.highest = max(self.highest, anonymous_bytes())
        return self.highest


class ProcessProbe:
    """This process's unreclaimable memory (anonymous, and the file pages it works on)
    against its container's limit."""

    device = "cpu"
    measure = (
        "anonymous resident memory (resident less shared, /proc/self/statm; peaks sampled "
        "every millisecond) plus the file pages the passes work on (the model's mapped files, "
        "and 128 MiB of the libraries' code); other mapped file pages are reclaimable"
    )

    def __init__(self, cgroup: Cgroup | None = None, model_folder: Path | None = None) -> None:
        self.cgroup = cgroup if cgroup is not None else Cgroup.find()
        self.model_files = frozenset() if model_folder is None else model_files(model_folder)
        self.working_file = CODE_PAGES
        """File pages counted in every need: the libraries' code and the model's mapped
        files (measured after each shape)."""
        self._sampler = _Sampler()

    def limit(self) -> Limit:
        if self.cgroup is None:
            return Limit(None, "no memory cgroup found")
        return self.cgroup.limit()

    def current(self) -> int:
        return anonymous_bytes() + self.working_file

    def reset_peak(self) -> None:
        """Start sampling the next shape's peak."""
        self._sampler.start()

    def peak(self) -> int:
        anonymous = self._sampler.stop()
        if self.model_files:
            self.working_file = CODE_PAGES + mapped_bytes(self.model_files)
        return anonymous + self.working_file

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
    working_file = 0

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


def probe_for(device: object, model_folder: Path | None = None) -> Probe:
    kind = getattr(device, "type", str(device))
    return CudaProbe(device) if kind == "cuda" else ProcessProbe(model_folder=model_folder)


# ------------------------------------------------------------------------------ prediction
def warm_order(plan: Sequence[Shape]) -> list[Shape]:
    """Smallest first (by tokens; of equal tokens, the bigger batch first, which measured
    larger): each shape is then predicted from smaller ones, and the first that would not fit
    stops the warmup before it runs."""
    return sorted(plan, key=lambda shape: (shape.tokens, -shape.batch_size))


@dataclass(frozen=True)
class PassModel:
    """The activations a forward pass holds at once, from the model's dimensions: a layer's
    attention (its input, the fused query-key-value states, their padded layout, the context
    and its copies: ten hidden states a token) or its MLP (input, output and two intermediate
    states), whichever is larger, on every worker at once. Attention scores are not counted:
    scaled_dot_product_attention computes them in blocks (on a CPU as on a GPU), and a model
    that materialises them (transformers' eager attention) is what the measured part of the
    prediction covers. Weights and the runtime are measured, not modelled."""

    hidden: int
    intermediate: int
    dtype_bytes: int
    workers: int = 1

    def activation_bytes(self, shape: Shape) -> int:
        per_token = max(10 * self.hidden, 2 * (self.hidden + self.intermediate))
        return self.workers * self.dtype_bytes * shape.tokens * per_token

    @classmethod
    def of_folder(
        cls, folder: Path, dtype_bytes: int, workers: int, hidden: int | None = None
    ) -> PassModel:
        """From config.json's dimensions under BERT's names (packed.bert_config reads
        DistilBERT's), a Gemma's from its text_config; what it lacks is taken as a
        transformer's usual ratio (the loaded model's width, four times that inside)."""
        from .packed import bert_config

        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        config = bert_config(config.get("text_config", config)) if isinstance(config, dict) else {}

        def size(name: str) -> int | None:
            value = config.get(name)
            return value if isinstance(value, int) and value > 0 else None

        width = size("hidden_size") or hidden or 768
        return cls(width, size("intermediate_size") or 4 * width, dtype_bytes, workers)


def predict(measured: Sequence[tuple[Shape, int]], shape: Shape, model: PassModel) -> int | None:
    """The need `shape` will have: the largest need measured so far, plus ACTIVATION_FACTOR
    times what the pass model says its activations grow past those of the largest shape
    measured, plus ACTIVATION_SLACK. None before any shape was measured (the first is the
    plan's smallest; the loaded model's own need is checked before it)."""
    if not measured:
        return None
    need = max(need for _done, need in measured)
    reached = max(model.activation_bytes(done) for done, _need in measured)
    growth = max(0, model.activation_bytes(shape) - reached)
    return int(need + ACTIVATION_FACTOR * growth + ACTIVATION_SLACK)


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
