"""The router's flags and their environment twins."""

from __future__ import annotations

import pytest

from warmgate_router.config import RouterConfig, parse_args


def test_flags_and_their_environment_twins(monkeypatch):
    monkeypatch.setenv("WARMGATE_ROUTER_HOLD_SECONDS", "7")
    monkeypatch.setenv("WARMGATE_ROUTER_NAMESPACE", "a,b")
    config = parse_args([])
    assert config.hold_seconds == 7 and config.namespaces == ("a", "b")
    assert parse_args(["--namespace", "c", "--namespace", "d,c"]).namespaces == ("c", "d")
    with pytest.raises(SystemExit):
        parse_args(["--log-format", "xml"])
    assert RouterConfig().port == 8080
