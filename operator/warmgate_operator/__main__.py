"""`python -m warmgate_operator`: read the configuration, set up logging, run kopf."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence

import kopf

from .config import ConfigError, OperatorConfig, load_config
from .handlers import register


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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"warmgate-operator: {error}", file=sys.stderr)
        return 2
    configure_logging(config)
    registry = kopf.OperatorRegistry()
    register(registry)
    kopf.run(
        registry=registry,
        standalone=True,
        identity=operator_identity(),
        clusterwide=config.clusterwide,
        namespaces=config.namespaces,
        liveness_endpoint=config.liveness_endpoint,
        memo=kopf.Memo(config=config),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
