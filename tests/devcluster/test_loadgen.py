"""The load generator's pure parts: where it may send, and Server-Timing."""

from __future__ import annotations

import pytest

from warmgate_devcluster.loadgen import check_local_target, server_timings, total_ms


def test_load_only_targets_this_machine():
    check_local_target("http://127.0.0.1:8080/")
    check_local_target("http://localhost:8080/")
    check_local_target("http://10.200.2.2:30001/", networks=("10.200.2.0/30",))
    with pytest.raises(ValueError, match=r"not 10\.200\.2\.2"):
        check_local_target("http://10.200.2.2:30001/")
    with pytest.raises(ValueError, match=r"not 192\.0\.2\.2"):
        check_local_target("http://192.0.2.2/", networks=("10.200.2.0/30",))


def test_server_timing_header_is_read_as_milliseconds() -> None:
    def server_timing_ms(header: str | None) -> float | None:
        return total_ms(server_timings(header))

    assert server_timing_ms("embed;dur=12.5") == 12.5
    assert server_timing_ms('queue;dur=2, model;desc="forward";dur=8') == 10.0
    assert server_timing_ms(None) is None and server_timing_ms("cache;desc=hit") is None
    assert server_timing_ms("embed;dur=soon") is None
    # warmgate-server's stages add up to its `embed` total, which is what counts, not their sum
    stages = "tokenize;dur=0.4, queue;dur=0.1, model;dur=14.0, model-cpu;dur=13.5, embed;dur=15.2"
    assert server_timing_ms(stages) == 15.2
