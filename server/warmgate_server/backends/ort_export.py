"""--backend onnxruntime: the model exported to ONNX at start and run by ONNX Runtime.

The loaded transformers model (loaded strictly, as for the padded torch pass) is exported once
with torch's TorchScript-based exporter (batch and sequence axes dynamic), into a temporary
folder that is deleted as soon as the sessions hold it; the torch model is then let go, so the
weights are in memory once. A session per CPU thread count the workers use (each model
worker's, and the solo batches' when there are any): ONNX Runtime fixes a session's thread
pool when it is made. Each planned shape runs through each session during warmup, so ONNX
Runtime's per-shape work (shape inference, its memory plan, arena growth) is paid before /ready.

With a cache folder (--compile-cache; the operator's pods use their cache emptyDir, which a
restarted container keeps) the exported file is kept under a key of everything the export
depends on, and a later start with the same key opens it instead of exporting: no export time
and no export peak. The key is a hash of the weights as loaded (names, dtypes, shapes, bytes),
the model's class and configuration (its folder's path left out), the input names, the opset and
the versions of torch, transformers and this file's format (EXPORT_FORMAT): a changed model or
image gets a new key, never a stale graph. An entry is written to a temporary folder beside it
and renamed into place, so pods sharing a claim never see half of one; an entry that ONNX
Runtime cannot open is deleted and exported again; entries unused for CACHE_KEEP_DAYS days are
deleted when a new one is stored.

ONNX Runtime (graph optimisations at level "all") fuses each layer norm into one kernel and
GELU with its bias, and plans memory per shape, but computes every padded position; attention
stays as the exporter wrote it (matmuls and a softmax). The export is as fast under ONNX Runtime
as optimum's (bench/server/onnx_export.py), which Infinity's `--engine optimum` serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from warmgate_contract.report import MEMORY_MARGIN

from ..errors import MemoryExceeded, ModelLoadError

if TYPE_CHECKING:
    from ..memory import Probe

log = logging.getLogger(__name__)

OPSET = 17
"""LayerNormalization is an ONNX operator from opset 17 on (one kernel, not five)."""
EXPORT_FORMAT = 1
"""Part of the cache key: raise it when the export's inputs, outputs or settings change."""
CACHE_KEEP_DAYS = 14
"""Cache entries unused this long are deleted when a new entry is stored."""
EXPORT_HOURS = 6
"""A temporary export folder this old belongs to an export that never finished."""

EXPORT_PEAK_PER_WEIGHT_BYTE = 4.5
"""Resident memory the export takes at its peak, above what the process held before it, per
byte of the model's weights: torch's tracer, the ONNX graph and its serialised copy. Measured
4.3x for MiniLM (87 MB of weights, 371 MB more at the peak) and 4.0x for an XLM-R of
multilingual-e5-base's shape (1061 MB, 4.3 GB more); the rest is margin."""


def check_export_fits(weights: int, memory: Probe) -> None:
    """Refuse, with the numbers, an export of `weights` bytes of weights whose peak would pass
    the memory limit (the kernel would kill the container mid-export, and again at every
    restart) before it starts."""
    limit = memory.limit()
    if limit.bytes is None or memory.device != "cpu":
        return
    held = memory.current()
    need = held + int(EXPORT_PEAK_PER_WEIGHT_BYTE * weights)
    budget = int(limit.bytes * (1 - MEMORY_MARGIN))
    if need > budget:
        gib = 2**30
        raise MemoryExceeded(
            f"--backend onnxruntime: exporting the model to ONNX takes about {need / gib:.2f} "
            f"GiB at its peak ({held / gib:.2f} GiB held now and "
            f"{EXPORT_PEAK_PER_WEIGHT_BYTE:g}x the {weights / gib:.2f} GiB of weights), above "
            f"{budget / gib:.2f} GiB ({limit.source} less {MEMORY_MARGIN:.0%}): raise "
            f"resources.limits.memory to at least {need / (1 - MEMORY_MARGIN) / gib + 0.01:.2f} "
            "GiB, or use runtime.backend torch"
        )


