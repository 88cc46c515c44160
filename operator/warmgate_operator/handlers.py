"""Thin kopf adapters: kopf runs the operator process (its event loop, signals, credentials,
startup and cleanup phases) and carries the custom resources: every EmbeddingService event (and
every EmbeddingAlias event, when that CRD is served) reaches the Operator that `__main__` built
and handed to kopf as its memo, through one `@kopf.on.event` handler per kind that translates the
event and calls `Operator.observe`.

Only watching handlers are registered, and they return None, so kopf writes nothing to any
object: no finalizer (only a daemon, a timer or a non-optional on.delete adds one), no
`last-handled-configuration` annotation and no progress (only on.create/update/resume write
those), no `status.<handler>` (only a handler's return value is written there), and no Event
(posting is off). Deleting an EmbeddingService never waits for the operator.

What kopf cannot say is kept by the Operator (runtime.py): where a listing starts and ends, and
which objects vanished during a watch gap (kopf's relist yields only the objects that exist, and
an empty relist yields nothing at all; tests/operator/test_handlers.py shows both). The pods
and the other children stay on warmgate's own watches (watch.py says why).
"""

from __future__ import annotations

from typing import Any

import kopf

from warmgate_kube.kinds import EMBEDDING_ALIAS, EMBEDDING_SERVICE, ResourceKind

from .runtime import Operator

KOPF_WATCH_SECONDS = 300
"""How long one of kopf's watch requests lasts before it is renewed from its last resource
version (no listing): the same as warmgate's own watches."""


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # The operator records its own Events; kopf's per-handler events would be noise.
    settings.posting.enabled = False
    # kopf watches the two custom resources named below, in the configured namespaces: its
    # scans of the cluster's namespaces and CRDs would cost two watches and cluster-wide
    # permissions for nothing.
    settings.scanning.disabled = True
    settings.watching.server_timeout = KOPF_WATCH_SECONDS


def _carry(registry: kopf.OperatorRegistry, kind: ResourceKind) -> None:
    group, version = kind.api_version.split("/")

    @kopf.on.event(group, version, kind.plural, registry=registry, id=f"observe-{kind.plural}")
    async def observe(event: kopf.RawEvent, memo: Operator, **_: Any) -> None:
        # kopf's `type` is None for each object of a listing (its first, or one after a 410).
        memo.observe(kind, event["type"], event["object"])


def register(
    registry: kopf.OperatorRegistry, *, services: bool = True, aliases: bool = True
) -> None:
    """Attach the handlers to `registry`; kopf passes each the Operator as `memo`. `services`,
    `aliases`: whether kopf carries EmbeddingServices and EmbeddingAliases (their CRDs are
    served); a kind it does not carry the Operator watches itself, since kopf never watches a
    resource that was absent at its start."""

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own loaders: in-cluster service account first, then the kubeconfig.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Operator, **_: Any) -> None:
        configure_settings(settings)
        await memo.start()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Operator, **_: Any) -> None:
        await memo.stop()

    @kopf.on.probe(registry=registry, id="listed")
    def listed(memo: Operator, **_: Any) -> bool:
        return memo.listed()

    if services:
        _carry(registry, EMBEDDING_SERVICE)
    if aliases:
        _carry(registry, EMBEDDING_ALIAS)
