"""Which endpoints of a service's EndpointSlices the router forwards to."""

from __future__ import annotations

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
