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

# Annotations on the server pods' template.
SPEC_HASH_ANNOTATION = "warmgate.dev/spec-hash"
MODEL_ID_ANNOTATION = "warmgate.dev/model-id"
MODEL_REVISION_ANNOTATION = "warmgate.dev/model-revision"

# The server container, its port, and the pod condition the operator owns (the readiness gate).
SERVER_CONTAINER = "server"
SERVER_PORT = 8080
SERVER_PORT_NAME = "http"
WARMED_CONDITION = "warmgate.dev/warmed"

# Reasons of the warmed condition (CamelCase, as Kubernetes API conventions ask).
REASON_VERIFIED = "WarmupVerified"
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
