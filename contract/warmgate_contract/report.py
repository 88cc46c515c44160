"""The documents the server publishes and the operator reads: the `/ready` report (the warm
gate's evidence) and the warmup profile (`GET /warmup/profile`, and the file the server reads
back at start)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .shapes import Shape

DOWNLOADING, LOADING, WARMING = "downloading", "loading", "warming"
READY, DRAINING, FAILED = "ready", "draining", "failed"
UNHEALTHY = "unhealthy"
"""Was ready; its last forward passes failed or hung (/ready 503 until one succeeds)."""
PHASES = (DOWNLOADING, LOADING, WARMING, READY, UNHEALTHY, DRAINING, FAILED)


class ReportError(ValueError):
    """A document that does not follow the contract; the message says which part."""


@dataclass(frozen=True)
class WarmedShape:
    shape: Shape
    steady_ms: float
    runs: int
    seconds: float = 0.0
    """Wall time spent warming this shape, first (cold) run included."""


@dataclass(frozen=True)
class ShapeMemory:
    shape: Shape
    peak_bytes: int
    """The peak while it warmed (on every worker at once)."""
    predicted_bytes: int | None = None
    """The peak predicted before it ran, from the shapes warmed before it (None for the first
    shapes, which nothing before predicts)."""


@dataclass(frozen=True)
class PlanCut:
    """With the fit policy, what was left out of the plan to stay within the budget."""

    max_batch_tokens: int
    """The batcher's token budget now: the largest warmed shape's tokens."""
    shapes: tuple[Shape, ...]
    """The planned shapes left out (every one at or above the first that did not fit)."""
    reason: str


@dataclass(frozen=True)
class MemoryReport:
    """What the server measured of its memory while it warmed (the `memory` part of /ready)."""

    device: str
    measure: str
    """What the byte counts are: the process's resident memory on a CPU, the CUDA caching
    allocator's reserved memory on a GPU."""
    limit_bytes: int | None
    """What the process may use: the container's cgroup limit, or the GPU's memory; None when
    nothing limits it (then nothing is refused or cut)."""
    limit_source: str
    policy: str
    loaded_bytes: int
    """After the model loaded, before the first shape warmed (on a CPU, with the file pages
    the passes work on, once a shape has measured them)."""
    peak_bytes: int
    """The highest need the warmup reached."""
    shapes: tuple[ShapeMemory, ...] = ()
    cut: PlanCut | None = None
    container_usage_bytes: int | None = None
    """The cgroup's own count (page cache included) at the end of warmup, on a CPU."""
    container_peak_bytes: int | None = None
    device_details: Mapping[str, int] | None = None
    """On a GPU: the allocator's allocated peak, the device's free and total memory, at the
    end of warmup."""
    working_file_bytes: int | None = None
    """On a CPU: the file pages (libraries' code, mapped weights) the passes touched, counted
    in every need; the other file pages the process maps are reclaimable and not counted."""

    @property
    def budget_bytes(self) -> int | None:
        """The limit less the safety margin: no planned shape may be predicted above it."""
        return None if self.limit_bytes is None else int(self.limit_bytes * (1 - MEMORY_MARGIN))

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.limit_bytes is None else self.limit_bytes - self.peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "measure": self.measure,
            "limit_bytes": self.limit_bytes,
            "limit_source": self.limit_source,
            "budget_bytes": self.budget_bytes,
            "policy": self.policy,
            "loaded_bytes": self.loaded_bytes,
            "peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "container_usage_bytes": self.container_usage_bytes,
            "container_peak_bytes": self.container_peak_bytes,
            "device_details": None if self.device_details is None else dict(self.device_details),
            "working_file_bytes": self.working_file_bytes,
            "shapes": [
                {
                    **item.shape.as_json(),
                    "peak_bytes": item.peak_bytes,
                    "predicted_bytes": item.predicted_bytes,
                }
                for item in self.shapes
            ],
            "cut": None
            if self.cut is None
            else {
                "max_batch_tokens": self.cut.max_batch_tokens,
                "shapes": [shape.as_json() for shape in self.cut.shapes],
                "reason": self.cut.reason,
            },
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> MemoryReport:
        cut = document.get("cut")
        return cls(
            device=str(document["device"]),
            measure=str(document.get("measure") or ""),
            limit_bytes=_optional_int(document.get("limit_bytes")),
            limit_source=str(document.get("limit_source") or ""),
            policy=str(document.get("policy") or ""),
            loaded_bytes=int(document["loaded_bytes"]),
            peak_bytes=int(document["peak_bytes"]),
            shapes=tuple(
                ShapeMemory(
                    Shape.from_json(item),
                    int(item["peak_bytes"]),
                    _optional_int(item.get("predicted_bytes")),
                )
                for item in document.get("shapes") or []
            ),
            cut=None
            if cut is None
            else PlanCut(
                int(cut["max_batch_tokens"]),
                tuple(Shape.from_json(item) for item in cut.get("shapes") or []),
                str(cut.get("reason") or ""),
            ),
            container_usage_bytes=_optional_int(document.get("container_usage_bytes")),
            container_peak_bytes=_optional_int(document.get("container_peak_bytes")),
            device_details=document.get("device_details"),
            working_file_bytes=_optional_int(document.get("working_file_bytes")),
        )


