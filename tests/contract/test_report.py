"""The documents the server publishes and the operator reads: the `/ready` report the warm gate
judges, and the warmup profile (observed shapes) that travels from pods to new pods."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.report import (
    PHASES,
    READY,
    WARMING,
    MemoryReport,
    PlanCut,
    ProfileEntry,
    ReadyReport,
    ReportError,
    ShapeMemory,
    WarmedShape,
    merge_profiles,
    parse_profile,
    render_profile,
    shapes_by_count,
)
from warmgate_contract.shapes import Shape

shapes = st.builds(Shape, st.integers(1, 1024), st.integers(1, 32768))
# What survives the report's rounding to milliseconds.
millis = st.integers(0, 10**9).map(lambda value: value / 1000)
texts = st.text(max_size=30)
sizes = st.integers(0, 1 << 40)

memory_reports = st.builds(
    MemoryReport,
    device=texts,
    measure=texts,
    limit_bytes=st.none() | sizes,
    limit_source=texts,
    policy=st.sampled_from(["refuse", "fit"]),
    loaded_bytes=sizes,
    peak_bytes=sizes,
    shapes=st.lists(st.builds(ShapeMemory, shapes, sizes, st.none() | sizes), max_size=4).map(
        tuple
    ),
    cut=st.none()
    | st.builds(PlanCut, st.integers(1, 1 << 20), st.lists(shapes, max_size=4).map(tuple), texts),
    container_usage_bytes=st.none() | sizes,
    container_peak_bytes=st.none() | sizes,
    device_details=st.none()
    | st.fixed_dictionaries({"allocated_peak_bytes": sizes, "free_bytes": sizes}),
)

reports = st.builds(
    ReadyReport,
    phase=st.sampled_from(PHASES),
    model_id=texts,
    revision=texts,
    served_name=texts,
    device=texts,
    dtype=texts,
    planned=st.lists(shapes, max_size=8).map(tuple),
    warmed=st.lists(st.builds(WarmedShape, shapes, millis, st.integers(0, 100)), max_size=8).map(
        tuple
    ),
    warmup_seconds=st.none() | millis,
    error=st.none() | texts,
    started_at=texts,
    pid=st.integers(0, 1 << 22),
    workers=st.none() | st.integers(1, 64),
    torch_threads=st.none() | st.integers(1, 64),
    model_settings=st.none() | st.fixed_dictionaries({"pooling": st.sampled_from(["mean", "cls"])}),
    commit=st.none() | st.text("0123456789abcdef", min_size=40, max_size=40),
    weights_digest=st.none() | texts.map(lambda text: f"sha256:{text}"),
    download=st.none()
    | st.fixed_dictionaries({"done_bytes": st.integers(0), "total_bytes": st.integers(0)}),
    memory=st.none() | memory_reports,
    failure_reason=st.none() | st.just("WarmupMemoryExceeded"),
)


@given(report=reports)
def test_a_report_reads_back_as_written(report: ReadyReport) -> None:
    document = report.to_json()
    assert ReadyReport.from_json(document) == report
    if report.memory is not None and report.memory.limit_bytes is not None:
        memory = document["memory"]
        assert memory["budget_bytes"] == int(report.memory.limit_bytes * 0.9)
        assert memory["headroom_bytes"] == report.memory.limit_bytes - report.memory.peak_bytes
    assert document["ready"] is (report.phase == READY)
    assert document["progress"] == {"done": len(report.warmed), "total": len(report.planned)}


def test_the_gate_sees_what_was_warmed_and_which_files_were_loaded() -> None:
    report = ReadyReport(
        phase=WARMING,
        model_id="org/m",
        revision="main",
        served_name="m",
        device="cpu",
        dtype="float32",
        planned=(Shape(1, 32), Shape(8, 32)),
        warmed=(WarmedShape(Shape(1, 32), 1.5, 4),),
    )
    assert not report.ready and report.warmed_shapes == {Shape(1, 32)}
    assert report.loaded_identity is None  # the files are not located yet
    loaded = ReadyReport.from_json(
        {**report.to_json(), "model": {"id": "org/m", "revision": "main", "weights_digest": "d"}}
    )
    assert loaded.loaded_identity == (None, "d")  # a plain folder: no commit


def minimal() -> dict[str, Any]:
    return {
        "phase": "loading",
        "model": {"id": "org/m", "revision": "main"},
        "planned_shapes": [{"batch_size": 1, "seq_len": 32}],
        "warmed_shapes": [],
    }


def test_a_minimal_report_reads_with_the_optional_parts_empty() -> None:
    report = ReadyReport.from_json(minimal())
    assert report.planned == (Shape(1, 32),) and report.warmed == ()
    assert (report.served_name, report.warmup_seconds, report.error) == ("", None, None)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda doc: doc.pop("phase"), "lacks or mangles 'phase'"),
        (lambda doc: doc.pop("model"), "'model'"),
        (lambda doc: doc["model"].pop("revision"), "'revision'"),
        (lambda doc: doc.pop("planned_shapes"), "'planned_shapes'"),
        (lambda doc: doc.update(planned_shapes=[{"batch_size": 0, "seq_len": 8}]), "mangles"),
        (lambda doc: doc.update(warmed_shapes=[{"batch_size": 1}]), "mangles"),
        (
            lambda doc: doc.update(warmed_shapes=[{**doc["planned_shapes"][0], "runs": "x"}]),
            "mangles",
        ),
        (lambda doc: doc.update(model="org/m"), "mangles"),
        (lambda doc: doc.update(phase="sleeping"), "unknown phase 'sleeping'"),
    ],
)
def test_a_report_off_the_contract_is_refused_saying_which_part(change: Any, words: str) -> None:
    document = minimal()
    change(document)
    with pytest.raises(ReportError, match=words):
        ReadyReport.from_json(document)


@pytest.mark.parametrize("document", [None, [], "ready", 503])
def test_a_body_that_is_not_an_object_is_refused(document: Any) -> None:
    with pytest.raises(ReportError, match="not a JSON object"):
        ReadyReport.from_json(document)


# ------------------------------------------------------------------ the warmup profile
entries = st.lists(st.builds(ProfileEntry, shapes, st.integers(0, 10**6)), max_size=12)


@given(profile=entries)
def test_a_profile_reads_back_most_frequent_first(profile: list[ProfileEntry]) -> None:
    read = parse_profile(render_profile(profile))
    assert sorted(read, key=lambda e: (e.shape, e.count)) == sorted(
        profile, key=lambda e: (e.shape, e.count)
    )
    counts = [entry.count for entry in read]
    assert counts == sorted(counts, reverse=True)


@given(profiles=st.lists(entries, max_size=4), max_shapes=st.integers(-1, 8))
def test_merging_sums_each_shapes_counts_and_keeps_the_most_frequent(
    profiles: list[list[ProfileEntry]], max_shapes: int
) -> None:
    totals: dict[Shape, int] = {}
    for profile in profiles:
        for entry in profile:
            totals[entry.shape] = totals.get(entry.shape, 0) + entry.count
    merged = merge_profiles(profiles, max_shapes)
    assert len(merged) == min(max(0, max_shapes), sum(1 for c in totals.values() if c > 0))
    for entry in merged:
        assert entry.count == totals[entry.shape] > 0
    kept = {entry.shape for entry in merged}
    smallest_kept = min((entry.count for entry in merged), default=None)
    for shape, count in totals.items():
        if shape not in kept and smallest_kept is not None:
            assert count <= smallest_kept  # nothing left out was more frequent than what stayed


def test_shapes_by_count_is_distinct_and_most_frequent_first() -> None:
    found = shapes_by_count(
        [
            ProfileEntry(Shape(1, 32), 2),
            ProfileEntry(Shape(8, 64), 9),
            ProfileEntry(Shape(1, 32), 5),
        ]
    )
    assert found == (Shape(8, 64), Shape(1, 32))


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ([], "expected an object"),
        ({"shapes": {}}, "expected an object"),
        ({"shapes": [3]}, r"shapes\[0\] is not an object"),
        ({"shapes": [{"batch_size": 1, "seq_len": 8}, {"batch_size": 0, "seq_len": 8}]}, r"\[1\]"),
        ({"shapes": [{"batch_size": 1, "seq_len": 8, "count": -1}]}, "non-negative"),
        ({"shapes": [{"batch_size": 1, "seq_len": 8, "count": True}]}, "non-negative"),
    ],
)
def test_a_profile_off_the_contract_is_refused_naming_the_entry(document: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_profile(document)


def test_an_empty_profile_is_no_shapes() -> None:
    assert parse_profile({}) == () and parse_profile({"shapes": []}) == ()
    assert render_profile([]) == {"shapes": []}
