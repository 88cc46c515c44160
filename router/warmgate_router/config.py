"""The router's settings: every one a flag with a `WARMGATE_ROUTER_*` environment twin."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass


class ConfigError(ValueError):
    pass


DEFAULT_MAX_HOLD_SECONDS = 600.0
"""The OpenAI SDK's own default timeout: a hold past it would outlast the client."""


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    namespaces: tuple[str, ...] = ()
    """The namespaces whose EmbeddingServices and aliases are served; empty: every one."""
    hold_seconds: float = 120.0
    """How long a request for a service with no warm pod (at zero, or starting) is held while
    the service's time to warm is not measured, and the least it is held once it is (0: none
    is held). A measured service is held 1.5 times its time to warm plus 30 s (hold.py)."""
    max_hold_seconds: float | None = None
    """The longest any request is held, however slowly its service warms: a request whose
    service is expected to take longer is answered at once, 503 with Retry-After. None:
    DEFAULT_MAX_HOLD_SECONDS, or hold_seconds where that is longer (a router told to hold
    longer before the ceiling existed keeps doing so)."""
    max_held_requests: int = 1000
    """How many requests may be held at once, over all services; past it: 503."""
    activity_seconds: float = 10.0
    """Least time between two writes of a service's last-request annotation (per replica)."""
    connect_timeout: float = 3.0
    request_timeout: float = 300.0
    """Most seconds for a pod to answer a forwarded request."""
    drain_seconds: float = 5.0
    """After SIGTERM: seconds of serving on with /ready 503, while endpoints drop this pod."""
    log_format: str = "json"
    log_level: str = "INFO"

    @property
    def hold_ceiling(self) -> float:
        """The longest any request is held (max_hold_seconds, or its default)."""
        if self.max_hold_seconds is not None:
            return self.max_hold_seconds
        return max(DEFAULT_MAX_HOLD_SECONDS, self.hold_seconds)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: use 1..65535")
        if self.hold_seconds < 0:
            raise ConfigError(f"--hold-seconds {self.hold_seconds}: use 0 or more (0: no holding)")
        if self.max_hold_seconds is not None and self.max_hold_seconds < self.hold_seconds:
            raise ConfigError(
                f"--max-hold-seconds {self.max_hold_seconds:g} is below --hold-seconds "
                f"{self.hold_seconds:g}: a service whose time to warm is measured would be held "
                "less than one whose is not; raise --max-hold-seconds or lower --hold-seconds"
            )
        if self.max_held_requests < 0:
            raise ConfigError(f"--max-held-requests {self.max_held_requests}: use 0 or more")
        if self.activity_seconds <= 0:
            raise ConfigError(f"--activity-seconds {self.activity_seconds}: use more than 0")
        if self.connect_timeout <= 0 or self.request_timeout <= 0:
            raise ConfigError("--connect-timeout and --request-timeout must be more than 0")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"--log-format {self.log_format!r}: use json or text")


def _env_name(flag: str) -> str:
    return "WARMGATE_ROUTER_" + flag.upper().replace("-", "_")


def _env(flag: str) -> str | None:
    return os.environ.get(_env_name(flag))


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    defaults = RouterConfig()
    parser = argparse.ArgumentParser(
        prog="warmgate-router",
        description="One OpenAI and text-embeddings-inference endpoint for every "
        "EmbeddingService and EmbeddingAlias: forwards each request to a warm pod of the "
        "service its model name selects; holds requests for a service at zero while it wakes.",
    )

    def add(flag: str, kind: type, default: object, help_: str) -> None:
        env = _env(flag)
        if env is not None:
            try:
                default = kind(env)
            except ValueError:
                hint = (
                    ": Kubernetes sets it when a Service named warmgate-router is in the pod's "
                    "namespace and the pod spec leaves enableServiceLinks on (the chart turns "
                    "it off)"
                    if env.startswith(("tcp://", "udp://", "sctp://"))
                    else ""
                )
                parser.error(f"{_env_name(flag)}={env!r} is not a valid --{flag}{hint}")
        parser.add_argument(f"--{flag}", type=kind, default=default, help=help_)

    add("host", str, defaults.host, "address to listen on")
    add("port", int, defaults.port, "port of the data routes, /healthz, /ready and /metrics")
    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="a namespace to serve (repeat, or comma-separated); none: every namespace "
        "(env WARMGATE_ROUTER_NAMESPACE)",
    )
    add(
        "hold-seconds",
        float,
        defaults.hold_seconds,
        "seconds a request waits for a warm pod of a service whose time to warm is not measured "
        "yet, and the least it waits for one whose is (0: no holding)",
    )
    add(
        "max-hold-seconds",
        float,
        defaults.max_hold_seconds,
        "most seconds any request waits for a warm pod; a service expected to take longer "
        f"gets 503 with Retry-After at once (default {DEFAULT_MAX_HOLD_SECONDS:g}, or "
        "--hold-seconds if longer)",
    )
    add("max-held-requests", int, defaults.max_held_requests, "most requests held at once")
    add(
        "activity-seconds",
        float,
        defaults.activity_seconds,
        "least seconds between two last-request annotations of one service",
    )
    add("connect-timeout", float, defaults.connect_timeout, "seconds to connect to a pod")
    add("request-timeout", float, defaults.request_timeout, "seconds for a pod to answer")
    add("drain-seconds", float, defaults.drain_seconds, "seconds served after SIGTERM")
    add("log-format", str, defaults.log_format, "json or text")
    add("log-level", str, defaults.log_level, "DEBUG, INFO, WARNING or ERROR")
    args = parser.parse_args(argv)
    raw = args.namespace if args.namespace is not None else [_env("namespace") or ""]
    namespaces = tuple(
        dict.fromkeys(n.strip() for item in raw for n in item.split(",") if n.strip())
    )
    try:
        return RouterConfig(
            host=args.host,
            port=args.port,
            namespaces=namespaces,
            hold_seconds=args.hold_seconds,
            max_hold_seconds=args.max_hold_seconds,
            max_held_requests=args.max_held_requests,
            activity_seconds=args.activity_seconds,
            connect_timeout=args.connect_timeout,
            request_timeout=args.request_timeout,
            drain_seconds=args.drain_seconds,
            log_format=args.log_format,
            log_level=args.log_level.upper(),
        )
    except ConfigError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