MEMORY_MARGIN = 0.10
"""The share of the limit no planned shape is predicted to use: the allocator's and the
kernel's slack, and the error of the prediction."""


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class ReadyReport:
    """`GET /ready`'s body: the same keys in every phase."""

    phase: str
    model_id: str
    revision: str
    served_name: str
    device: str
    dtype: str
    planned: tuple[Shape, ...]
    warmed: tuple[WarmedShape, ...]
    warmup_seconds: float | None = None
    error: str | None = None
    started_at: str = ""
    pid: int = 0
    workers: int | None = None
    torch_threads: int | None = None
    model_settings: Mapping[str, Any] | None = None
    """How the server embeds (pooling, normalize, prompts) and what chose each: a flag, the
    model folder's sentence-transformers files, or the default. None until loaded."""
    forward: Mapping[str, Any] | None = None
    """How forward passes run: warmgate's packed pass or the model's padded one, the attention,
    and the CUDA graphs (mode, why off, how many, their device memory)."""
    commit: str | None = None
    """The hub commit the loaded files are from (None: a plain folder, or not loaded yet)."""
    weights_digest: str | None = None
    """`sha256:<hex>` over the weight files loaded; None until the files are located."""
    download: Mapping[str, int] | None = None
    """{"done_bytes", "total_bytes"} while (and after) downloading; None when nothing was."""
    memory: MemoryReport | None = None
    """What the warmup measured of memory; None until the model is loaded."""
    failure_reason: str | None = None
    """With phase failed, a CamelCase reason when the cause is one the operator tells apart
    (names.REASON_MEMORY_EXCEEDED); None for other failures."""

    @property
    def loaded_identity(self) -> tuple[str | None, str] | None:
        """(commit, weights digest): what two pods of one template must agree on."""
        return None if self.weights_digest is None else (self.commit, self.weights_digest)

    @property
    def ready(self) -> bool:
        return self.phase == READY

    @property
    def warmed_shapes(self) -> frozenset[Shape]:
        return frozenset(item.shape for item in self.warmed)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "ready": self.ready,
            "model": {
                "id": self.model_id,
                "revision": self.revision,
                "served_name": self.served_name,
                "commit": self.commit,
                "weights_digest": self.weights_digest,
            },
            "download": None if self.download is None else dict(self.download),
            "device": self.device,
            "dtype": self.dtype,
            "workers": self.workers,
            "torch_threads": self.torch_threads,
            "planned_shapes": [shape.as_json() for shape in self.planned],
            "warmed_shapes": [
                {
                    **item.shape.as_json(),
                    "steady_ms": round(item.steady_ms, 3),
                    "runs": item.runs,
                    "seconds": round(item.seconds, 3),
                }
                for item in self.warmed
            ],
            "progress": {"done": len(self.warmed), "total": len(self.planned)},
            "warmup_seconds": (
                None if self.warmup_seconds is None else round(self.warmup_seconds, 3)
            ),
            "error": self.error,
            "started_at": self.started_at,
            "pid": self.pid,
            "model_settings": None if self.model_settings is None else dict(self.model_settings),
            "forward": None if self.forward is None else dict(self.forward),
            "memory": None if self.memory is None else self.memory.to_json(),
            "failure_reason": self.failure_reason,
        }

    @classmethod
    def from_json(cls, document: Any) -> ReadyReport:
        """Read a report; ReportError says what is missing or malformed."""
        if not isinstance(document, Mapping):
            raise ReportError("the /ready body is not a JSON object")
        try:
            phase = document["phase"]
            model = document["model"]
            planned = tuple(Shape.from_json(item) for item in document["planned_shapes"])
            warmed = tuple(
                WarmedShape(
                    Shape.from_json(item),
                    float(item.get("steady_ms") or 0.0),
                    int(item.get("runs") or 0),
                    float(item.get("seconds") or 0.0),
                )
                for item in document["warmed_shapes"]
            )
            seconds = document.get("warmup_seconds")
            report = cls(
                phase=str(phase),
                model_id=str(model["id"]),
                revision=str(model["revision"]),
                served_name=str(model.get("served_name") or ""),
                device=str(document.get("device") or ""),
                dtype=str(document.get("dtype") or ""),
                planned=planned,
                warmed=warmed,
                warmup_seconds=None if seconds is None else float(seconds),
                error=document.get("error"),
                started_at=str(document.get("started_at") or ""),
                pid=int(document.get("pid") or 0),
                workers=document.get("workers"),
                torch_threads=document.get("torch_threads"),
                model_settings=document.get("model_settings"),
                forward=document.get("forward"),
                commit=model.get("commit"),
                weights_digest=model.get("weights_digest"),
                download=document.get("download"),
                memory=None
                if document.get("memory") is None
                else MemoryReport.from_json(document["memory"]),
                failure_reason=document.get("failure_reason"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ReportError(f"the /ready report lacks or mangles {error}") from None
        if report.phase not in PHASES:
            raise ReportError(f"the /ready report has an unknown phase {report.phase!r}")
        return report


# ------------------------------------------------------------------ the warmup profile
@dataclass(frozen=True)
class ProfileEntry:
    shape: Shape
    count: int


def render_profile(entries: Iterable[ProfileEntry]) -> dict[str, list[dict[str, int]]]:
    """`{"shapes": [{"batch_size", "seq_len", "count"}]}`, most frequent first."""
    ranked = sorted(entries, key=lambda entry: (-entry.count, entry.shape))
    return {"shapes": [{**e.shape.as_json(), "count": e.count} for e in ranked]}


def parse_profile(document: Any) -> tuple[ProfileEntry, ...]:
    """The entries of a profile document; ValueError says which entry is wrong."""
    if not isinstance(document, Mapping) or not isinstance(document.get("shapes", []), list):
        raise ValueError('expected an object {"shapes": [...]}')
    entries = []
    for position, item in enumerate(document.get("shapes", [])):
        if not isinstance(item, Mapping):
            raise ValueError(f"shapes[{position}] is not an object")
        count = item.get("count", 0)
        try:
            shape = Shape.from_json(item)
        except ValueError:
            shape = None
        if shape is None or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(
                f"shapes[{position}] needs positive integers batch_size and seq_len "
                "(and a non-negative integer count)"
            )
        entries.append(ProfileEntry(shape, count))
    return tuple(entries)


def merge_profiles(
    profiles: Iterable[Iterable[ProfileEntry]], max_shapes: int
) -> list[ProfileEntry]:
    """Sum several processes' counts and keep the `max_shapes` most frequent (ties: smaller
    shapes first, so the result is stable)."""
    counts: Counter[Shape] = Counter()
    for entries in profiles:
        for entry in entries:
            if entry.count > 0:
                counts[entry.shape] += entry.count
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: max(0, max_shapes)]
    return [ProfileEntry(shape, count) for shape, count in top]


def shapes_by_count(entries: Iterable[ProfileEntry]) -> tuple[Shape, ...]:
    """The distinct shapes, most frequent first."""
    ranked = sorted(entries, key=lambda entry: (-entry.count, entry.shape))
    return tuple(dict.fromkeys(entry.shape for entry in ranked))
