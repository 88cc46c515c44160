"""The operator's metrics: what kopf's log says about its watches becomes counts and relists."""

from __future__ import annotations

import logging

from warmgate_operator import metrics


def restarts(resource: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value(
            "warmgate_operator_watch_restarts_total", {"resource": resource}
        )
        or 0.0
    )


def test_a_watch_restart_in_kopfs_log_is_counted_and_starts_a_relist() -> None:
    metrics.count_watch_restarts()
    seen: list[str] = []
    metrics.WATCH_RESTART_HOOKS[:] = [seen.append]
    log = logging.getLogger("kopf._cogs.clients.watching")
    before = restarts("pods.v1")
    try:
        log.debug("Starting the watch-stream for pods.v1 in 'ns'.")  # the first start: none
        log.debug("Restarting the watch-stream for pods.v1 in 'ns'.")  # a 410
        log.debug("Watch-stream for pods.v1 in 'ns' is inactive, reconnecting.")
    finally:
        metrics.WATCH_RESTART_HOOKS[:] = []
    assert restarts("pods.v1") - before == 2
    assert seen == ["pods.v1", "pods.v1"]
