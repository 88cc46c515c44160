"""Which pod the router picks."""

from __future__ import annotations

from warmgate_router.balancer import Balancer
from warmgate_router.view import Endpoint


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
