"""Shared names: the API, labels, annotations, pod condition and reasons, ports and headers."""

from __future__ import annotations

# The EmbeddingService API.
GROUP = "warmgate.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "EmbeddingService"
PLURAL = "embeddingservices"

# Labels on every child and every server pod.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
SERVICE_LABEL = "warmgate.dev/service"
APP_NAME = "warmgate-server"
MANAGED_BY = "warmgate"
# The operator's own name: its objects' app.kubernetes.io/name, and the source of its Events.
OPERATOR_NAME = "warmgate-operator"
# The controller named in an Event's reportingComponent (events.k8s.io: a qualified name).
REPORTING_COMPONENT = f"{GROUP}/operator"

# Annotations on the server pods' template.
SPEC_HASH_ANNOTATION = "warmgate.dev/spec-hash"
MODEL_ID_ANNOTATION = "warmgate.dev/model-id"
MODEL_REVISION_ANNOTATION = "warmgate.dev/model-revision"

# On every child the operator applies: the hash of what it last applied (skips equal writes).
APPLIED_HASH_ANNOTATION = "warmgate.dev/applied-hash"

# The server container, its port, and the pod condition the operator owns (the readiness gate).
SERVER_CONTAINER = "server"
SERVER_PORT = 8080
SERVER_PORT_NAME = "http"
WARMED_CONDITION = "warmgate.dev/warmed"
# With the warm gate off: the pod condition that records what the pod's server loaded (its
# commit and weights digest), so status.model names the files that serve either way.
LOADED_CONDITION = "warmgate.dev/loaded"
REASON_LOADED = "ModelLoaded"
# Beside either condition, on the pod: what the operator judged, as JSON for machines (the
# pod's uid, its restart count then, the commit and weights digest its server loaded); the
# condition's message is for people.
GATE_STATE_ANNOTATION = "warmgate.dev/gate-state"

# Reasons of the warmed condition (CamelCase, as Kubernetes API conventions ask).
REASON_VERIFIED = "WarmupVerified"
REASON_MEMORY_EXCEEDED = "WarmupMemoryExceeded"
"""Also the /ready report's `failure_reason` when the warmup stopped because a planned shape
would not fit in memory."""
REASON_NOT_READY = "ReportNotReady"
REASON_MODEL_MISMATCH = "ModelMismatch"
REASON_REVISION_MISMATCH = "RevisionMismatch"
REASON_SHAPES_MISSING = "ShapesNotWarmed"
REASON_UNREACHABLE = "ReportUnreachable"
REASON_BAD_REPORT = "ReportInvalid"
REASON_TOO_SLOW = "VerificationTooSlow"
REASON_RESTARTED = "ContainerRestarted"
REASON_FAILED = "WarmupFailed"

# The warmup profile: where the ConfigMap is mounted and the key that holds it.
PROFILE_DIR = "/etc/warmgate/profile"
PROFILE_KEY = "profile.json"
PROFILE_PATH = f"{PROFILE_DIR}/{PROFILE_KEY}"

# Response headers on embedding responses.
REVISION_HEADER = "X-Warmgate-Revision"
COLD_HEADER = "X-Warmgate-Cold"
POD_HEADER = "X-Warmgate-Pod"

# Standby pods (spec.standbyReplicas): the operator labels each Ready pod with its role; with a
# standby pool the Service (and the scale subresource's selector, which the HPA reads) select
# serving pods only. The server learns its role at ROLE_PATH (a standby server closes its
# keep-alive connections, so pooled clients reconnect through the Service to serving pods).
ROLE_LABEL = "warmgate.dev/role"
ROLE_SERVING = "serving"
ROLE_STANDBY = "standby"
ROLE_PATH = "/role"
# Which pods a ReplicaSet deletes first when it scales down (lower first): standby pods go
# before serving ones.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"

# Aliases (the router's names): an EmbeddingAlias gives one EmbeddingService of its namespace a
# second model name; moving it is one object changed, so every request is served wholly by the
# alias's target at the moment the router saw it. aliases.py resolves names.
ALIAS_KIND = "EmbeddingAlias"
ALIAS_PLURAL = "embeddingaliases"
REASON_NAME_CONFLICT = "NameConflict"
REASON_TARGET_MISSING = "TargetMissing"
REASON_RESOLVED = "Resolved"

# The router: which EmbeddingService (namespace/name) answered, and how a TEI request names its
# model (TEI's bodies have no model field).
ROUTER_NAME = "warmgate-router"
SERVICE_HEADER = "X-Warmgate-Service"
ROUTER_HEADER = "X-Warmgate-Router"
"""Which router replica forwarded the answer (its pod's name: its host name)."""
MODEL_HEADER = "X-Warmgate-Model"
# Scale to zero: the router writes the time of the last request it forwarded to an
# EmbeddingService (RFC 3339, UTC, at most every few seconds per service) on the
# EmbeddingService; the operator scales a service with autoscaling.scaleToZero to 0 when that
# is older than idleSeconds, and the router scales it back to 1 when a request comes.
LAST_REQUEST_ANNOTATION = "warmgate.dev/last-request-time"
REASON_SCALED_TO_ZERO = "ScaledToZero"
# How long a wake takes, as the operator measures it and warmgate-router sizes its hold from:
# status.scaleToZero (WAKE_STATUS) holds the last wake's start (spec.replicas leaving 0), the
# moment a pod first served after it, and the seconds between them (a service's first start,
# from its first pod's creation, before any wake). status.startupSeconds: the slowest current
# pod's start, container start to probe passing.
WAKE_STATUS = "scaleToZero"
WOKE_AT_FIELD = "lastWokeAt"
AWAKE_AT_FIELD = "awakeAt"
WAKE_SECONDS_FIELD = "wakeSeconds"
STARTUP_SECONDS_FIELD = "startupSeconds"
