"""Memory: what the process may use, and what it uses (a `Probe`), on a CPU and on a GPU. What a
shape will need is memory_prediction.py's; whether loading fits at all, preflight.py's.

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
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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
