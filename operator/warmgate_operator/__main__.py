"""`python -m warmgate_operator`: read the configuration, set up logging, build the Operator
(the process's one context object), win the leader election if asked to, and run kopf."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import kopf

from warmgate_contract.names import API_VERSION
from warmgate_kube.client import ApiError, KubeClient
from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE, ResourceKind

from .config import USER_AGENT, ConfigError, OperatorConfig, load_config
from .handlers import register
from .leader import LeaderElector
from .metrics import Metrics
from .runtime import Operator

log = logging.getLogger("warmgate.operator")


def configure_logging(config: OperatorConfig) -> None:
    log_format = kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(debug=config.log_level == "DEBUG", log_format=log_format)
    logging.getLogger().setLevel(config.log_level)
    # The Kubernetes client logs every request at DEBUG; keep it quiet unless asked.
    if config.log_level != "DEBUG":
        logging.getLogger("urllib3").setLevel(logging.WARNING)
        # kopf reports every watch event's handler at INFO: thousands of lines for pods.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


def operator_identity() -> str:
    """This process's name among operators (kopf's peering identity). kopf's default asks the
    password database for the user name, which fails for the image's numeric user (10001 has no
    passwd entry), so the pod name (or host and pid) is used instead."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _lost() -> None:
    """The Lease may be someone else's now: stop at once, writing nothing more. The container
    restarts and this replica stands by again."""
    log.error("leader election lost: exiting so that no two replicas write")
    logging.shutdown()
    os._exit(1)


def _fenced(elector: LeaderElector) -> None:
    """A write found the Lease not renewed in time: say so, then stop as on any loss."""
    elector.report_fenced()
    _lost()


def _elect(config: OperatorConfig, identity: str, metrics: Metrics) -> LeaderElector | None:
    """Block until this replica holds the Lease; None when leader election is off, or when
    it was asked to stop while standing by."""
    client = KubeClient.from_environment(USER_AGENT, max_threads=1)
    elector = LeaderElector(
        client.call_sync,
        config.lease_namespace,
        config.lease_name,
        identity,
        lease_seconds=config.lease_seconds,
        renew_deadline_seconds=config.renew_deadline_seconds,
        retry_seconds=config.retry_seconds,
        on_change=lambda leading: metrics.leader.set(1 if leading else 0),
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: elector.release())
    try:
        if not elector.acquire():
            return None
    finally:
        signal.signal(signal.SIGTERM, previous)
    elector.keep_renewing(_lost)
    return elector


def served(client: KubeClient) -> tuple[ResourceKind, ...]:
    """The custom resource kinds the API serves now (one discovery GET). kopf carries these;
    a kind whose CRD is applied later is watched by the operator itself, since kopf never
    watches a resource it did not find at its start."""
    try:
        found = client.call_sync("GET", f"/apis/{API_VERSION}") or {}
    except ApiError as error:
        if error.status != 404:
            raise
        found = {}
    names = {resource.get("name") for resource in found.get("resources") or []}
    return tuple(kind for kind in (EMBEDDING_SERVICE, EMBEDDING_ALIAS) if kind.plural in names)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"warmgate-operator: {error}", file=sys.stderr)
        return 2
    configure_logging(config)
    metrics = Metrics()
    if config.http_bind is not None:
        metrics.serve(*config.http_bind)
    identity = operator_identity()
    elector = None
    if config.leader_elect:
        elector = _elect(config, identity, metrics)
        if elector is None:
            return 0
    else:
        metrics.leader.set(1)
    client = KubeClient.from_environment(USER_AGENT, max_threads=config.workers)
    if elector is not None:
        client.write_fence = elector.may_write
        client.on_fence = functools.partial(_fenced, elector)
    carried = served(client)
    for kind in {EMBEDDING_SERVICE, EMBEDDING_ALIAS} - set(carried):
        log.warning(
            "the API does not serve %s yet (kubectl apply -f crds/): watching for it; "
            "once it is served, restarting the operator lets kopf carry it",
            kind.kind,
        )
    registry = kopf.OperatorRegistry()
    register(
        registry,
        services=EMBEDDING_SERVICE in carried,
        aliases=EMBEDDING_ALIAS in carried,
    )
    liveness = None
    if config.kopf_probe_address is not None:
        liveness = f"http://{config.kopf_probe_address}/healthz"
    try:
        kopf.run(
            registry=registry,
            standalone=True,
            identity=identity,
            clusterwide=config.clusterwide,
            namespaces=config.namespaces,
            memo=Operator.build(config, client, metrics, carried=carried),
            liveness_endpoint=liveness,
        )
    finally:
        if elector is not None:
            elector.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
