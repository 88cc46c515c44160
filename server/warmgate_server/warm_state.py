"""What a restarted server reuses instead of reading or measuring it again (--warm-state DIR):
the weight files' sha256 (1.0 s a GiB on one core: the weights digest every pod reports) and the
packed pass's linear kernels as measured at load (models/linear.choose: about 0.5 s for an
XLM-R of multilingual-e5-base's size). The operator's pods keep it in their cache emptyDir, so a
restarted container finds it; a claim mounted there (spec.volumeMounts) shares it with the next
pods of the same model on any node, a scale from zero's among them.

Each entry is keyed by what would make it wrong: a file's sha256 by the file's identity (device,
inode, size, modification and change times: a file rewritten in place, even with its old
modification time, has a new change time); a measurement by the CPU (its model name and
features), torch's and warmgate's versions, the threads, the dtype and the matrices' shapes.
What a CPU keeps only in memory is not here: oneDNN's primitives, the allocator's pages and the
threads' first use are warmed again by every start (docs/benchmarks.md, "What a CPU needs
warmed"). A folder that cannot be read or written costs only the time it would have saved: the
server logs it once and measures as if it had none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION = 1
"""The layout of the files; an entry written under another is ignored."""


@functools.cache
def _cpu() -> str:
    """The CPU's model name and the features a kernel choice depends on, as one short digest."""
    name, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == platform.machine():
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{name} ({hashlib.sha256(flags.encode()).hexdigest()[:12]})"


@functools.cache
def _versions() -> str:
    """torch's version and the server's code (a digest of its modules: an image built from
    other code measures again, whatever its version number says)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "?"
    code = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        code.update(path.read_bytes())
    return f"torch {torch}, warmgate_server {code.hexdigest()[:12]}"


class WarmState:
    """The folder's entries (None: no folder, nothing kept). Thread-safe: the digest is read
    beside the load."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._tables: dict[str, dict[str, Any]] = {}
        self._warned = False
        self.hits: dict[str, int] = {"sha256": 0, "linear": 0}
        """Entries reused this start, by kind (the start's log line says how many)."""

    def file_sha256(self, path: Path, compute: Callable[[Path], str]) -> str:
        """`path`'s sha256, kept by its identity; `compute` reads it when not kept."""
        try:
            stat = path.stat()
        except OSError:
            return compute(path)
        key = (
            f"{path}|{stat.st_dev}:{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|"
            f"{stat.st_ctime_ns}"
        )
        found = self._get("sha256", key)
        if isinstance(found, str):
            self._count("sha256")
            return found
        value = compute(path)
        self._put("sha256", key, value)
        return value

    def measured(self, what: Mapping[str, Any], measure: Callable[[], Any]) -> tuple[Any, bool]:
        """(the measurement of `what`, kept: True) or (`measure()`'s, now kept: False). `what`
        is JSON-able; the CPU and the versions are added to it."""
        key = json.dumps({**what, "cpu": _cpu(), "versions": _versions()}, sort_keys=True)
        found = self._get("linear", key)
        if found is not None:
            self._count("linear")
            return found, True
        value = measure()
        self._put("linear", key, value)
        return value, False

    def _count(self, kind: str) -> None:
        with self._lock:
            self.hits[kind] += 1

    def _table(self, kind: str) -> dict[str, Any]:
        if kind not in self._tables:
            table: dict[str, Any] = {}
            if self.folder is not None:
                try:
                    loaded = json.loads((self.folder / f"{kind}.json").read_text())
                    if isinstance(loaded, dict) and loaded.get("version") == VERSION:
                        table = dict(loaded.get("entries") or {})
                except FileNotFoundError:
                    pass
                except (OSError, ValueError) as error:
                    self._warn(f"cannot read {self.folder / f'{kind}.json'}: {error}")
            self._tables[kind] = table
        return self._tables[kind]

    def _get(self, kind: str, key: str) -> Any:
        with self._lock:
            return self._table(kind).get(key)

    def _put(self, kind: str, key: str, value: Any) -> None:
        if self.folder is None:
            return
        with self._lock:
            table = self._table(kind)
            table[key] = value
            path = self.folder / f"{kind}.json"
            scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                scratch.write_text(json.dumps({"version": VERSION, "entries": table}))
                scratch.replace(path)  # whole or not at all, also beside another pod
            except OSError as error:
                self._warn(f"cannot write {path}: {error}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("warm state: %s; measuring as if there were none", message)
