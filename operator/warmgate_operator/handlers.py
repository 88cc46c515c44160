"""Thin kopf adapters: kopf runs the operator process (its event loop, signals, credentials
and startup and cleanup phases); each handler here translates one of them into one call on the
Operator that `__main__` built and handed to kopf as its memo.

There are no resource handlers: the operator's watches are its own (watch.py says why), so
kopf adds no finalizer and writes no annotation or status to any object, and deleting an
EmbeddingService or a pod never waits for the operator.
"""

from __future__ import annotations

from typing import Any

import kopf

from .runtime import Operator


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # The operator records its own Events; kopf's per-handler events would be noise.
    settings.posting.enabled = False
    # kopf watches nothing for this operator (watch.py does): its scans of the cluster's
    # namespaces and CRDs would cost two watches and cluster-wide permissions for nothing.
    settings.scanning.disabled = True


def register(registry: kopf.OperatorRegistry) -> None:
    """Attach the handlers to `registry`; kopf passes each the Operator as `memo`."""

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
