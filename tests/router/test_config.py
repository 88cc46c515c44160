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


def test_a_service_link_in_the_environment_is_named_not_a_traceback(monkeypatch, capsys):
    # A Service named warmgate-router in the pod's namespace makes the kubelet set
    # WARMGATE_ROUTER_PORT=tcp://... in every pod that keeps enableServiceLinks on.
    monkeypatch.setenv("WARMGATE_ROUTER_PORT", "tcp://10.96.0.20:80")
    with pytest.raises(SystemExit):
        parse_args([])
    said = capsys.readouterr().err
    assert "WARMGATE_ROUTER_PORT='tcp://10.96.0.20:80' is not a valid --port" in said
    assert "enableServiceLinks" in said


def test_the_hold_ceiling_is_a_flag_and_never_below_the_hold(monkeypatch, capsys):
    monkeypatch.setenv("WARMGATE_ROUTER_MAX_HOLD_SECONDS", "900")
    assert parse_args([]).hold_ceiling == 900
    assert parse_args(["--max-hold-seconds", "300"]).hold_ceiling == 300
    with pytest.raises(SystemExit):
        parse_args(["--hold-seconds", "120", "--max-hold-seconds", "60"])
    said = capsys.readouterr().err
    assert "--max-hold-seconds 60 is below --hold-seconds 120" in said
    # Unset: 600 s, or a longer --hold-seconds set before the ceiling existed.
    assert RouterConfig().hold_ceiling == 600
    assert RouterConfig(hold_seconds=900).hold_ceiling == 900