@dataclass(frozen=True)
class OrtModel:
    """The exported model: `run` gives the last hidden states of a padded batch."""

    sessions: dict[int, Any]
    """An ONNX Runtime session per thread count."""
    inputs: tuple[str, ...]
    """The graph's input names: input_ids, attention_mask and token_type_ids if it has one."""
    export_seconds: float
    """Seconds from the start to open sessions: hashing, exporting (or reading the cache)."""
    worker_threads: int
    """The threads of a model worker's passes (a solo batch names its own)."""
    cache: str = "off"
    """"off" (no cache folder), "hit" (opened from the cache, not exported), "miss" (exported,
    then stored) or "unwritable" (exported; the cache folder could not be written)."""
    cache_path: str = ""
    """The cache entry's folder, when there is a cache."""

    @property
    def thread_counts(self) -> tuple[int, ...]:
        return tuple(sorted(self.sessions))

    def run(self, ids: np.ndarray, mask: np.ndarray, threads: int | None = None) -> np.ndarray:
        """(rows, seq_len, hidden) float32 last hidden states, on the session of `threads`
        (None: a model worker's). Sessions are safe to run from several threads at once."""
        threads = threads or self.worker_threads
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            feed["token_type_ids"] = np.zeros_like(ids)
        session = self.sessions.get(threads)
        if session is None:
            raise RuntimeError(
                f"no ONNX Runtime session for {threads} threads "
                f"(sessions: {', '.join(map(str, self.thread_counts))})"
            )
        return session.run(None, feed)[0]


def export(
    model: Any,
    uses_token_type_ids: bool,
    worker_threads: int,
    solo_threads: int = 0,
    cache: Path | None = None,
    before_export: Callable[[], None] | None = None,
) -> OrtModel:
    """Export `model` (a transformers encoder, float32, on the CPU) and open a session for
    the workers' thread count and one for solo batches' (0: none run solo). With `cache`, an
    entry of the same key is opened instead of exporting, and a new export is stored there.
    `before_export` runs only when the model is exported (the memory check: a cache hit has
    no export peak). Raises ModelLoadError with the exporter's or ONNX Runtime's reason."""
    try:
        import onnxruntime
    except ImportError as error:
        raise ModelLoadError(
            f"--backend onnxruntime: onnxruntime is not installed in this image ({error}); "
            "use --backend torch"
        ) from None

    started = time.perf_counter()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if uses_token_type_ids else [])
    threads = sorted({worker_threads, solo_threads} - {0})
    entry = None
    if cache is not None:
        entry = cache / cache_key(model, names)
        sessions = _open_cached(entry, threads)
        if sessions is not None:
            log.info(
                "opened the ONNX export of %s from the cache %s in %.1fs (not exported)",
                type(model).__name__,
                entry,
                time.perf_counter() - started,
            )
            seconds = time.perf_counter() - started
            return OrtModel(sessions, tuple(names), seconds, worker_threads, "hit", str(entry))
    if before_export is not None:
        before_export()
    state = "off"
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix=".export-", dir=cache))
            state = "miss"
        except OSError as error:
            log.warning(
                "cannot write the compile cache %s (%s): the export is not kept", cache, error
            )
            state, entry = "unwritable", None
    if state != "miss":
        folder = Path(tempfile.mkdtemp(prefix="warmgate-onnx-"))
    try:
        path = folder / "model.onnx"
        _export(model, names, path)
        exported = time.perf_counter() - started
        sessions = _open_sessions(path, threads)
        if entry is not None:
            _store(folder, entry, model)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log.info(
        "exported %s to ONNX in %.1fs; ONNX Runtime %s sessions for %s threads in %.1fs%s",
        type(model).__name__,
        exported,
        onnxruntime.__version__,
        ", ".join(map(str, sorted(sessions))),
        time.perf_counter() - started - exported,
        f"; stored in the cache {entry}" if entry is not None else "",
    )
    return OrtModel(
        sessions,
        tuple(names),
        time.perf_counter() - started,
        worker_threads,
        state,
        "" if entry is None else str(entry),
    )


