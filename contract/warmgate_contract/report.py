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
