"""The operator's own configuration: one frozen object, read from flags and environment once.

Every flag has an environment twin `WARMGATE_OPERATOR_<FLAG>` (the chart sets environment
variables); a flag wins over its twin.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from warmgate_contract.names import API_VERSION, KIND

from .spec import PULL_POLICIES

DEFAULT_SERVER_IMAGE = "ghcr.io/warmgate/warmgate-server:0.1.0"
FIELD_MANAGER = "warmgate"
USER_AGENT = "warmgate-operator"
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# A Secret's name is a DNS subdomain (RFC 1123).
SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ConfigError(ValueError):
    """A bad flag or environment value; the message says what to change."""


@dataclass(frozen=True)
class OperatorConfig:
    """How this operator process runs.

    default_image: server image for EmbeddingServices that set no `spec.image`.
    namespaces: namespaces to watch; empty means every namespace (cluster-wide).
    log_format: `json` (one object a line, for log collectors) or `text`.
    log_level: DEBUG, INFO, WARNING or ERROR.
    resync_seconds: how often every EmbeddingService is reconciled even when nothing changed,
        to repair drift in children that the operator does not watch.
    workers: how many EmbeddingServices are reconciled at the same time.
    stats_file: where to keep a JSON file of API request counts and peak memory, or None.
    server_image_pull_secrets: names of Secrets (in each EmbeddingService's namespace) that
        every server pod lists in `imagePullSecrets`, for a server image in a private registry.
    server_image_pull_policy: the server container's `imagePullPolicy` (IfNotPresent, Always
        or Never) for EmbeddingServices that set no `spec.imagePullPolicy`; Never suits a
        local cluster whose nodes were loaded with the image.
    hub_endpoint: the Hugging Face hub (or mirror) URL that hub-sourced pods download from
        when their spec names none (HF_ENDPOINT); None: huggingface.co.
    leader_elect: hold a coordination Lease before operating (several replicas: one leads,
        the others stand by and take over when it stops renewing).
    lease_name, lease_namespace: the Lease (namespace: $POD_NAMESPACE, else `default`).
    lease_seconds: how long a Lease nobody renews stays taken (takeover time after a crash).
    http_address: host:port of the operator's HTTP endpoint (/healthz, /metrics), or None.
    kopf_probe_address: host:port of kopf's own liveness endpoint (its `@kopf.on.probe`
        results: whether the first listings are in), or None. Leader only: it starts after the
        election and the first listings, so it is for people and monitors, not for kubelet.
    """

    default_image: str = DEFAULT_SERVER_IMAGE
    namespaces: tuple[str, ...] = ()
    log_format: str = "text"
    log_level: str = "INFO"
    resync_seconds: float = 60.0
    workers: int = 8
    stats_file: str | None = None
    server_image_pull_secrets: tuple[str, ...] = ()
    server_image_pull_policy: str = "IfNotPresent"
    hub_endpoint: str | None = None
    leader_elect: bool = False
    lease_name: str = "warmgate-operator"
    lease_namespace: str = "default"
    lease_seconds: float = 8.0
    http_address: str | None = None
    kopf_probe_address: str | None = None

    @property
    def renew_deadline_seconds(self) -> float:
        """A leader that has not renewed for this long stops writing (before the Lease can
        expire for the others)."""
        return self.lease_seconds * 0.625

    @property
    def retry_seconds(self) -> float:
        return self.lease_seconds / 8

    @property
    def http_bind(self) -> tuple[str, int] | None:
        if self.http_address is None:
            return None
        host, _, port = self.http_address.rpartition(":")
        return host or "0.0.0.0", int(port)

    def __post_init__(self) -> None:
        if not 2 <= self.lease_seconds <= 300:
            raise ConfigError("--lease-seconds must be between 2 and 300")
        for flag, address, example in (
            ("--http-address", self.http_address, "0.0.0.0:8081"),
            ("--kopf-probe-address", self.kopf_probe_address, "127.0.0.1:8082"),
        ):
            if address is not None:
                port = address.rpartition(":")[2]
                if not port.isdigit() or not 0 <= int(port) <= 65535:
                    raise ConfigError(f"{flag} {address!r} must be HOST:PORT, e.g. {example}")
        if self.hub_endpoint is not None and not re.match(r"^https?://[^/\s]+", self.hub_endpoint):
            raise ConfigError(
                f"--hub-endpoint {self.hub_endpoint!r} must be an http(s) URL, "
                "e.g. https://hf-mirror.internal"
            )
        if not self.default_image:
            raise ConfigError("--default-image must not be empty")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.resync_seconds < 1:
            raise ConfigError("--resync-seconds must be at least 1")
        if not 1 <= self.workers <= 64:
            raise ConfigError("--workers must be between 1 and 64")
        if any(not ns for ns in self.namespaces):
            raise ConfigError("--namespace must not be empty; omit it to watch every namespace")
        for secret in self.server_image_pull_secrets:
            if len(secret) > 253 or not SECRET_NAME.match(secret):
                raise ConfigError(
                    f"--server-image-pull-secret {secret!r} is not a Secret name: use lower-case "
                    "letters, digits, '-' and '.', starting and ending with a letter or digit"
                )
        if len(set(self.server_image_pull_secrets)) != len(self.server_image_pull_secrets):
            raise ConfigError("--server-image-pull-secret names a Secret twice: list each once")
        if self.server_image_pull_policy not in PULL_POLICIES:
            raise ConfigError(
                f"--server-image-pull-policy {self.server_image_pull_policy!r} must be one of "
                f"{', '.join(PULL_POLICIES)}"
            )

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    def twin(flag: str, default: object) -> object:
        return env.get("WARMGATE_OPERATOR_" + flag.upper().replace("-", "_"), default)

    defaults = OperatorConfig()
    parser = argparse.ArgumentParser(
        prog="python -m warmgate_operator",
        description=f"warmgate operator: reconciles {KIND}s ({API_VERSION}).",
    )
    parser.add_argument(
        "--default-image",
        default=twin("default-image", defaults.default_image),
        help="server image for EmbeddingServices without spec.image",
    )
    namespaces = twin("namespaces", "")
    parser.add_argument(
        "--namespace",
        dest="namespaces",
        action="append",
        default=None,
        help="namespace to watch (repeat for several); default: all namespaces "
        "(env WARMGATE_OPERATOR_NAMESPACES, comma-separated)",
    )
    parser.set_defaults(env_namespaces=namespaces)
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=twin("log-format", defaults.log_format),
    )
    parser.add_argument("--log-level", default=twin("log-level", defaults.log_level))
    parser.add_argument(
        "--resync-seconds", type=float, default=twin("resync-seconds", defaults.resync_seconds)
    )
    parser.add_argument("--workers", type=int, default=twin("workers", defaults.workers))
    parser.add_argument(
        "--stats-file",
        default=twin("stats-file", None),
        help="keep API request counts and peak memory in this JSON file (benchmarks)",
    )
    parser.add_argument(
        "--server-image-pull-secret",
        dest="server_image_pull_secrets",
        action="append",
        default=None,
        help="Secret that server pods use to pull their image (repeat for several; "
        "env WARMGATE_OPERATOR_SERVER_IMAGE_PULL_SECRETS, comma-separated)",
    )
    parser.set_defaults(env_pull_secrets=twin("server-image-pull-secrets", ""))
    parser.add_argument(
        "--server-image-pull-policy",
        default=twin("server-image-pull-policy", defaults.server_image_pull_policy),
        help="imagePullPolicy of server pods whose EmbeddingService sets none: "
        f"{', '.join(PULL_POLICIES)} (Never: a local cluster whose nodes have the image)",
    )
    parser.add_argument(
        "--hub-endpoint",
        default=twin("hub-endpoint", None),
        help="Hugging Face hub or mirror URL for EmbeddingServices whose hub source names "
        "none (HF_ENDPOINT in the pods); default: huggingface.co",
    )
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=str(twin("leader-elect", "false")).lower() in ("1", "true", "yes", "on"),
        help="hold a coordination Lease before operating (run several replicas)",
    )
    parser.add_argument("--lease-name", default=twin("lease-name", defaults.lease_name))
    parser.add_argument(
        "--lease-namespace",
        default=twin("lease-namespace", env.get("POD_NAMESPACE") or defaults.lease_namespace),
    )
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=twin("lease-seconds", defaults.lease_seconds),
        help="takeover time after the leader dies (it renews every eighth of it)",
    )
    parser.add_argument(
        "--http-address",
        default=twin("http-address", None),
        help="serve /healthz and /metrics (Prometheus) here, e.g. 0.0.0.0:8081",
    )
    parser.add_argument(
        "--kopf-probe-address",
        default=twin("kopf-probe-address", None),
        help="serve kopf's liveness endpoint (/healthz: its probe results) here, e.g. "
        "127.0.0.1:8082; the leader only, once its first listings are in",
    )
    return parser


def load_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> OperatorConfig:
    """Build the configuration from flags and `WARMGATE_OPERATOR_*` variables."""
    env = os.environ if env is None else env
    args = _parser(env).parse_args(argv)
    if args.namespaces:
        namespaces = tuple(args.namespaces)
    else:
        namespaces = tuple(ns.strip() for ns in str(args.env_namespaces).split(",") if ns.strip())
    if args.server_image_pull_secrets is not None:
        pull_secrets = tuple(args.server_image_pull_secrets)
    else:
        pull_secrets = tuple(
            name.strip() for name in str(args.env_pull_secrets).split(",") if name.strip()
        )
    try:
        return OperatorConfig(
            default_image=args.default_image,
            namespaces=namespaces,
            log_format=str(args.log_format),
            log_level=str(args.log_level).upper(),
            resync_seconds=float(args.resync_seconds),
            workers=int(args.workers),
            stats_file=args.stats_file or None,
            server_image_pull_secrets=pull_secrets,
            server_image_pull_policy=str(args.server_image_pull_policy),
            hub_endpoint=args.hub_endpoint or None,
            leader_elect=bool(args.leader_elect),
            lease_name=str(args.lease_name),
            lease_namespace=str(args.lease_namespace),
            lease_seconds=float(args.lease_seconds),
            http_address=args.http_address or None,
            kopf_probe_address=args.kopf_probe_address or None,
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from error
