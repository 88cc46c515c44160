"""The router's pure parts: which endpoints are Ready, which pod is picked, its flags."""

from __future__ import annotations

import pytest

from warmgate_router.balancer import Balancer
from warmgate_router.config import RouterConfig, parse_args
from warmgate_router.view import Endpoint, ready_endpoints


def test_only_ready_not_terminating_endpoints_on_the_server_port_count():
    slices = [
        {
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8080}],
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "a"},
                },
                {
                    "addresses": ["10.0.0.2"],
                    "conditions": {"ready": False},
                    "targetRef": {"name": "b"},
                },
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
            ],
        },
        {"ports": [], "endpoints": [{"addresses": ["10.0.0.9"], "conditions": {"ready": True}}]},
    ]
    assert ready_endpoints(slices) == [Endpoint("10.0.0.1", 8080, "a")]


def test_the_least_busy_pod_is_picked_and_equals_take_turns():
    balancer = Balancer()
    a, b, c = (Endpoint(f"10.0.0.{i}", 8080, str(i)) for i in range(3))
    with balancer.busy(a), balancer.busy(a), balancer.busy(b):
        assert balancer.pick([a, b, c]) == c
        with balancer.busy(c):
            assert balancer.pick([a, b, c]) in (b, c)
        assert balancer.pick([a, b, c], tried={c.key}) == b
    picks = {balancer.pick([a, b, c]) for _ in range(6)}
    assert picks == {a, b, c}
    assert balancer.pick([a], tried={a.key}) is None
    assert balancer.in_flight == {}


def test_flags_and_their_environment_twins(monkeypatch):
    monkeypatch.setenv("WARMGATE_ROUTER_HOLD_SECONDS", "7")
    monkeypatch.setenv("WARMGATE_ROUTER_NAMESPACE", "a,b")
    config = parse_args([])
    assert config.hold_seconds == 7 and config.namespaces == ("a", "b")
    assert parse_args(["--namespace", "c", "--namespace", "d,c"]).namespaces == ("c", "d")
    with pytest.raises(SystemExit):
        parse_args(["--log-format", "xml"])
    assert RouterConfig().port == 8080
