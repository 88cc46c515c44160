"""Reading plain-dict objects: conditions, and the API's two timestamp formats both ways."""

from __future__ import annotations

from datetime import UTC, datetime

from warmgate_kube.objects import condition, micro_time, parse_time, rfc3339


def test_a_condition_is_found_by_type_and_handed_out_as_a_copy() -> None:
    pod = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    ready = condition(pod, "Ready")
    assert ready == {"type": "Ready", "status": "True"}
    ready["status"] = "False"
    assert pod["status"]["conditions"][0]["status"] == "True"
    assert condition(pod, "PodScheduled") is None
    assert condition(None, "Ready") is None and condition({"status": None}, "Ready") is None


def test_timestamps_are_written_as_the_api_writes_them_and_read_back() -> None:
    moment = datetime(2026, 12, 7, 8, 30, 15, 123456, tzinfo=UTC)
    assert rfc3339(moment) == "2026-12-07T08:30:15Z"
    assert micro_time(moment) == "2026-12-07T08:30:15.123456Z"
    assert parse_time(rfc3339(moment)) == int(moment.timestamp())
    assert parse_time(micro_time(moment)) == moment.timestamp()
    # Anything else is not a time: no guessing of zones or formats.
    for stamp in (None, 17, "", "2026-12-07T08:30:15", "2026-12-07T08:30:15+00:00", "soonZ"):
        assert parse_time(stamp) is None