def _export(model: Any, names: list[str], path: Path) -> None:
    import torch

    # Token type ids are zeros when served (one segment); a model with one type has no id 1.
    example = tuple(
        (torch.zeros if name == "token_type_ids" else torch.ones)((2, 8), dtype=torch.int64)
        for name in names
    )
    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    wrapped = _LastHiddenState(model, names)
    try:
        with torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(
                wrapped,
                example,
                str(path),
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
    except Exception as error:  # the exporter's own reason, whatever its type
        raise ModelLoadError(
            f"--backend onnxruntime: {type(model).__name__} does not export to ONNX: "
            f"{type(error).__name__}: {error}; use --backend torch"
        ) from None


def _open_sessions(path: Path, thread_counts: list[int]) -> dict[int, Any]:
    """A session on `path` per thread count. Raises ModelLoadError with ONNX Runtime's reason."""
    import onnxruntime

    sessions = {}
    for threads in thread_counts:
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Threads that spin between passes take CPU from the tokenizer and the HTTP loop,
        # which share the pod's CPUs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            sessions[threads] = onnxruntime.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as error:
            raise ModelLoadError(
                f"--backend onnxruntime: ONNX Runtime cannot open the exported model: "
                f"{error}; use --backend torch"
            ) from None
    return sessions


def cache_key(model: Any, names: list[str]) -> str:
    """A hash of everything the export depends on: the weights as loaded, the model's class and
    configuration, the graph's inputs, the opset, the versions of the exporter's libraries."""
    import torch
    import transformers

    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where the folder is mounted is not the model
    described = {
        "format": EXPORT_FORMAT,
        "opset": OPSET,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "attention": getattr(model.config, "_attn_implementation", None),
        "config": config,
        "inputs": names,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()[:32]


def _open_cached(entry: Path, thread_counts: list[int]) -> dict[int, Any] | None:
    """Sessions on a cache entry, or None when there is none or it does not open (then it is
    deleted, to be exported again)."""
    path = entry / "model.onnx"
    if not path.is_file():
        return None
    try:
        sessions = _open_sessions(path, thread_counts)
    except ModelLoadError as error:
        log.warning("the cached ONNX export %s does not open, exporting again: %s", entry, error)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    with contextlib.suppress(OSError):  # a read-only cache is still a cache
        os.utime(entry)  # last used, for CACHE_KEEP_DAYS
    return sessions


def _store(folder: Path, entry: Path, model: Any) -> None:
    """Rename the export's folder into place as the cache entry (another process may have
    stored the same key meanwhile: then its entry stays), and delete long-unused entries. A
    cache that cannot be written costs the next start an export, not this one its start."""
    import torch

    about = {"model": type(model).__name__, "torch": torch.__version__, "opset": OPSET}
    try:
        (folder / "export.json").write_text(json.dumps(about) + "\n")
        if entry.is_dir() and not (entry / "model.onnx").is_file():
            shutil.rmtree(entry)  # a broken entry
        os.rename(folder, entry)
    except OSError as error:
        if not (entry / "model.onnx").is_file():
            log.warning("could not store the ONNX export in the cache %s: %s", entry, error)
        return
    now = time.time()
    for other in entry.parent.iterdir():
        # Entries unused for CACHE_KEEP_DAYS, and the temporary folders of exports that never
        # finished (a process killed mid-export) once they are hours old.
        keep = EXPORT_HOURS * 3600 if other.name.startswith(".export-") else CACHE_KEEP_DAYS * 86400
        try:
            if other != entry and other.is_dir() and other.stat().st_mtime < now - keep:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


class _LastHiddenState:
    """A module whose forward takes the inputs positionally and returns the last hidden state
    alone (the exporter's inputs are positional; the model's outputs are a ModelOutput)."""

    def __new__(cls, model: Any, names: list[str]) -> Any:
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
                return self.model(**dict(zip(names, inputs, strict=True)))[0]

        return Wrapped().eval()
